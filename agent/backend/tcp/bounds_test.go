package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// busyPinger is a passive peer that reads every request and never answers
// one, while pinging "busy" as if each were still arriving, and claiming a
// byte more of it every time.
func busyPinger(c net.Conn) {
	go func() { _, _ = io.Copy(io.Discard, c) }()
	var ping [hdrSize]byte
	for n := uint64(1); ; n++ {
		(&header{typ: tPing, status: stBusy, id: uint64(hsSize) + n}).put(ping[:])
		_ = c.SetWriteDeadline(time.Now().Add(time.Second))
		if _, err := c.Write(ping[:]); err != nil {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A peer whose pings say "busy" forever, but which never answers, cannot
// hold a transfer: it is lost within a bounded time, cancelling it ends it
// at once without waiting for the peer, and Close returns.
func TestBusyPingsCannotHoldTransfers(t *testing.T) {
	// post starts a READ of n bytes from a peer pinging busy forever, on
	// an agent with opts, inside a bubble.
	post := func(t *testing.T, nw *memNet, n int, opts ...Option) (*agent.Agent, *agent.Xfer) {
		peer := fakePassive(t, nw, uuid.New(), busyPinger)
		a, _ := newAgent(t, append(opts, nw)...)
		x := postFake(t, a, agent.OpRead, peer, make([]byte, n))
		return a, x
	}
	for _, n := range []int{4 << 10, 1 << 20} { // inline, and driven from a goroutine
		t.Run("lost", func(t *testing.T) {
			bubble(t, func(t *testing.T, nw *memNet) {
				_, x := post(t, nw, n, WithKeepalive(50*time.Millisecond, 300*time.Millisecond))
				took := backendtest.DoneWithin(t, x, 10*time.Second, "a peer pinging busy and never answering")
				require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
				t.Logf("%d bytes: lost after %v (timeout 300ms): %v", n, took, x.Err())
			})
		})
		t.Run("cancel", func(t *testing.T) {
			bubble(t, func(t *testing.T, nw *memNet) {
				// The timeout is long: only the cancellation can end it.
				_, x := post(t, nw, n, WithKeepalive(time.Second, 30*time.Second))
				time.Sleep(100 * time.Millisecond)
				x.Cancel(nil)
				took := backendtest.DoneWithin(t, x, 5*time.Second, "Cancel")
				require.ErrorIs(t, x.Err(), agent.ErrCancelled)
				t.Logf("%d bytes: cancelled after %v", n, took)
			})
		})
		t.Run("close", func(t *testing.T) {
			bubble(t, func(t *testing.T, nw *memNet) {
				a, x := post(t, nw, n, WithKeepalive(time.Second, 30*time.Second))
				time.Sleep(100 * time.Millisecond)
				_ = backendtest.CloseWithin(t, a, 5*time.Second, "a peer pinging busy")
				require.Error(t, x.Err())
			})
		})
	}
}

// Cancelling a transfer whose answer is still arriving ends it at once,
// and the connection's reader no longer touches the transfer's memory:
// the peer's later bytes land nowhere.
func TestCancelFencesLandingRead(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		const size = 8 << 20
		peer := fakePassive(t, nw, uuid.New(), func(c net.Conn) {
			req, table, err := readRequest(c)
			if err != nil || len(table) < pieceSize {
				return
			}
			go func() { _, _ = io.Copy(io.Discard, c) }()
			n := binary.LittleEndian.Uint64(table[8:])
			var hb [hdrSize]byte
			(&header{typ: tReadResp, id: req.id, length: n}).put(hb[:])
			if _, err := c.Write(hb[:]); err != nil {
				return
			}
			chunk := bytes.Repeat([]byte{0xEE}, 128<<10)
			for sent := uint64(0); sent < n; sent += uint64(len(chunk)) {
				if _, err := c.Write(chunk[:min(uint64(len(chunk)), n-sent)]); err != nil {
					return
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
		a, _ := newAgent(t, nw, WithStreams(1), WithChunkSize(size), WithKeepalive(time.Second, 30*time.Second))
		dst := make([]byte, size)
		x := postFake(t, a, agent.OpRead, peer, dst)
		time.Sleep(300 * time.Millisecond) // some of the answer has landed
		x.Cancel(nil)
		took := backendtest.DoneWithin(t, x, time.Second, "Cancel during a trickled answer")
		require.ErrorIs(t, x.Err(), agent.ErrCancelled)
		landed := bytes.Clone(dst)
		time.Sleep(300 * time.Millisecond) // the peer goes on sending
		require.Equal(t, landed, dst, "bytes landed in the transfer's memory after it finished")
		t.Logf("cancelled after %v, %d bytes landed", took, bytes.Count(landed, []byte{0xEE}))
	})
}

// Cancelling a WRITE whose frame is still being written ends it at once,
// and the connection's writer no longer reads the transfer's memory: what
// the peer receives afterwards is never the bytes put there after Done.
func TestCancelFencesWritingWrite(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		const size = 8 << 20
		var mu sync.Mutex
		var got []byte
		peer := fakePassive(t, nw, uuid.New(), func(c net.Conn) {
			if _, _, err := readRequest(c); err != nil {
				return
			}
			buf := make([]byte, 32<<10)
			for {
				n, err := c.Read(buf)
				mu.Lock()
				got = append(got, buf[:n]...)
				mu.Unlock()
				if err != nil {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
		a, _ := newAgent(t, nw, WithStreams(1), WithChunkSize(size), WithKeepalive(time.Second, 30*time.Second))
		src := bytes.Repeat([]byte{0x5A}, size)
		x := postFake(t, a, agent.OpWrite, peer, src)
		time.Sleep(300 * time.Millisecond)
		x.Cancel(nil)
		took := backendtest.DoneWithin(t, x, time.Second, "Cancel during a slowly taken WRITE")
		require.ErrorIs(t, x.Err(), agent.ErrCancelled)
		for i := range src { // the memory is the caller's again
			src[i] = 0xFF
		}
		time.Sleep(500 * time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		require.NotContains(t, string(got), "\xff\xff\xff\xff", "the writer read the transfer's memory after it finished")
		t.Logf("cancelled after %v; the peer had taken %d bytes", took, len(got))
	})
}

// A token holder trickling a frame, fast enough to stay within the
// per-timeout progress rule, cannot hold Revoke longer than the stated
// bound: one keepalive timeout, then the lease is dropped.
func TestRevokeBoundedAgainstTrickledFrames(t *testing.T) {
	const timeout = 300 * time.Millisecond
	const size = 16 << 20
	trickleOut := func(c net.Conn, data []byte, stop <-chan struct{}) {
		for len(data) > 0 {
			n := min(len(data), 100<<10) // > 64 KiB per timeout: alive by the progress rule
			if _, err := c.Write(data[:n]); err != nil {
				return
			}
			data = data[n:]
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
	revokeWithin := func(t *testing.T, e *agent.Exposure, mem []byte) {
		t.Helper()
		start := time.Now()
		done := make(chan struct{})
		go func() { e.Revoke(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatalf("Revoke still waiting after 5s on a trickled frame (keepalive timeout %v)", timeout)
		}
		took := time.Since(start)
		t.Logf("Revoke returned after %v (keepalive timeout %v)", took, timeout)
		assert.Less(t, took, timeout+timeout/2, "Revoke waited longer than the stated bound")
		snap := bytes.Clone(mem)
		time.Sleep(2 * timeout)
		require.Equal(t, snap, mem, "the exposed memory changed after Revoke returned")
	}
	t.Run("WRITE payload", func(t *testing.T) {
		bubble(t, func(t *testing.T, nw *memNet) {
			a, b := newAgent(t, nw, WithKeepalive(50*time.Millisecond, timeout))
			mem := make([]byte, size)
			e := expose(t, a, agent.AccessWrite, mem)
			p, _ := dialHostile(t, b, a.ID())
			f := frameBytes(header{typ: tWrite, count: 1, id: 1, length: size, key: e.Key()}, [][2]uint64{{agent.DRAM(mem).Addr, size}},
				bytes.Repeat([]byte{0xEE}, size))
			stop := make(chan struct{})
			defer close(stop)
			go trickleOut(p.c, f, stop)
			time.Sleep(500 * time.Millisecond)
			require.Equal(t, p.id, e.Peer(), "the trickled WRITE holds a lease")
			revokeWithin(t, e, mem)
		})
	})
	t.Run("READ answer", func(t *testing.T) {
		bubble(t, func(t *testing.T, nw *memNet) {
			a, b := newAgent(t, nw, WithKeepalive(50*time.Millisecond, timeout))
			mem := bytes.Repeat([]byte{exposedB}, size)
			e := expose(t, a, agent.AccessRead, mem)
			p, _ := dialHostile(t, b, a.ID())
			setReadBuffer(t, p.c, 4096)
			p.frame(header{typ: tRead, count: 1, id: 1, key: e.Key()}, [][2]uint64{{agent.DRAM(mem).Addr, size}}, nil)
			stop := make(chan struct{})
			var wg sync.WaitGroup
			defer wg.Wait()
			defer close(stop)
			wg.Go(func() { // take the answer at 200 KiB every 100 ms
				buf := make([]byte, 200<<10)
				for {
					_ = p.c.SetReadDeadline(time.Now().Add(10 * time.Second))
					if _, err := io.ReadFull(p.c, buf); err != nil {
						return
					}
					select {
					case <-stop:
						return
					case <-time.After(100 * time.Millisecond):
					}
				}
			})
			time.Sleep(500 * time.Millisecond)
			revokeWithin(t, e, mem)
		})
	})
}

// setReadBuffer lets c's peer write about n bytes ahead of c's reads.
func setReadBuffer(t testing.TB, c net.Conn, n int) {
	t.Helper()
	if r, ok := c.(*recorder); ok {
		c = r.Conn
	}
	switch c := c.(type) {
	case *net.TCPConn:
		require.NoError(t, c.SetReadBuffer(n))
	case *memConn:
		c.setReadBuffer(n)
	default:
		t.Fatalf("no read buffer to set on a %T", c)
	}
}

// Tokens naming made-up agents at one address leave the dialling agent
// with a bounded number of connections, and none once they are idle.
func TestForgedIdentitiesDoNotHoardConnections(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		// Made-up agents at one address: each answers the handshake as the
		// agent expected, and refuses every request. The listener counts
		// the connections open at once exactly (memListener).
		ln := serveFake(t, nw, func(c net.Conn) {
			var hs [hsSize]byte
			if _, err := io.ReadFull(c, hs[:]); err != nil {
				return
			}
			in, err := getHandshake(hs[:])
			if err != nil {
				return
			}
			(&handshake{self: in.expect}).put(hs[:])
			if _, err := c.Write(hs[:]); err != nil {
				return
			}
			for {
				req, _, err := readRequest(c)
				if err != nil {
					return
				}
				msg := []byte("access denied")
				var hb [hdrSize]byte
				(&header{typ: tReadResp, status: stDenied, id: req.id, length: uint64(len(msg))}).put(hb[:])
				if _, err := c.Write(append(hb[:], msg...)); err != nil {
					return
				}
			}
		})
		ml := ln.(*memListener)
		const bound = 50
		a, _ := newAgent(t, nw, WithMaxOutgoingPerIP(bound), WithIdleTimeout(300*time.Millisecond))
		dst := make([]byte, 64)
		for range 100 {
			x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: peerAt(uuid.New(), ln.Addr()), Key: agent.NewKey(),
				Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: 64}}}})
			require.NoError(t, err)
			<-x.Done()
			require.ErrorIs(t, x.Err(), agent.ErrAccessDenied)
		}
		t.Logf("at most %d connections at once, %d after the last transfer", ml.peak.Load(), ml.open.Load())
		// The peers evicted to make room are closed before the next one
		// is dialled.
		assert.LessOrEqual(t, ml.peak.Load(), int64(bound), "the dialling agent held more connections than its bound")
		time.Sleep(time.Second) // three idle timeouts
		assert.Zero(t, ml.open.Load(), "idle connections to made-up agents were never closed")
	})
}

// A stranger that claims an honest peer's identity cannot make the
// exposures that peer used hear of a loss by hanging up, nor hide the
// peer's real loss by holding a connection open.
func TestStrangerClaimingAPeerIDOverTCP(t *testing.T) {
	stranger := func(t *testing.T, b *Backend, claimed, expect uuid.UUID) net.Conn {
		t.Helper()
		c := dialBackend(t, b)
		in, err := greet(c, handshake{self: claimed, expect: expect, timeout: time.Minute})
		require.NoError(t, err)
		require.Equal(t, uint8(stOK), in.status)
		go func() { _, _ = io.Copy(io.Discard, c) }()
		pinger(t, c, 100*time.Millisecond) // stays alive for as long as it likes
		return c
	}
	// agents starts the passive agent pa, exposing src under e, and the
	// active agent aa, whose identity the stranger claims.
	agents := func(t *testing.T, nw *memNet) (pa *agent.Agent, pb *Backend, aa *agent.Agent, e *agent.Exposure, src []byte) {
		pa, pb = newAgent(t, nw)
		aa, _ = newAgent(t, nw)
		src = make([]byte, 64)
		return pa, pb, aa, expose(t, pa, agent.AccessRead, src), src
	}
	t.Run("hang-up after the peer's operation", func(t *testing.T) {
		bubble(t, func(t *testing.T, nw *memNet) {
			pa, pb, aa, e, src := agents(t, nw)
			held := stranger(t, pb, aa.ID(), pa.ID()) // connected before the peer
			legitRead(t, aa, pa, e, src)
			require.NoError(t, held.Close())
			c := stranger(t, pb, aa.ID(), pa.ID())
			require.NoError(t, c.Close())
			select {
			case ev := <-e.Events():
				t.Fatalf("a stranger's hang-up was taken for the peer's loss: %+v", ev)
			case <-time.After(500 * time.Millisecond):
			}
		})
	})
	t.Run("the peer's real loss while a stranger holds on", func(t *testing.T) {
		bubble(t, func(t *testing.T, nw *memNet) {
			pa, pb, aa, e, src := agents(t, nw)
			_ = stranger(t, pb, aa.ID(), pa.ID()) // connected before the peer, and stays
			legitRead(t, aa, pa, e, src)
			require.NoError(t, aa.Close())
			select {
			case ev := <-e.Events():
				require.Equal(t, agent.EventPeerLost, ev.Kind)
				require.Equal(t, aa.ID(), ev.From)
			case <-time.After(10 * time.Second):
				t.Fatal("the peer's departure was not reported within 10s while a stranger held a connection under its ID")
			}
		})
	})
}
