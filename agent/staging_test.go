package agent_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/devmem"
)

// devBuf is a buffer in simulated device memory, or in host memory.
type devBuf struct {
	local agent.Local
	sim   *devmem.Sim
}

func newDevBuf(t *testing.T, sim *devmem.Sim, vram bool, n int, fill []byte) devBuf {
	t.Helper()
	if !vram {
		b := make([]byte, n)
		copy(b, fill)
		return devBuf{local: agent.DRAM(b)}
	}
	p, err := sim.Alloc(1, n)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sim.Free(p) })
	if fill == nil {
		fill = make([]byte, n)
	}
	require.NoError(t, devmem.CopyToDevice(sim, 1, p, fill[:n]))
	return devBuf{local: agent.Device(p, n, agent.KindVRAM, 1), sim: sim}
}

func (d devBuf) bytes(t *testing.T) []byte {
	t.Helper()
	if d.local.Kind == agent.KindDRAM {
		return d.local.Mem
	}
	out := make([]byte, d.local.Len)
	require.NoError(t, devmem.CopyToHost(d.sim, 1, out, uintptr(d.local.Addr)))
	return out
}

func TestStagingMem(t *testing.T) {
	sim := devmem.NewSim(2)
	newAgent := func() *agent.Agent {
		a, err := agent.New(agent.WithBackends(mem.New()), agent.WithDevice(sim), agent.WithStaging(64<<10, 16<<20))
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, a.Close()) })
		return a
	}
	act, pas := newAgent(), newAgent()
	const n = 1<<20 + 12345
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		for _, kinds := range [][2]bool{{true, false}, {false, true}, {true, true}} {
			t.Run(op.String()+map[bool]string{true: "-vram", false: "-dram"}[kinds[0]]+map[bool]string{true: "-vram", false: "-dram"}[kinds[1]], func(t *testing.T) {
				src := make([]byte, n)
				for i := range src {
					src[i] = byte(rand.Uint32())
				}
				var lfill, rfill []byte
				if op == agent.OpWrite {
					lfill = src
				} else {
					rfill = src
				}
				loc := newDevBuf(t, sim, kinds[0], n, lfill)
				rem := newDevBuf(t, sim, kinds[1], n, rfill)
				exp, err := pas.Expose(op.Access(), []agent.Local{rem.local})
				require.NoError(t, err)
				defer exp.Revoke()
				// Many segments, some crossing chunk boundaries.
				var segs []agent.Segment
				for off := 0; off < n; {
					l := min(n-off, 1+rand.IntN(100<<10))
					lr, rr := loc.local, rem.local.Region
					lr.Addr += uint64(off)
					lr.Len = uint64(l)
					if lr.Mem != nil {
						lr.Mem = lr.Mem[off : off+l]
					}
					rr.Addr += uint64(off)
					rr.Len = uint64(l)
					segs = append(segs, agent.Segment{Local: lr, Remote: rr})
					off += l
				}
				x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(), Segments: segs, Notify: []byte("done")})
				require.NoError(t, err)
				<-x.Done()
				require.NoError(t, x.Err())
				require.Equal(t, "mem+staging", x.Path())
				ev := <-exp.Events()
				require.Equal(t, agent.EventNotify, ev.Kind)
				dst := rem
				if op == agent.OpRead {
					dst = loc
				}
				require.Equal(t, src, dst.bytes(t))
			})
		}
	}
}
