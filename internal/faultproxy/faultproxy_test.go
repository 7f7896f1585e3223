package faultproxy

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// hangGuard turns a hang into a failure; nothing here needs a tenth of it.
const hangGuard = 20 * time.Second

// server is an upstream that hands each accepted connection to the test.
type server struct {
	ln    net.Listener
	conns chan *net.TCPConn
}

func newServer(t *testing.T) *server {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &server{ln: ln, conns: make(chan *net.TCPConn, 16)}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var all []net.Conn
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			all = append(all, c)
			mu.Unlock()
			s.conns <- c.(*net.TCPConn)
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		wg.Wait()
		mu.Lock()
		for _, c := range all {
			_ = c.Close()
		}
		mu.Unlock()
	})
	return s
}

// accept returns the server's end of the next connection.
func (s *server) accept(t *testing.T) *net.TCPConn {
	t.Helper()
	select {
	case c := <-s.conns:
		return c
	case <-time.After(hangGuard):
		t.Fatal("the upstream server got no connection")
		return nil
	}
}

// echo copies everything c receives back to it, then closes it.
func echo(t *testing.T, c *net.TCPConn) {
	var wg sync.WaitGroup
	wg.Go(func() {
		_, _ = io.Copy(c, c)
		_ = c.CloseWrite()
	})
	t.Cleanup(func() {
		_ = c.Close()
		wg.Wait()
	})
}

func newProxy(t *testing.T, upstream string) *Proxy {
	t.Helper()
	p, err := New(upstream)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, p.Close()) })
	return p
}

func dial(t *testing.T, p *Proxy) *net.TCPConn {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c.(*net.TCPConn)
}

// setup returns a proxy in front of a fresh server, a client connection
// through it, and the server's end of that connection.
func setup(t *testing.T) (p *Proxy, client, upstream *net.TCPConn) {
	t.Helper()
	s := newServer(t)
	p = newProxy(t, s.ln.Addr().String())
	client = dial(t, p)
	return p, client, s.accept(t)
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return b
}

// readAll reads exactly n bytes from c within hangGuard.
func readN(t *testing.T, c net.Conn, n int) []byte {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(hangGuard)))
	b := make([]byte, n)
	_, err := io.ReadFull(c, b)
	require.NoError(t, err)
	return b
}

// silent asserts that nothing arrives on c for d.
func silent(t *testing.T, c net.Conn, d time.Duration) {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(d)))
	var b [1]byte
	n, err := c.Read(b[:])
	require.Zero(t, n, "bytes arrived")
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
}

func TestForwardsBothWaysAndPropagatesClose(t *testing.T) {
	p, client, up := setup(t)
	echo(t, up)
	want := randomBytes(1 << 20)
	var wg sync.WaitGroup
	wg.Go(func() {
		_, err := client.Write(want)
		assert.NoError(t, err)
		assert.NoError(t, client.CloseWrite())
	})
	require.NoError(t, client.SetReadDeadline(time.Now().Add(hangGuard)))
	got, err := io.ReadAll(client) // ends with the echo's FIN
	require.NoError(t, err)
	wg.Wait()
	require.True(t, bytes.Equal(want, got), "the echo differs")
	st := p.Stats()
	assert.Equal(t, int64(len(want)), st.Upstream)
	assert.Equal(t, int64(len(want)), st.Downstream)
	assert.Equal(t, 1, st.Accepted)
	require.NoError(t, client.Close())
	require.Eventually(t, func() bool { return p.Stats().Open == 0 }, hangGuard, time.Millisecond)
}

func TestLatencyDelaysWithoutReordering(t *testing.T) {
	p, client, up := setup(t)
	echo(t, up)
	const latency = 40 * time.Millisecond
	p.Latency(Both, latency, 30*time.Millisecond)
	want := randomBytes(256 << 10)
	start := time.Now()
	var wg sync.WaitGroup
	wg.Go(func() { // many small writes, each delayed by its own jitter
		for b := want; len(b) > 0; b = b[min(len(b), 1000):] {
			if _, err := client.Write(b[:min(len(b), 1000)]); !assert.NoError(t, err) {
				return
			}
		}
	})
	got := readN(t, client, len(want))
	wg.Wait()
	rtt := time.Since(start)
	require.True(t, bytes.Equal(want, got), "jitter reordered bytes")
	// The first byte came back after two delays of at least 10 ms each.
	assert.GreaterOrEqual(t, rtt, 20*time.Millisecond)

	p.Latency(Both, 0, 0)
	start = time.Now()
	_, err := client.Write([]byte{1})
	require.NoError(t, err)
	readN(t, client, 1)
	t.Logf("round trip with 40±30 ms each way: %v for 256 KiB; without: %v", rtt, time.Since(start))
}

func TestBandwidthLimitIsShared(t *testing.T) {
	s := newServer(t)
	p := newProxy(t, s.ln.Addr().String())
	const rate = 1 << 20 // bytes per second, both connections together
	p.Bandwidth(Downstream, rate)
	const n = 128 << 10
	start := time.Now()
	var wg sync.WaitGroup
	for range 2 {
		c := dial(t, p)
		up := s.accept(t)
		wg.Go(func() {
			_, err := up.Write(randomBytes(n))
			assert.NoError(t, err)
		})
		wg.Go(func() {
			_ = c.SetReadDeadline(time.Now().Add(hangGuard))
			_, err := io.ReadFull(c, make([]byte, n))
			assert.NoError(t, err)
		})
	}
	wg.Wait()
	took := time.Since(start)
	// The first quantum of each direction goes at once.
	quantum := int64(rate) * int64(paceQuantum) / int64(time.Second)
	floor := time.Duration((2*n - quantum) * int64(time.Second) / rate)
	assert.GreaterOrEqual(t, took, floor)
	t.Logf("2 × %d KiB at %d KiB/s: %v (floor %v)", n>>10, rate>>10, took, floor)
}

func TestStallHoldsBytesUntilResumed(t *testing.T) {
	p, client, up := setup(t)
	p.Stall(Upstream)
	want := randomBytes(100 << 10)
	_, err := client.Write(want) // buffered by the proxy and the kernel
	require.NoError(t, err)
	silent(t, up, 200*time.Millisecond)
	// The other direction still flows.
	_, err = up.Write([]byte("pong"))
	require.NoError(t, err)
	assert.Equal(t, []byte("pong"), readN(t, client, 4))

	p.Resume(Upstream)
	require.True(t, bytes.Equal(want, readN(t, up, len(want))), "bytes held by a stall differ")

	p.Stall(Both)
	_, err = up.Write([]byte("x"))
	require.NoError(t, err)
	silent(t, client, 100*time.Millisecond)
	p.Heal()
	assert.Equal(t, []byte("x"), readN(t, client, 1))
}

func TestResetSendsRST(t *testing.T) {
	s := newServer(t)
	p := newProxy(t, s.ln.Addr().String())
	client := dial(t, p)
	up := s.accept(t)
	p.Stall(Both) // bytes held in the proxy are lost with the connection
	_, err := client.Write([]byte("lost"))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return p.Stats().Open == 1 }, hangGuard, time.Millisecond)
	assert.Equal(t, 1, p.Reset())
	for _, c := range []*net.TCPConn{client, up} {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(hangGuard)))
		_, err := c.Read(make([]byte, 8))
		require.ErrorIs(t, err, syscall.ECONNRESET)
	}
	st := p.Stats()
	assert.Equal(t, 1, st.Resets)
	assert.Zero(t, st.Upstream)

	// A new connection is proxied as usual.
	p.Heal()
	c := dial(t, p)
	echo(t, s.accept(t))
	_, err = c.Write([]byte("hi"))
	require.NoError(t, err)
	assert.Equal(t, []byte("hi"), readN(t, c, 2))
}

func TestRefuseResetsNewConnections(t *testing.T) {
	s := newServer(t)
	p := newProxy(t, s.ln.Addr().String())
	p.Refuse(true)
	refused(t, p)
	assert.Equal(t, 1, p.Stats().Refused)

	p.Refuse(false)
	c := dial(t, p)
	up := s.accept(t)
	echo(t, up)
	_, err := c.Write([]byte("back"))
	require.NoError(t, err)
	assert.Equal(t, []byte("back"), readN(t, c, 4))
}

// refused dials p and expects a reset, at once or at the first read.
func refused(t *testing.T, p *Proxy) {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr())
	if err == nil {
		defer c.Close()
		require.NoError(t, c.SetReadDeadline(time.Now().Add(hangGuard)))
		_, err = c.Read(make([]byte, 1))
	}
	require.True(t, errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF), "want a reset, got %v", err)
	require.Eventually(t, func() bool { return p.Stats().Refused > 0 }, hangGuard, time.Millisecond)
}

func TestNoUpstreamRefuses(t *testing.T) {
	p := newProxy(t, "")
	refused(t, p)
	assert.Equal(t, 1, p.Stats().Refused)

	s := newServer(t)
	p.SetUpstream(s.ln.Addr().String())
	c := dial(t, p)
	echo(t, s.accept(t))
	_, err := c.Write([]byte("ok"))
	require.NoError(t, err)
	assert.Equal(t, []byte("ok"), readN(t, c, 2))
}

func TestHalfOpenServer(t *testing.T) {
	p, client, up := setup(t)
	require.Eventually(t, func() bool { return p.Stats().Open == 1 }, hangGuard, time.Millisecond)
	assert.Equal(t, 1, p.HalfOpen(Server))
	// The server's end is reset.
	require.NoError(t, up.SetReadDeadline(time.Now().Add(hangGuard)))
	_, err := up.Read(make([]byte, 1))
	require.ErrorIs(t, err, syscall.ECONNRESET)
	// The client's end hears nothing, not even a FIN, and may write.
	for range 10 {
		_, err = client.Write(randomBytes(64 << 10))
		require.NoError(t, err)
	}
	silent(t, client, 200*time.Millisecond)
	assert.Equal(t, 1, p.Stats().Open)
	// Closing the client ends the link.
	require.NoError(t, client.Close())
	require.Eventually(t, func() bool { return p.Stats().Open == 0 }, hangGuard, time.Millisecond)
	assert.Equal(t, 1, p.Stats().HalfOpened)
}

func TestHalfOpenClient(t *testing.T) {
	p, client, up := setup(t)
	require.Eventually(t, func() bool { return p.Stats().Open == 1 }, hangGuard, time.Millisecond)
	p.HalfOpen(Client)
	require.NoError(t, client.SetReadDeadline(time.Now().Add(hangGuard)))
	_, err := client.Read(make([]byte, 1))
	require.ErrorIs(t, err, syscall.ECONNRESET)
	_, err = up.Write([]byte("into the void"))
	require.NoError(t, err)
	silent(t, up, 200*time.Millisecond)
}

func TestHalfCloseOneDirection(t *testing.T) {
	p, client, up := setup(t)
	require.Eventually(t, func() bool { return p.Stats().Open == 1 }, hangGuard, time.Millisecond)
	assert.Equal(t, 1, p.HalfClose(Downstream))
	require.NoError(t, client.SetReadDeadline(time.Now().Add(hangGuard)))
	_, err := client.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
	// Upstream still flows; what the server sends back is discarded.
	_, err = up.Write([]byte("dropped"))
	require.NoError(t, err)
	_, err = client.Write([]byte("still"))
	require.NoError(t, err)
	assert.Equal(t, []byte("still"), readN(t, up, 5))
	assert.Equal(t, 1, p.Stats().HalfClosed)
}

// A function armed with When runs before the chunk that passes its
// threshold goes on: a stall it injects stops the stream at that point.
func TestWhenInjectsMidStream(t *testing.T) {
	p, client, up := setup(t)
	const at = 200 << 10
	fired := make(chan int64, 1)
	p.When(Upstream, at, func() {
		p.Stall(Upstream)
		fired <- p.Stats().Upstream
	})
	never := p.When(Upstream, at/2, func() { t.Error("a disarmed trigger fired") })
	require.True(t, never())
	require.False(t, never(), "disarmed twice")
	want := randomBytes(1 << 20)
	var wg sync.WaitGroup
	wg.Go(func() {
		_, _ = client.Write(want) // blocks once the buffers are full
	})
	var before int64
	select {
	case before = <-fired:
	case <-time.After(hangGuard):
		t.Fatal("the trigger never fired")
	}
	assert.LessOrEqual(t, before, int64(at))
	assert.Greater(t, before, int64(at-chunkSize))
	got := readN(t, up, int(before))
	silent(t, up, 100*time.Millisecond)
	assert.Equal(t, before, p.Stats().Upstream, "bytes went on after the stall")
	p.Resume(Upstream)
	got = append(got, readN(t, up, len(want)-len(got))...)
	wg.Wait()
	require.True(t, bytes.Equal(want, got))
}

func TestCloseEndsEverything(t *testing.T) {
	s := newServer(t)
	p, err := New(s.ln.Addr().String())
	require.NoError(t, err)
	p.Stall(Both)
	var conns []*net.TCPConn
	for range 4 {
		c := dial(t, p)
		_, err := c.Write(randomBytes(300 << 10))
		_ = err
		conns = append(conns, c)
	}
	for range 4 {
		s.accept(t)
	}
	require.NoError(t, p.Close())
	require.NoError(t, p.Close(), "Close is idempotent")
	for _, c := range conns {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(hangGuard)))
		_, err := c.Read(make([]byte, 1))
		require.Error(t, err)
	}
	_, err = net.Dial("tcp", p.Addr())
	require.Error(t, err, "the proxy still listens")
}
