//go:build linux

package cma

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/serve"
)

// delta returns what each counter moved by from before to after.
var delta = serve.Delta

// waitStats waits until b's counters moved by want since before, and fails
// if they moved by anything else.
func waitStats(t testing.TB, b *Backend, before, want Stats) {
	t.Helper()
	require.Eventually(t, func() bool { return delta(b.Stats(), before) == want }, 10*time.Second, time.Millisecond,
		"want counters to move by %+v, got %+v", want, delta(b.Stats(), before))
}

// legitRead has active READ src, exposed by passive as exp, and checks the
// bytes: the agent still serves honest peers.
func legitRead(t testing.TB, active, passive *agent.Agent, exp *agent.Exposure, src []byte) {
	t.Helper()
	dst := make([]byte, len(src))
	x, err := active.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: passive.Info(), Key: exp.Key(),
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}})
	require.NoError(t, err)
	select {
	case <-x.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("a legitimate transfer hung")
	}
	require.NoError(t, x.Err(), "a legitimate transfer failed")
	require.Equal(t, Name, x.Backend())
	require.Equal(t, src, dst)
}

func TestLimitOptions(t *testing.T) {
	for _, o := range []Option{WithMaxConnsPerProcess(0), WithMaxHandshakes(0)} {
		_, err := agent.New(agent.WithBackends(New(o)))
		require.ErrorIs(t, err, agent.ErrInvalidOption)
	}
}

// trickle writes b one byte every gap until the server drops the
// connection; it returns how long that took from the first byte.
func trickle(t *testing.T, p *rawPeer, b []byte, gap time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		_ = p.c.SetReadDeadline(time.Now().Add(20 * time.Second))
		_, _ = io.Copy(io.Discard, p.br)
	}()
	for _, x := range b {
		select {
		case <-gone:
			return time.Since(start)
		case <-time.After(gap):
		}
		if _, err := p.c.Write([]byte{x}); err != nil {
			break
		}
	}
	select {
	case <-gone:
	case <-time.After(20 * time.Second):
		t.Fatal("the server never dropped a slow peer")
	}
	return time.Since(start)
}

// A peer that trickles a handshake or a frame is cut within the timeout and
// counted; one that is merely idle between frames keeps its connection (the
// copying side holds it open without keepalives).
func TestSlowLoris(t *testing.T) {
	const timeout = 300 * time.Millisecond
	a, b := newAgent(t, WithTimeout(timeout))
	honest, _ := newAgent(t)
	src := bytes.Repeat([]byte{0x5A}, 4096)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	begin := frameBytes(header{typ: tBegin, status: uint8(agent.AccessRead), count: 2, id: 1, key: exp.Key()},
		[][2]uint64{{agent.DRAM(src).Addr, 16}, {agent.DRAM(src).Addr + 16, 16}}, nil)
	const gap = 20 * time.Millisecond
	for _, tc := range []struct {
		name   string
		attack func(t *testing.T) time.Duration
	}{
		{"handshake", func(t *testing.T) time.Duration {
			p := dialRaw(t, b)
			var hs [hsSize]byte
			(&handshake{self: p.id, expect: a.ID(), pid: uint32(os.Getpid())}).put(hs[:])
			return trickle(t, p, hs[:], gap)
		}},
		{"header", func(t *testing.T) time.Duration {
			p := joinRaw(t, a, b)
			return trickle(t, p, begin[:hdrSize], gap)
		}},
		{"range table", func(t *testing.T) time.Duration {
			p := joinRaw(t, a, b)
			_, err = p.c.Write(begin[:hdrSize+3])
			require.NoError(t, err)
			return trickle(t, p, begin[hdrSize+3:], gap)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := b.Stats()
			took := tc.attack(t)
			t.Logf("cut after %v (timeout %v)", took, timeout)
			waitStats(t, b, before, Stats{Disconnected: 1, Timeouts: 1})
			legitRead(t, honest, a, exp, src)
		})
	}
	t.Run("idle between frames", func(t *testing.T) {
		before := b.Stats()
		p := joinRaw(t, a, b)
		time.Sleep(3 * timeout)
		p.send(header{typ: tBegin, status: uint8(agent.AccessRead), count: 1, id: 1, key: exp.Key()}, [][2]uint64{{agent.DRAM(src).Addr, 16}}, nil)
		h, _, err := p.grant()
		require.NoError(t, err)
		require.Equal(t, uint8(stOK), h.status)
		p.send(header{typ: tEnd, id: 1}, nil, nil)
		assert.Equal(t, Stats{}, delta(b.Stats(), before))
	})
	assert.Equal(t, bytes.Repeat([]byte{0x5A}, 4096), src)
}

// A flood of connections that never handshake holds at most
// WithMaxHandshakes of them, the oldest closed and counted; an honest peer
// gets through while the flood goes on. One process is held to
// WithMaxConnsPerProcess.
func TestConnectionFloods(t *testing.T) {
	t.Run("handshakes", func(t *testing.T) {
		const limit = 8
		a, b := newAgent(t, WithMaxHandshakes(limit), WithTimeout(30*time.Second))
		honest, _ := newAgent(t)
		src := bytes.Repeat([]byte{0x5A}, 4096)
		exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
		require.NoError(t, err)
		before := b.Stats()
		var mu sync.Mutex
		var conns []net.Conn
		defer func() {
			mu.Lock()
			defer mu.Unlock()
			for _, c := range conns {
				_ = c.Close()
			}
		}()
		open := func() {
			c, err := net.Dial("unix", "@"+b.self.sock)
			require.NoError(t, err)
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
		const flood = 100
		for range flood {
			open()
		}
		require.Eventually(t, func() bool { return b.Stats().LimitRejected-before.LimitRejected == flood-limit }, 10*time.Second, time.Millisecond)
		stop := make(chan struct{})
		var wg sync.WaitGroup
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				case <-time.After(time.Millisecond):
					open()
				}
			}
		})
		for range 3 {
			legitRead(t, honest, a, exp, src)
		}
		close(stop)
		wg.Wait()
		got := delta(b.Stats(), before)
		assert.Equal(t, got.LimitRejected, got.Disconnected)
		_ = conns[0].SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = conns[0].Read(make([]byte, 1))
		var ne net.Error
		require.Error(t, err)
		require.False(t, errors.As(err, &ne) && ne.Timeout(), "the oldest handshake was kept")
	})
	t.Run("one process", func(t *testing.T) {
		const limit = 4
		a, b := newAgent(t, WithMaxConnsPerProcess(limit))
		before := b.Stats()
		var ok, refused int
		for range limit + 3 {
			p := dialRaw(t, b)
			var hs [hsSize]byte
			(&handshake{self: p.id, expect: a.ID(), pid: uint32(os.Getpid())}).put(hs[:])
			_, _ = p.c.Write(hs[:]) // a refused connection may be closed already
			_ = p.c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.ReadFull(p.br, hs[:]); err != nil {
				var ne net.Error
				require.False(t, errors.As(err, &ne) && ne.Timeout(), "a connection over the limit was kept")
				refused++
				continue
			}
			in, err := getHandshake(hs[:])
			require.NoError(t, err)
			require.Equal(t, uint8(stOK), in.status)
			ok++
		}
		assert.Equal(t, limit, ok)
		assert.Equal(t, 3, refused)
		waitStats(t, b, before, Stats{Disconnected: 3, LimitRejected: 3})
	})
}

// Lease requests after the agent closed get nothing: the connection is
// closed and no lease is granted.
func TestRequestsAfterAgentClosed(t *testing.T) {
	a, b := newAgent(t)
	src := make([]byte, 4096)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	p := joinRaw(t, a, b)
	require.NoError(t, a.Close())
	_, _ = p.c.Write(frameBytes(header{typ: tBegin, status: uint8(agent.AccessRead), count: 1, id: 1, key: exp.Key()}, [][2]uint64{{agent.DRAM(src).Addr, 16}}, nil))
	_ = p.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(p.br)
	var ne net.Error
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "a closed agent kept the connection")
	for len(got) >= hdrSize {
		var h header
		h.get(got)
		require.NotEqual(t, uint8(stOK), h.status, "a closed agent granted a lease")
		got = got[min(len(got), hdrSize+int(h.length)):]
	}
}
