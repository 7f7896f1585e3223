//go:build linux

package cma

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// A peer declared departed from outside (a presence registry) fails the
// transfers waiting for its leases at once, not at the timeout.
func TestDepartedPeerFailsAtOnce(t *testing.T) {
	peer, _ := backendtest.StartStuck(t, New(WithTimeout(time.Minute)))
	a, _ := newAgent(t, WithTimeout(time.Minute))
	dst := make([]byte, 1<<20)
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: peer, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: 1 << 20}}}})
	require.NoError(t, err)
	time.Sleep(100 * time.Millisecond)
	took := backendtest.Depart(t, a, peer.ID, x, "registry: heartbeats stopped", 10*time.Second)
	t.Logf("transfer to a departed peer ended %v after the departure (timeout 1m): %v", took, x.Err())
}
