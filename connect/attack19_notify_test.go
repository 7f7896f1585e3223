package connect

// Attack tests on the completion notification sent after success (commit
// 4ed8f1c, agent.Work.FinishNotify): an active Connector closed right
// after its Wait must not cut off the notification its passive peer waits
// for.

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestAttack19ConnectorCloseRightAfterWait: the active side's Wait
// returns before its notification is written; closing its Connector at
// once must still let the passive side's Wait return nil. Over every
// backend that moves bytes between two Connectors of one process, a READ
// and a WRITE, for several rounds, on a fresh active Connector each.
func TestAttack19ConnectorCloseRightAfterWait(t *testing.T) {
	backends := []string{"mem", "tcp"}
	if runtime.GOOS == "linux" {
		backends = append(backends, "cma")
	}
	for _, backend := range backends {
		for _, kind := range []OperationKind{KindRead, KindWrite} {
			t.Run(backend+"/"+kind.String(), func(t *testing.T) {
				ctx := guarded(t)
				passive := newConnector(t)
				for i := range 10 {
					bufs := buffers([]int{4096, 100 << 10}, i)
					pop := create(t, passive, kind, bufs)
					act := startConnector(t, WithBackend(backend))
					op, err := begin(ctx, act, pop.(interface{ Metadata() Metadata }).Metadata(), buffers([]int{4096, 100 << 10}, i+1))
					require.NoError(t, err)
					require.NoError(t, op.Wait(ctx), "round %d", i)
					require.Equal(t, backend, op.Backend())
					require.NoError(t, act.Close(), "round %d", i)
					require.NoError(t, pop.Wait(ctx), "round %d: the passive side's Wait after the active Connector closed right after its own", i)
					require.NoError(t, pop.Close())
				}
			})
		}
	}
}
