//go:build ucx

package ucx

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// stuckHost is an exposing agent that never grants a lease: its backend
// accepts connections and lease requests and leaves the requests
// unanswered, as a frozen process would (Open blocks its progress thread,
// so its heartbeats stop too).
type stuckHost struct {
	id      uuid.UUID
	release chan struct{}
}

func (h *stuckHost) ID() uuid.UUID            { return h.id }
func (h *stuckHost) Logger() *slog.Logger     { return slog.Default() }
func (h *stuckHost) Context() context.Context { return context.Background() }
func (h *stuckHost) Open(agent.Link, agent.Key, agent.Access) (agent.Lease, error) {
	<-h.release
	return agent.Lease{}, agent.ErrRemoteLost
}
func (h *stuckHost) Deliver(agent.Link, agent.Key, []byte) bool { return true }
func (h *stuckHost) LinkLost(agent.Link, error)                 {}
func (h *stuckHost) Refused()                                   {}

// startStuck starts a backend for a stuckHost and returns the agent
// information that reaches it.
func startStuck(t *testing.T, opts ...Option) agent.Info {
	t.Helper()
	info, _ := newStuck(t, opts...)
	return info
}

// newStuck is startStuck that also returns thaw, which lets the host
// answer (refusing every lease) from then on. The backend is closed, thawed
// first, when the test ends.
func newStuck(t *testing.T, opts ...Option) (agent.Info, func()) {
	t.Helper()
	host := &stuckHost{id: uuid.New(), release: make(chan struct{})}
	stuck := New(opts...)
	ci, err := stuck.Start(host)
	require.NoError(t, err)
	var once sync.Once
	thaw := func() { once.Do(func() { close(host.release) }) }
	t.Cleanup(func() {
		thaw()
		assert.NoError(t, stuck.Close())
	})
	return agent.Info{ID: host.id, Conns: []agent.ConnInfo{{Backend: Name, Data: ci}}}, thaw
}

// A peer declared departed from outside (a presence registry) fails the
// transfers waiting for its leases at once, not at the timeout: here a
// READ the exposing side was to write into this agent's memory.
func TestDepartedPeerFailsAtOnce(t *testing.T) {
	peer, thaw := newStuck(t, WithTimeout(time.Minute))
	a, err := agent.New(agent.WithBackends(New(WithTimeout(time.Minute))))
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })

	dst := make([]byte, 1<<20) // over the inline size: a lease, a push by the exposing side
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: peer, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: 1 << 20}}}})
	require.NoError(t, err)
	time.Sleep(200 * time.Millisecond)
	select {
	case <-x.Done():
		t.Fatalf("the transfer ended before the departure: %v", x.Err())
	default:
	}
	start := time.Now()
	a.PeerDeparted(peer.ID, errors.New("registry: heartbeats stopped"))
	select {
	case <-x.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("the departed peer's transfer waited for the lease timeout")
	}
	require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
	assert.Contains(t, x.Err().Error(), "heartbeats stopped")
	t.Logf("transfer to a departed peer ended %v after the departure (timeout 1m): %v", time.Since(start), x.Err())

	// The endpoint is gone: the next transfer connects afresh (and waits
	// again, the peer being stuck), and departs as quickly.
	x, err = a.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: peer, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: 1 << 20}}}})
	require.NoError(t, err)
	time.Sleep(200 * time.Millisecond)
	select {
	case <-x.Done():
		t.Fatalf("the second transfer ended before the departure: %v", x.Err())
	default:
	}
	a.PeerDeparted(peer.ID, errors.New("registry: gone again"))
	select {
	case <-x.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("the second transfer waited for the lease timeout")
	}
	require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
	assert.Contains(t, x.Err().Error(), "gone again")

	// Thaw the peer and wait for its answer to a third transfer: it has then
	// handled the second connection's UCX wireup request, still queued, before
	// this agent's worker goes. UCX 1.21+ over posix crashes the peer on that
	// request once the worker is gone: TestPeerThawsAfterConnectorClosed.
	thaw()
	x, err = a.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: peer, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: 1 << 20}}}})
	require.NoError(t, err)
	<-x.Done()
	require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
}

// A departure of a peer that is in fact alive costs nothing but the
// connection: the next transfer connects afresh and succeeds.
func TestDepartedPeerReconnects(t *testing.T) {
	a, err := agent.New(agent.WithBackends(New()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })
	b, err := agent.New(agent.WithBackends(New()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	src := make([]byte, 1<<20)
	for i := range src {
		src[i] = byte(i * 3)
	}
	exp, err := b.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	defer exp.Revoke()
	for i := range 3 {
		dst := make([]byte, len(src))
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: b.Info(), Key: exp.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}})
		require.NoError(t, err)
		<-x.Done()
		require.NoError(t, x.Err(), "transfer %d", i)
		require.Equal(t, src, dst)
		a.PeerDeparted(b.ID(), errors.New("registry: flapped"))
	}
}
