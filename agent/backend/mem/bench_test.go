package mem_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/mem"
)

// BenchmarkPerDescriptor is connect's BenchmarkPerDescriptor through the
// agent alone: 4096 blocks cut from one pool on each side, exposed by one
// agent and moved by another in one Post, beside Go's copy of the same
// blocks and one copy of the whole pool in the same iteration. The active
// span (op-µs) registers the local blocks, posts, waits for Done and
// releases them, as connect does; exposing and revoking are outside it.
// The ratios and the time per descriptor on top of the blockwise copy are
// medians of each iteration's own.
func BenchmarkPerDescriptor(b *testing.B) {
	const n = 4096
	for _, block := range []int{64 << 10, 64} {
		for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
			b.Run(fmt.Sprintf("%s/%dx%s", op, n, sizeName(block)), func(b *testing.B) {
				a, p := benchAgent(b), benchAgent(b)
				src, dst := pool(n, block), pool(n, block)
				remote, local := src, dst
				if op == agent.OpWrite {
					remote, local = dst, src
				}
				rls, lls := locals(remote), locals(local)
				var ratios, whole, over []float64
				var xfer time.Duration
				b.SetBytes(int64(n * block))
				b.ReportAllocs()
				for b.Loop() {
					e, err := p.Expose(op.Access(), rls)
					if err != nil {
						b.Fatal(err)
					}
					t0 := time.Now()
					reg, err := a.Register(lls...)
					if err != nil {
						b.Fatal(err)
					}
					segs := make([]agent.Segment, n)
					for i := range segs {
						segs[i] = agent.Segment{Local: lls[i], Remote: rls[i].Region}
					}
					x, err := a.Post(b.Context(), agent.Request{Op: op, Peer: p.Info(), Key: e.Key(), Segments: segs})
					if err != nil {
						b.Fatal(err)
					}
					<-x.Done()
					if err := x.Err(); err != nil {
						b.Fatal(err)
					}
					if err := reg.Release(); err != nil {
						b.Fatal(err)
					}
					t1 := time.Now()
					e.Revoke()
					t2 := time.Now()
					for i := range src {
						copy(dst[i], src[i])
					}
					t3 := time.Now()
					copy(dst[0][:n*block], src[0][:n*block])
					t4 := time.Now()
					xfer += t1.Sub(t0)
					ratios = append(ratios, float64(t3.Sub(t2))/float64(t1.Sub(t0)))
					whole = append(whole, float64(t4.Sub(t3))/float64(t1.Sub(t0)))
					over = append(over, float64(t1.Sub(t0)-t3.Sub(t2))/n/1e3)
				}
				slices.Sort(ratios)
				slices.Sort(whole)
				slices.Sort(over)
				b.ReportMetric(ratios[len(ratios)/2], "×copy")
				b.ReportMetric(whole[len(whole)/2], "×one-copy")
				b.ReportMetric(over[len(over)/2], "µs/desc-over-copy")
				b.ReportMetric(float64(xfer)/float64(b.N)/1e3, "op-µs")
			})
		}
	}
}

func sizeName(n int) string {
	if n >= 1<<10 {
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

func benchAgent(b *testing.B) *agent.Agent {
	b.Helper()
	a, err := agent.New(agent.WithBackends(mem.New()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = a.Close() })
	return a
}

// pool returns n blocks of size bytes cut from one allocation, touched so
// that no page fault lands in a measurement. Each block's capacity runs to
// the pool's end, as when a KV pool is sliced with buf[i*size:(i+1)*size].
func pool(n, size int) [][]byte {
	all := make([]byte, n*size)
	for i := range all {
		all[i] = byte(i)
	}
	bufs := make([][]byte, n)
	for i := range bufs {
		bufs[i] = all[i*size : (i+1)*size]
	}
	return bufs
}

func locals(bufs [][]byte) []agent.Local {
	ls := make([]agent.Local, len(bufs))
	for i, b := range bufs {
		ls[i] = agent.DRAM(b)
	}
	return ls
}
