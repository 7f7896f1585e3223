//go:build ucx

package ucx_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/ucx"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// BenchmarkTransfer moves one descriptor between two agents of this
// process, over the transports UCX_TLS names. cmd/goxfer-bench measures
// across processes, beside ucx_perftest.
func BenchmarkTransfer(b *testing.B) {
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		for _, size := range []int{4 << 10, 1 << 20, 64 << 20} {
			b.Run(fmt.Sprintf("%v/%d", op, size), func(b *testing.B) {
				a, p := backendtest.Pair(b, ucx.New, ucx.WithTimeout(30e9))
				remote, local := make([]byte, size), make([]byte, size)
				rr, err := p.Register(agent.DRAM(remote))
				require.NoError(b, err)
				defer rr.Release()
				lr, err := a.Register(agent.DRAM(local))
				require.NoError(b, err)
				defer lr.Release()
				e, err := p.Expose(op.Access(), []agent.Local{agent.DRAM(remote)})
				require.NoError(b, err)
				defer e.Revoke()
				req := agent.Request{Op: op, Peer: p.Info(), Key: e.Key(),
					Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: agent.DRAM(remote).Region}}}
				b.SetBytes(int64(size))
				backendtest.BenchPost(b, a, req)
			})
		}
	}
}
