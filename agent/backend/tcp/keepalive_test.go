package tcp

import (
	"bytes"
	"testing"
	"time"

	"github.com/goxfer/goxfer/agent"
)

// Agents with different keepalive settings never declare each other lost:
// each pings as often as the other's timeout needs.
func TestMismatchedKeepalives(t *testing.T) {
	for _, quickExposes := range []bool{true, false} {
		name := map[bool]string{true: "quick exposes", false: "slow exposes"}[quickExposes]
		t.Run(name, func(t *testing.T) {
			bubble(t, func(t *testing.T, nw *memNet) {
				quick, _ := newAgent(t, nw, WithKeepalive(100*time.Millisecond, 300*time.Millisecond))
				slow, _ := newAgent(t, nw, WithKeepalive(time.Second, 4*time.Second))
				passive, active := slow, quick
				if quickExposes {
					passive, active = quick, slow
				}
				src := bytes.Repeat([]byte{3}, 4096)
				exp := expose(t, passive, agent.AccessRead, src)
				defer exp.Revoke()
				legitRead(t, active, passive, exp, src)
				select { // idle for many of the quick side's timeouts
				case ev := <-exp.Events():
					t.Fatalf("healthy idle peer reported: %+v", ev)
				case <-time.After(10 * time.Second):
				}
				legitRead(t, active, passive, exp, src)
			})
		})
	}
}
