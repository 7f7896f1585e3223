package connect

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A READ with the token of a closed operation is refused; the passive
// Connector counts it, and over tcp the backend says which kind it was.
func TestStatsCountRefusals(t *testing.T) {
	for _, backend := range transferBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive, active := pair(t, backend)
			before := passive.Stats()
			assert.Contains(t, before.Backends, "tcp", "tcp keeps counters")
			assert.Zero(t, before.Backends["tcp"].Denied)

			pop := expose(t, passive, KindRead, buffers([]int{4096}, 1))
			md := pop.Metadata()
			open := passive.Stats()
			assert.Equal(t, 1, open.Registered)
			assert.Equal(t, 1, open.Exposed)
			require.NoError(t, pop.Close())
			err := beginWait(ctx, active, md, buffers([]int{4096}, 2))
			require.ErrorIs(t, err, ErrAccessDenied)

			after := passive.Stats()
			assert.Equal(t, before.Refused+1, after.Refused)
			assert.Zero(t, after.Registered+after.Exposed+after.InFlight, "nothing is left open")
			assert.Zero(t, active.Stats().Registered+active.Stats().InFlight, "nothing is left open")
			if backend == "tcp" {
				assert.Equal(t, uint64(1), after.Backends["tcp"].Denied)
				assert.Zero(t, after.Backends["tcp"].Disconnected, "a refused request keeps its connection")
			}
			require.NoError(t, passive.Close())
			assert.Equal(t, after.Refused, passive.Stats().Refused, "Stats works after Close")
		})
	}
}
