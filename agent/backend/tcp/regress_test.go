package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// serveFake listens on nw and hands each connection it accepts to handle,
// on a goroutine of its own, which closes the connection when handle
// returns. It stops with the test: the listener and every connection are
// closed, and the goroutines waited for.
func serveFake(t testing.TB, nw network, handle func(c net.Conn)) net.Listener {
	t.Helper()
	ln, err := nw.listen("127.0.0.1:0")
	require.NoError(t, err)
	backendtest.ServeConns(t, ln, func(c net.Conn) {
		defer c.Close()
		handle(c)
	})
	return ln
}

// peerAt is the metadata of agent id listening at addr, on this host.
func peerAt(id uuid.UUID, addr net.Addr) agent.Info {
	ci := connInfo{host: hostIdentity(), addr: addr.String()}
	return agent.Info{ID: id, Conns: []agent.ConnInfo{{Backend: Name, Data: ci.marshal()}}}
}

// fakePassive listens on nw, answers handshakes as id, and hands each
// connection to serve. It stops with the test.
func fakePassive(t testing.TB, nw network, id uuid.UUID, serve func(c net.Conn)) agent.Info {
	t.Helper()
	return fakePassiveAnswering(t, nw, handshake{self: id}, serve)
}

// fakePassiveAnswering is fakePassive answering every handshake with ans.
func fakePassiveAnswering(t testing.TB, nw network, ans handshake, serve func(c net.Conn)) agent.Info {
	t.Helper()
	ln := serveFake(t, nw, func(c net.Conn) {
		var hs [hsSize]byte
		if _, err := io.ReadFull(c, hs[:]); err != nil {
			return
		}
		ans.put(hs[:])
		if _, err := c.Write(hs[:]); err != nil {
			return
		}
		serve(c)
	})
	return peerAt(ans.self, ln.Addr())
}

// A peer whose connections die after a few honest answers: every transfer
// either has all its bytes or fails with ErrRemoteLost; none reports success
// without its data.
func TestDyingStreamsNeverFakeSuccess(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		peer := fakePassive(t, nw, uuid.New(), func(c net.Conn) {
			payload := bytes.Repeat([]byte{0xAB}, 4096)
			var hb [hdrSize]byte
			table := make([]byte, pieceSize)
			for served, limit := 0, 1+rand.IntN(6); served < limit; {
				if _, err := io.ReadFull(c, hb[:]); err != nil {
					return
				}
				var h header
				h.get(hb[:])
				if h.typ == tPing {
					continue
				}
				if h.typ != tRead || h.count != 1 {
					return
				}
				if _, err := io.ReadFull(c, table); err != nil {
					return
				}
				n := binary.LittleEndian.Uint64(table[8:])
				ans := header{typ: tReadResp, id: h.id, length: n}
				ans.put(hb[:])
				if _, err := c.Write(append(hb[:], payload[:n]...)); err != nil {
					return
				}
				served++
			}
		})
		a, _ := newAgent(t, nw, WithStreams(1))
		var ok, lost atomic.Int64
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				dst := make([]byte, 4096)
				for range 100 {
					clear(dst)
					x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: peer, Key: agent.NewKey(),
						Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: 4096}}}})
					if !assert.NoError(t, err) {
						return
					}
					<-x.Done()
					switch err := x.Err(); {
					case err == nil:
						if !assert.Equal(t, payload4K(), dst, "a READ reported success without its bytes") {
							return
						}
						ok.Add(1)
					case errors.Is(err, agent.ErrRemoteLost):
						lost.Add(1)
					default:
						t.Errorf("unexpected error: %v", err)
						return
					}
				}
			})
		}
		wg.Wait()
		t.Logf("%d reads complete, %d lost with their connection", ok.Load(), lost.Load())
		require.Positive(t, ok.Load())
	})
}

func payload4K() []byte { return bytes.Repeat([]byte{0xAB}, 4096) }

// A peer that keeps sending keepalives but never answers a request is lost
// within the keepalive timeout: Cancel and Close cannot hang on it.
func TestStalledPeerIsBounded(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		peer := fakePassive(t, nw, uuid.New(), func(c net.Conn) {
			var ping [hdrSize]byte
			(&header{typ: tPing}).put(ping[:])
			go func() { _, _ = io.Copy(io.Discard, c) }()
			for {
				if _, err := c.Write(ping[:]); err != nil {
					return
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
		a, _ := newAgent(t, nw, WithKeepalive(100*time.Millisecond, 500*time.Millisecond))
		dst := make([]byte, 1<<20)
		x := postFake(t, a, agent.OpRead, peer, dst)
		time.Sleep(100 * time.Millisecond)
		start := time.Now()
		x.Cancel(nil)
		select {
		case <-x.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("Cancel hung on a peer that pings but never answers")
		}
		require.Error(t, x.Err())
		t.Logf("cancelled transfer to a stalled peer ended after %v (timeout 500ms): %v", time.Since(start), x.Err())
		closed := make(chan error)
		go func() { closed <- a.Close() }()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Fatal("Close hung")
		}
	})
}

// Claiming a live peer's identity and hanging up reports nothing: only the
// peer's own last connection can.
func TestStrangerCannotReportPeerLost(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		pa, pb := newAgent(t, nw)
		aa, _ := newAgent(t, nw)
		src := make([]byte, 64)
		exp := expose(t, pa, agent.AccessRead, src)
		legitRead(t, aa, pa, exp, src)
		require.Equal(t, aa.ID(), exp.Peer())

		c := dialBackend(t, pb)
		_, err := greet(c, handshake{self: aa.ID(), expect: pa.ID()})
		require.NoError(t, err)
		require.NoError(t, c.Close())
		select {
		case ev := <-exp.Events():
			t.Fatalf("a stranger's hang-up was taken for the peer's loss: %+v", ev)
		case <-time.After(500 * time.Millisecond):
		}
	})
}

// A peer declared departed from outside (a presence registry) fails the
// transfers waiting on its silent connections at once, not at the
// keepalive timeout: the backend drops its connections to it.
func TestDepartedPeerFailsAtOnce(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		peer := fakePassive(t, nw, uuid.New(), func(c net.Conn) {
			_, _ = io.Copy(io.Discard, c) // a black hole: reads, never answers, never pings
		})
		a, _ := newAgent(t, nw, WithKeepalive(5*time.Second, 20*time.Second))
		dst := make([]byte, 1<<20)
		x := postFake(t, a, agent.OpRead, peer, dst)
		time.Sleep(100 * time.Millisecond)
		took := backendtest.Depart(t, a, peer.ID, x, "registry: heartbeats stopped", 10*time.Second)
		t.Logf("transfer to a departed peer ended %v after the departure (keepalive timeout 20s): %v", took, x.Err())
	})
}

// A Notify to a peer that accepts connections but never completes the
// handshake returns once its context is done, with the context's cause,
// not after the keepalive timeout the dial waits; and Close does not wait
// for the handshake either.
func TestNotifyEndsWithContext(t *testing.T) {
	// Reads the handshake, never answers.
	ln := serveFake(t, loopback, func(c net.Conn) { _, _ = io.Copy(io.Discard, c) })
	peer := peerAt(uuid.New(), ln.Addr())
	a, _ := newAgent(t, WithKeepalive(time.Second, 30*time.Second))
	const wait = 100 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	start := time.Now()
	err := a.Notify(ctx, peer, agent.NewKey(), []byte("hi"))
	took := time.Since(start)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Less(t, took, wait+time.Second, "Notify waited for the handshake past its context")
	start = time.Now()
	require.NoError(t, a.Close())
	assert.Less(t, time.Since(start), time.Second, "Close waited for a handshake the peer never answers")
}
