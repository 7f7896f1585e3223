//go:build ucx

package ucx

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// A peer declared departed from outside (a presence registry) fails the
// transfers waiting for its leases at once, not at the timeout: here a
// READ the exposing side was to write into this agent's memory.
func TestDepartedPeerFailsAtOnce(t *testing.T) {
	peer, host := backendtest.StartStuck(t, New(WithTimeout(time.Minute)))
	a := backendtest.NewAgent(t, New(WithTimeout(time.Minute)))
	dst := make([]byte, 1<<20) // over the inline size: a lease, a push by the exposing side
	post := func(op agent.Op) *agent.Xfer {
		x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: peer, Key: agent.NewKey(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: 1 << 20}}}})
		require.NoError(t, err)
		return x
	}

	x := post(agent.OpRead)
	time.Sleep(200 * time.Millisecond)
	took := backendtest.Depart(t, a, peer.ID, x, "registry: heartbeats stopped", 2*time.Second)
	t.Logf("transfer to a departed peer ended %v after the departure (timeout 1m): %v", took, x.Err())

	// The endpoint is gone: the next transfer connects afresh (and waits
	// again, the peer being stuck), and departs as quickly.
	x = post(agent.OpWrite)
	time.Sleep(200 * time.Millisecond)
	backendtest.Depart(t, a, peer.ID, x, "registry: gone again", 2*time.Second)

	// Thaw the peer and wait for its answer to a third transfer: it has then
	// handled the second connection's UCX wireup request, still queued, before
	// this agent's worker goes. UCX 1.21+ over posix crashes the peer on that
	// request once the worker is gone: TestPeerThawsAfterConnectorClosed.
	host.Thaw()
	x = post(agent.OpWrite)
	<-x.Done()
	require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
}

// A departure of a peer that is in fact alive costs nothing but the
// connection: the next transfer connects afresh and succeeds.
func TestDepartedPeerReconnects(t *testing.T) {
	a, b := backendtest.Pair(t, New)
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
