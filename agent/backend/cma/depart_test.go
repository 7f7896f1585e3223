//go:build linux

package cma

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// stuckHost is an exposing agent that never grants a lease: its backend
// accepts lease requests and leaves them unanswered, as a frozen process
// would.
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

// A peer declared departed from outside (a presence registry) fails the
// transfers waiting for its leases at once, not at the timeout.
func TestDepartedPeerFailsAtOnce(t *testing.T) {
	host := &stuckHost{id: uuid.New(), release: make(chan struct{})}
	stuck := New(WithTimeout(time.Minute))
	ci, err := stuck.Start(host)
	require.NoError(t, err)
	t.Cleanup(func() {
		close(host.release)
		assert.NoError(t, stuck.Close())
	})
	peer := agent.Info{ID: host.id, Conns: []agent.ConnInfo{{Backend: Name, Data: ci}}}

	a, _ := newAgent(t, WithTimeout(time.Minute))
	dst := make([]byte, 1<<20)
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: peer, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: 1 << 20}}}})
	require.NoError(t, err)
	time.Sleep(100 * time.Millisecond)
	select {
	case <-x.Done():
		t.Fatalf("the transfer ended before the departure: %v", x.Err())
	default:
	}
	start := time.Now()
	a.PeerDeparted(peer.ID, errors.New("registry: heartbeats stopped"))
	select {
	case <-x.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the departed peer's transfer waited for the lease timeout")
	}
	require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
	assert.Contains(t, x.Err().Error(), "heartbeats stopped")
	t.Logf("transfer to a departed peer ended %v after the departure (timeout 1m): %v", time.Since(start), x.Err())
}
