package tcp

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// Agents with different keepalive settings never declare each other lost:
// each pings as often as the other's timeout needs.
func TestMismatchedKeepalives(t *testing.T) {
	quick, _ := newAgent(t, WithKeepalive(100*time.Millisecond, 300*time.Millisecond))
	slow, _ := newAgent(t, WithKeepalive(time.Second, 4*time.Second))
	for _, dir := range []struct {
		name            string
		passive, active *agent.Agent
	}{{"quick exposes", quick, slow}, {"slow exposes", slow, quick}} {
		t.Run(dir.name, func(t *testing.T) {
			src := bytes.Repeat([]byte{3}, 4096)
			exp, err := dir.passive.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
			require.NoError(t, err)
			defer exp.Revoke()
			dst := make([]byte, 4096)
			read := func() {
				x, err := dir.active.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: dir.passive.Info(), Key: exp.Key(),
					Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}})
				require.NoError(t, err)
				<-x.Done()
				require.NoError(t, x.Err())
			}
			read()
			select { // idle for several of the quick side's timeouts
			case ev := <-exp.Events():
				t.Fatalf("healthy idle peer reported: %+v", ev)
			case <-time.After(1200 * time.Millisecond):
			}
			read()
		})
	}
}
