package serve

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// passive is a listening side put together as the package doc says, with
// a toy protocol: a 32-byte hello (the dialler's identity, the agent it
// expects), a one-byte answer (0: ok), then one-byte frames: 'p' is echoed,
// 'x' is malformed, 'L' is over a limit.
type passive struct {
	self    uuid.UUID
	timeout time.Duration
	set     Set[net.Conn]
	perKey  *Caps[string]
	gate    *Gate
	stats   Counters
	refused atomic.Int64 // agent.Host.Refused
	cancel  context.CancelFunc
}

func startPassive(ln net.Listener, handshakes, perKey int, timeout time.Duration) *passive {
	p := &passive{self: uuid.New(), timeout: timeout, perKey: NewCaps[string](perKey), gate: NewGate(handshakes)}
	p.stats.Classes = classes
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	p.set.Go(func() { Accept(ctx, ln, slog.New(&logRecorder{}), p.handle) })
	return p
}

func (p *passive) handle(c net.Conn) bool {
	k := c.RemoteAddr().String()
	if !p.perKey.Acquire(k) {
		_ = c.Close()
		if p.set.Stopping() {
			return false
		}
		p.stats.Drop(LimitRejected)
		p.refused.Add(1)
		return true
	}
	evicted, ok := p.set.Admit(p.gate, c, c, func(c net.Conn, pass *Pass) { p.serve(c, k, pass) })
	if !ok {
		p.perKey.Release(k)
		_ = c.Close()
		return false
	}
	if evicted {
		p.stats.Drop(LimitRejected)
		p.refused.Add(1)
	}
	return true
}

func (p *passive) serve(c net.Conn, k string, pass *Pass) {
	defer p.perKey.Release(k)
	defer pass.Done()
	defer c.Close()
	if err := p.handshake(c, pass); err != nil {
		if !p.set.Stopping() && !errors.Is(err, ErrEvicted) {
			if _, ok := p.stats.Dropped(err, true); ok {
				p.refused.Add(1)
			}
		}
		return
	}
	err := p.loop(c)
	if p.set.Stopping() {
		return
	}
	if _, ok := p.stats.Dropped(err, false); ok && errors.Is(err, errProtocol) {
		p.refused.Add(1)
	}
}

func (p *passive) handshake(c net.Conn, pass *Pass) error {
	var hs [32]byte
	_ = c.SetDeadline(time.Now().Add(p.timeout))
	_, err := io.ReadFull(c, hs[:])
	if !pass.Done() {
		return ErrEvicted
	}
	if err != nil {
		return err
	}
	err = CheckHandshake(p.self, uuid.UUID(hs[:16]), uuid.UUID(hs[16:]))
	status := byte(0)
	if err != nil {
		status, err = 1, fmt.Errorf("%w: %w", errProtocol, err)
	}
	if _, werr := c.Write([]byte{status}); err == nil {
		err = werr
	}
	_ = c.SetDeadline(time.Time{})
	return err
}

func (p *passive) loop(c net.Conn) error {
	var b [1]byte
	for {
		if _, err := io.ReadFull(c, b[:]); err != nil {
			return err
		}
		switch b[0] {
		case 'p':
			if _, err := c.Write(b[:]); err != nil {
				return err
			}
		case 'L':
			return fmt.Errorf("%w: frame too large", errLimit)
		default:
			return fmt.Errorf("%w: frame %q", errProtocol, b[0])
		}
	}
}

// close is the backend's Close, the agent having cancelled its context.
func (p *passive) close() {
	p.cancel()
	members, first := p.set.Stop()
	if !first {
		return
	}
	for _, c := range members {
		_ = c.Close()
	}
	p.set.Wait()
}

// client is the dialling side of one connection.
type client struct {
	t *testing.T
	c net.Conn
}

func dialPassive(t *testing.T, ln *fakeListener, from string) *client {
	return &client{t: t, c: ln.dial(from)}
}

// hello sends a handshake and returns the answer's status, or an error if
// the connection was closed first.
func (c *client) hello(from, expect uuid.UUID) (byte, error) {
	var hs [32]byte
	copy(hs[:16], from[:])
	copy(hs[16:], expect[:])
	if _, err := c.c.Write(hs[:]); err != nil {
		return 0, err
	}
	var st [1]byte
	_, err := io.ReadFull(c.c, st[:])
	return st[0], err
}

func (c *client) ping() error {
	if _, err := c.c.Write([]byte{'p'}); err != nil {
		return err
	}
	var b [1]byte
	_, err := io.ReadFull(c.c, b[:])
	return err
}

// open reports whether the server still holds the connection: a read that
// cannot wait times out rather than finding it closed.
func (c *client) open() bool {
	c.t.Helper()
	synctest.Wait() // the server is done with what it was doing
	_ = c.c.SetReadDeadline(time.Now())
	defer func() { _ = c.c.SetReadDeadline(time.Time{}) }()
	_, err := c.c.Read(make([]byte, 1))
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return true
	}
	require.ErrorIs(c.t, err, io.EOF, "a closed connection reads EOF")
	return false
}

// The parts put together hold a listening side to its limits, count each
// drop once in the right kind, let honest peers through a handshake flood,
// and close cleanly: what tcp's and cma's limits tests pin, run here on
// fake time.
func TestPassiveSide(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const timeout = time.Second
		ln := newFakeListener(0)
		p := startPassive(ln, 4, 3, timeout)
		var before agent.BackendStats
		moved := func(want agent.BackendStats) {
			t.Helper()
			synctest.Wait()
			got := p.stats.Stats()
			assert.Equal(t, want, Delta(got, before))
			before = got
		}
		honest := func(from string) *client {
			t.Helper()
			c := dialPassive(t, ln, from)
			st, err := c.hello(uuid.New(), p.self)
			require.NoError(t, err)
			require.Zero(t, st)
			require.NoError(t, c.ping())
			return c
		}

		h1 := honest("h1")
		moved(agent.BackendStats{})

		// A flood of connections that never handshake: the oldest are
		// closed to make room, counted as limits and refusals.
		var flood []*client
		for i := range 10 {
			flood = append(flood, dialPassive(t, ln, fmt.Sprintf("f%d", i)))
		}
		moved(agent.BackendStats{Disconnected: 6, LimitRejected: 6})
		assert.EqualValues(t, 6, p.refused.Load())
		assert.Equal(t, 4, p.gate.Len())
		for i, c := range flood {
			assert.Equal(t, i >= 6, c.open(), "flood connection %d", i)
		}

		// An honest peer gets through while the flood holds the gate: it
		// evicts the oldest, and its handshake is done before the next.
		h2 := honest("h2")
		moved(agent.BackendStats{Disconnected: 1, LimitRejected: 1})
		assert.False(t, flood[6].open())
		assert.Equal(t, 3, p.gate.Len())

		// The rest of the flood times out in the handshake.
		time.Sleep(timeout)
		moved(agent.BackendStats{Disconnected: 3, Timeouts: 3})
		assert.Zero(t, p.gate.Len())
		for _, c := range flood[7:] {
			assert.False(t, c.open())
		}
		assert.EqualValues(t, 10, p.refused.Load())

		// One key is held to its cap at accept; a connection that ends
		// makes room.
		k := []*client{honest("k"), honest("k"), honest("k")}
		over := dialPassive(t, ln, "k")
		moved(agent.BackendStats{Disconnected: 1, LimitRejected: 1})
		assert.False(t, over.open(), "closed at accept")
		assert.Equal(t, 3, p.perKey.Count("k"))
		require.NoError(t, k[0].c.Close())
		synctest.Wait()
		assert.Equal(t, 2, p.perKey.Count("k"))
		k[0] = honest("k")
		moved(agent.BackendStats{}) // a peer's hang-up is its own business

		// Handshakes that fail the identity check are answered, dropped
		// and counted.
		for _, ids := range [][2]uuid.UUID{{uuid.New(), uuid.New()}, {uuid.Nil, p.self}} {
			c := dialPassive(t, ln, "bad")
			st, err := c.hello(ids[0], ids[1])
			require.NoError(t, err)
			assert.Equal(t, byte(1), st)
			assert.False(t, c.open())
		}
		moved(agent.BackendStats{Disconnected: 2, HandshakeFailures: 2})

		// Bad frames after the handshake.
		for _, f := range []byte{'x', 'L'} {
			c := honest("frames")
			_, err := c.c.Write([]byte{f})
			require.NoError(t, err)
			assert.False(t, c.open())
		}
		moved(agent.BackendStats{Disconnected: 2, ProtocolErrors: 1, LimitRejected: 1})
		assert.EqualValues(t, 15, p.refused.Load(), "limits and protocol errors are refusals too")

		// Close ends every connection and goroutine, counting nothing.
		idle := dialPassive(t, ln, "idle") // mid-handshake
		synctest.Wait()
		p.close()
		moved(agent.BackendStats{})
		for _, c := range append(k, h1, h2, idle) {
			assert.False(t, c.open())
		}
		assert.Zero(t, p.set.Len())
		assert.Zero(t, p.gate.Len())
		assert.Zero(t, p.perKey.Len())
		assert.True(t, ln.isClosed())
		p.close() // again: nothing to do
	})
}
