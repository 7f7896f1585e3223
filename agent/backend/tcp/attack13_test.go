package tcp

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/serve"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// Attacks on the adoption of agent/backend/internal/serve (issue 13) and on
// the backend's lifetime moving to agent.Host.Context. Helpers here are
// prefixed a13 so that they do not collide with the package's harness.

// a13Agent starts an agent on b and closes it when the test ends.
// a13Dial connects to b's listener.
func a13Dial(t *testing.T, b *Backend) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", b.Addr().String(), 5*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// a13Hello sends a handshake from id expecting agent expect and returns the
// answer's status.
func a13Hello(t *testing.T, c net.Conn, id, expect uuid.UUID) (uint8, error) {
	t.Helper()
	var hs [hsSize]byte
	(&handshake{self: id, expect: expect, timeout: 4 * time.Second}).put(hs[:])
	if _, err := c.Write(hs[:]); err != nil {
		return 0, err
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	if _, err := io.ReadFull(c, hs[:]); err != nil {
		return 0, err
	}
	in, err := getHandshake(hs[:])
	return in.status, err
}

// a13Closed waits until the far end closed c, and fails if it did not
// within d. It closes c.
func a13Closed(t *testing.T, c net.Conn, d time.Duration, what string) {
	t.Helper()
	if backendtest.LeftOpen([]net.Conn{c}, d) > 0 {
		t.Errorf("%s: the backend kept the connection open for %v", what, d)
	}
}

// a13Settled waits until b holds no accepted connection in any of its
// bookkeeping: the Set, the per-address and per-identity caps, the gate.
func a13Settled(t *testing.T, b *Backend) {
	t.Helper()
	require.Eventually(t, func() bool {
		return b.conns.Len() == 0 && b.byIP.Len() == 0 && b.byPeer.Len() == 0 && b.gate.Len() == 0
	}, 10*time.Second, 5*time.Millisecond, "accepted connections still counted: set %d, per address %d, per identity %d, gate %d",
		b.conns.Len(), b.byIP.Len(), b.byPeer.Len(), b.gate.Len())
}

// Every way an accepted connection ends releases what admit and the
// handshake took (its address's cap, its identity's, its place in the
// gate, its membership of the Set), exactly once, and counts the drop in
// exactly one kind: the caps are then whole again, so a stranger who
// churns connections cannot lock honest peers out.
func TestAttack13EveryExitReleasesWhatAdmitTook(t *testing.T) {
	const perIP, perPeer, handshakes = 6, 2, 2
	b := New(WithStreams(1), WithMaxConnsPerIP(perIP), WithMaxConnsPerPeer(perPeer), WithMaxHandshakes(handshakes), WithKeepalive(time.Second, 4*time.Second))
	a := backendtest.NewAgent(t, b)
	self := a.ID()
	before := b.Stats()
	want := Stats{}

	for round := range 3 {
		// Hung up before the handshake: a handshake failure.
		c := a13Dial(t, b)
		_ = c.Close()
		want.HandshakeFailures++

		// A malformed handshake: a handshake failure.
		c = a13Dial(t, b)
		_, _ = c.Write(make([]byte, hsSize))
		a13Closed(t, c, 5*time.Second, "malformed handshake")
		want.HandshakeFailures++

		// Silent handshakes, evicted by later ones: limit rejections,
		// counted by admit only.
		a13Settled(t, b) // the hung-up one left the gate: it is not the one evicted
		silent := []net.Conn{a13Dial(t, b), a13Dial(t, b)}
		require.Eventually(t, func() bool { return b.gate.Len() == handshakes }, 5*time.Second, time.Millisecond)
		more := []net.Conn{a13Dial(t, b), a13Dial(t, b)}
		for _, c := range silent {
			a13Closed(t, c, 5*time.Second, "evicted handshake")
		}
		want.LimitRejected += 2
		for _, c := range more {
			_ = c.Close()
		}
		want.HandshakeFailures += 2
		a13Settled(t, b) // they left the gate: the next is not evicting them

		// Good handshakes, then one more from the same identity and
		// address: over WithMaxConnsPerPeer.
		id := uuid.New()
		good := a13Dial(t, b)
		st, err := a13Hello(t, good, id, self)
		require.NoError(t, err)
		require.Equal(t, uint8(stOK), st, "round %d", round)
		twin := a13Dial(t, b)
		st, err = a13Hello(t, twin, id, self)
		require.NoError(t, err)
		require.Equal(t, uint8(stOK), st)
		over := a13Dial(t, b)
		st, err = a13Hello(t, over, id, self)
		require.NoError(t, err)
		require.Equal(t, uint8(stLimit), st)
		a13Closed(t, over, 5*time.Second, "over WithMaxConnsPerPeer")
		want.LimitRejected++
		_ = twin.Close() // an orderly hang-up: nothing counted

		// The good one sends a malformed frame: a protocol error.
		_, _ = good.Write(frameBytes(header{typ: 200}, nil, nil))
		a13Closed(t, good, 5*time.Second, "malformed frame")
		want.ProtocolErrors++

		// A good handshake expecting another agent: a handshake failure.
		wrong := a13Dial(t, b)
		st, err = a13Hello(t, wrong, uuid.New(), uuid.New())
		require.NoError(t, err)
		require.Equal(t, uint8(stDenied), st)
		a13Closed(t, wrong, 5*time.Second, "wrong agent")
		want.HandshakeFailures++

		// Over the address's cap: perIP held, one more refused at admit.
		a13Settled(t, b)
		held := make([]net.Conn, perIP)
		for i := range held {
			held[i] = a13Dial(t, b)
			st, err := a13Hello(t, held[i], uuid.New(), self)
			require.NoError(t, err)
			require.Equal(t, uint8(stOK), st)
		}
		refused := a13Dial(t, b)
		a13Closed(t, refused, 5*time.Second, "over WithMaxConnsPerIP")
		want.LimitRejected++
		for _, c := range held { // orderly hang-ups count nothing
			_ = c.Close()
		}

		a13Settled(t, b)
	}
	want.Disconnected = want.HandshakeFailures + want.ProtocolErrors + want.LimitRejected + want.Timeouts
	assert.Equal(t, want, serve.Delta(b.Stats(), before))

	// The caps are whole: an address may hold perIP connections again.
	for range perIP {
		st, err := a13Hello(t, a13Dial(t, b), uuid.New(), self)
		require.NoError(t, err)
		require.Equal(t, uint8(stOK), st)
	}
}

// Close racing a flood of connections: every connection the backend
// accepted is closed (none is left open, served by nobody), Close returns
// promptly, nothing is counted against the peers (the drops are this
// agent's), and no goroutine outlives Close.
func TestAttack13CloseRacingAccepts(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	for round := range 5 {
		b := New(WithMaxHandshakes(8))
		a, err := agent.New(agent.WithBackends(b))
		require.NoError(t, err)
		addr := b.Addr().String()
		before := b.Stats()

		stop := backendtest.DialFlood(8, func() (net.Conn, error) {
			c, err := net.DialTimeout("tcp", addr, time.Second)
			if err == nil {
				// A byte, so that a connection the kernel completed for a
				// listener that closed before accepting it is reset.
				_, err = c.Write([]byte{1})
				if err != nil {
					_ = c.Close()
				}
			}
			return c, err
		})
		time.Sleep(time.Duration(round+1) * 10 * time.Millisecond)
		start := time.Now()
		require.NoError(t, a.Close())
		took := time.Since(start)
		conns := stop()
		assert.Less(t, took, 2*time.Second, "Close took long")

		left := backendtest.LeftOpen(conns, 3*time.Second) // every connection that reached the backend is closed
		assert.Zero(t, left, "round %d: connections left open by a closed backend, of %d", round, len(conns))
		assert.Zero(t, b.conns.Len(), "connections still tracked after Close")
		assert.Zero(t, b.byIP.Len())
		assert.Zero(t, b.gate.Len())
		// Evictions of the flood's silent handshakes are the flood's doing;
		// nothing else may be counted: the other drops are this agent's.
		d := serve.Delta(b.Stats(), before)
		assert.Equal(t, Stats{Disconnected: d.LimitRejected, LimitRejected: d.LimitRejected}, d, "round %d: our own Close counted against the peers", round)
	}
}

// The host's lifetime ending before Close (as the agent does just before
// it, and a backend's own host may at any time): a handshake in progress
// and served connections are not counted as the peers' fault, Close
// returns promptly, nothing leaks.
func TestAttack13HostContextEndsBeforeClose(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	b := New(WithKeepalive(time.Second, 4*time.Second))
	cb := &backendtest.EndsEarly{Backend: b}
	a, err := agent.New(agent.WithBackends(cb))
	require.NoError(t, err)
	before := b.Stats()

	shaking := a13Dial(t, b) // in the gate, never says hello
	served := a13Dial(t, b)
	st, err := a13Hello(t, served, uuid.New(), a.ID())
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), st)
	require.Eventually(t, func() bool { return b.gate.Len() == 1 && b.conns.Len() == 2 }, 5*time.Second, time.Millisecond)

	cb.End(errors.New("the host is done"))
	// The listener is closed: no more connections.
	require.Eventually(t, func() bool {
		c, err := net.DialTimeout("tcp", b.Addr().String(), time.Second)
		if err != nil {
			return true
		}
		_ = c.Close()
		return false
	}, 5*time.Second, 5*time.Millisecond, "still listening after the host's lifetime ended")

	// The peers hang up now: that is no fault of theirs worth counting
	// while this side is closing, nor a loss to report.
	_ = shaking.Close()
	_ = served.Close()
	time.Sleep(50 * time.Millisecond)

	start := time.Now()
	require.NoError(t, a.Close())
	assert.Less(t, time.Since(start), 2*time.Second)
	assert.Equal(t, Stats{}, serve.Delta(b.Stats(), before))
	assert.Zero(t, b.conns.Len())
}

// a13SilentPeer is a tcp peer that answers every handshake and then reads
// nothing: its socket buffers fill.
func a13SilentPeer(t *testing.T) agent.Info {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	id := uuid.New()
	backendtest.ServeConns(t, ln, func(c net.Conn) {
		var hs [hsSize]byte
		if _, err := io.ReadFull(c, hs[:]); err != nil {
			return
		}
		(&handshake{status: stOK, self: id, timeout: time.Hour}).put(hs[:])
		_, _ = c.Write(hs[:])
		// then silence: pings included, so that our side's keepalive is
		// what ends the connection, after its timeout
	})
	ci := connInfo{host: hostIdentity(), addr: ln.Addr().String()}
	return agent.Info{ID: id, Conns: []agent.ConnInfo{{Backend: Name, Data: ci.marshal()}}}
}

// Notify returns once its context is done wherever it waits: also while
// the control connection's socket does not take the message (a peer that
// stopped reading). Each Notify here has 200 ms; the keepalive timeout is
// 8 s.
func TestAttack13NotifyWriteEndsWithContext(t *testing.T) {
	_, b := func() (*agent.Agent, *Backend) {
		b := New(WithKeepalive(4*time.Second, 8*time.Second))
		return backendtest.NewAgent(t, b), b
	}()
	peer := a13SilentPeer(t)
	msg := make([]byte, maxNotify)
	const wait = 200 * time.Millisecond
	for i := range 2000 {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		start := time.Now()
		err := b.Notify(ctx, peer, agent.NewKey(), msg)
		took := time.Since(start)
		cancel()
		if took > wait+time.Second {
			t.Fatalf("Notify %d (%d KiB queued before it) took %v with a context of %v: %v", i, i*len(msg)>>10, took.Round(time.Millisecond), wait, err)
		}
		if err != nil {
			require.ErrorIs(t, err, context.DeadlineExceeded, "notify %d", i)
			return // it gave up with its context: as promised
		}
	}
	t.Fatal("a peer that reads nothing took 128 MiB of notifications")
}

// a13Returned reports whether done is closed.
func a13Returned(done <-chan struct{}) bool {
	select {
	case <-done:
		return true
	default:
		return false
	}
}

// A Notify whose context ends while the socket takes its frame. Cut after
// some of its bytes, the frame is half-written: the peer's connections are
// closed, its transfer in flight fails with errNotifyCut, and the next
// Notify dials afresh and goes out whole. Cut before its first byte, the
// connection is as it was: the transfer goes on, and the next Notify goes
// out whole on the same connection.
func TestAttack13NotifyCutShort(t *testing.T) {
	for _, tc := range []struct {
		name string
		room int // what the first control connection takes before its peer reads
		cut  bool
	}{
		{"half a frame", 100, true},
		{"no byte", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bubble(t, func(t *testing.T, nw *memNet) {
				id := uuid.New()
				ctrls := make(chan net.Conn, 4)
				var conns atomic.Int32
				stop := make(chan struct{})
				ln := serveFake(t, nw, func(c net.Conn) {
					var hs [hsSize]byte
					if _, err := io.ReadFull(c, hs[:]); err != nil {
						return
					}
					in, err := getHandshake(hs[:])
					if err != nil {
						return
					}
					n := conns.Add(1)
					(&handshake{status: stOK, self: id, timeout: time.Hour}).put(hs[:])
					if _, err := c.Write(hs[:]); err != nil {
						return
					}
					if in.stream == 0 { // the data stream: takes requests, answers none
						_, _ = io.Copy(io.Discard, c)
						return
					}
					if n == 2 { // the first control connection
						c.(*memConn).setReadBuffer(tc.room)
					}
					ctrls <- c
					<-stop // the test reads it
				})
				t.Cleanup(func() { close(stop) }) // before serveFake's
				peer := peerAt(id, ln.Addr())
				a, b := newAgent(t, nw, WithStreams(1), WithKeepalive(time.Minute, 10*time.Minute))

				x := postFake(t, a, agent.OpRead, peer, make([]byte, 4096)) // in flight: never answered
				ctrl := <-ctrls
				msg := bytes.Repeat([]byte{7}, 1000)
				ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
				err := b.Notify(ctx, peer, agent.NewKey(), msg)
				cancel()
				require.ErrorIs(t, err, context.DeadlineExceeded)
				synctest.Wait()

				if tc.cut {
					require.True(t, a13Returned(x.Done()), "the transfer in flight outlived its connections")
					require.ErrorIs(t, x.Err(), errNotifyCut)
					got, err := io.ReadAll(ctrl) // what it took, then the end: the connection is closed
					require.NoError(t, err)
					assert.Len(t, got, tc.room)
				} else {
					assert.False(t, a13Returned(x.Done()), "the transfer failed: a Notify that sent nothing closed the connection")
					ctrl.(*memConn).setReadBuffer(memBuf)
				}

				key := agent.NewKey()
				require.NoError(t, b.Notify(context.Background(), peer, key, msg))
				if tc.cut {
					ctrl = <-ctrls
					assert.EqualValues(t, 4, conns.Load(), "the peer is dialled afresh")
				} else {
					assert.EqualValues(t, 2, conns.Load(), "the connection is kept")
				}
				var hb [hdrSize]byte
				_, err = io.ReadFull(ctrl, hb[:])
				require.NoError(t, err)
				var h header
				h.get(hb[:])
				require.Equal(t, header{typ: tNotify, length: uint64(len(msg)), key: key}, h, "the next frame on the control connection")
				got := make([]byte, len(msg))
				_, err = io.ReadFull(ctrl, got)
				require.NoError(t, err)
				assert.Equal(t, msg, got)
			})
		})
	}
}

// a13Listener wraps the backend's TCP listener (config.testListen): once
// armed, the next connection it accepts reports its remote address only
// once Close has stopped the backend's Set, and the listener's Close waits,
// for 2 s at most, until nothing is left in the backend's handshake gate
// before it closes the socket. That holds the accept loop's handler between
// its check that the backend is not closing and its use of the gate, while
// Close runs between stopping the Set and closing the connections: a window
// a real scheduler opens too, made wide here.
type a13Listener struct {
	net.Listener
	b     *Backend
	armed chan struct{} // a token: wrap the next connection
}

type a13LateAddrConn struct {
	net.Conn
	ln *a13Listener
}

func (c *a13LateAddrConn) RemoteAddr() net.Addr {
	for deadline := time.Now().Add(5 * time.Second); !c.ln.b.conns.Stopping() && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	return c.Conn.RemoteAddr()
}

func (l *a13Listener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return c, err
	}
	select {
	case <-l.armed:
		return &a13LateAddrConn{Conn: c, ln: l}, nil
	default:
		return c, nil
	}
}

func (l *a13Listener) Close() error {
	deadline := time.Now().Add(2 * time.Second)
	for l.b.gate.Len() > 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	return l.Listener.Close()
}

// A connection accepted just as Close begins must not count against the
// peers what Close does: here its admission, after the Set stopped, still
// enters the handshake gate, evicts the handshake in progress (which Close
// is about to close anyway), and counts that as a LimitRejected drop and an
// agent refusal. Before serve, admit checked closed and used the gate under
// one lock, so a closing backend counted nothing.
func TestAttack13AdmitAfterStopEvictsAndCounts(t *testing.T) {
	b := New(WithMaxHandshakes(1))
	ln := &a13Listener{b: b, armed: make(chan struct{}, 1)}
	b.cfg.testListen = func(addr string) (net.Listener, error) {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, err
		}
		ln.Listener = l
		return ln, nil
	}
	a, err := agent.New(agent.WithBackends(b))
	require.NoError(t, err)
	before := b.Stats()

	silent := a13Dial(t, b) // in the handshake gate, never says hello
	require.Eventually(t, func() bool { return b.gate.Len() == 1 }, 5*time.Second, time.Millisecond)
	ln.armed <- struct{}{}
	late := a13Dial(t, b) // held in admit until Close stopped the Set
	time.Sleep(20 * time.Millisecond)

	require.NoError(t, a.Close())
	a13Closed(t, silent, 5*time.Second, "the handshake in progress")
	a13Closed(t, late, 5*time.Second, "the connection accepted as Close began")
	assert.Equal(t, Stats{}, serve.Delta(b.Stats(), before), "a closing backend counted a drop against its peers")
}
