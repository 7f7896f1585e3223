package connect

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// BenchmarkPerDescriptor moves a KV hand-off, 4096 blocks of 64 KiB cut
// from one 256 MiB pool on each side (as goxfer-bench's -preset kv does),
// in one READ or WRITE over mem, and in the same iteration copies the same
// 4096 blocks with Go's copy, then the whole pool with one copy: ×copy and
// ×one-copy are the operation's speed over theirs, µs/desc-over-copy what
// it adds per descriptor to the first. The blocks follow each other on
// both sides, so mem copies neighbours as one. With blocks of 64 bytes
// little but the per-descriptor work remains. The ratios and the time per
// descriptor are medians of each iteration's own (the machine is shared);
// the times in µs are means. Each iteration creates its passive operation
// (create-µs) and waits for both sides; the active span (op-µs) is Begin
// to the active Wait.
func BenchmarkPerDescriptor(b *testing.B) {
	const n = 4096
	for _, block := range []int{64 << 10, 64} {
		for _, kind := range []OperationKind{KindRead, KindWrite} {
			b.Run(fmt.Sprintf("%s/%dx%s", kind, n, sizeName(block)), func(b *testing.B) {
				passive, activeConn := pair(b, "mem")
				src, dst := pool(n, block, 1), pool(n, block, 0)
				remote, local := src, dst // READ: the passive side's blocks are copied into the active side's
				if kind == KindWrite {
					remote, local = dst, src
				}
				ctx := b.Context()
				var made, xfer, cp time.Duration
				var ratios, whole, over []float64 // per iteration: the machine is shared, medians resist its noise
				b.SetBytes(int64(n * block))
				b.ReportAllocs()
				for b.Loop() {
					t0 := time.Now()
					pop := create(b, passive, kind, remote)
					md := pop.Metadata()
					t1 := time.Now()
					op, err := begin(ctx, activeConn, md, local)
					if err == nil {
						err = op.Wait(ctx)
					}
					t2 := time.Now()
					if err != nil {
						b.Fatal(err)
					}
					if err := pop.Wait(ctx); err != nil {
						b.Fatal(err)
					}
					_ = pop.Close()
					t3 := time.Now()
					for i := range src {
						copy(dst[i], src[i])
					}
					t4 := time.Now()
					copy(dst[0][:n*block], src[0][:n*block])
					t5 := time.Now()
					made += t1.Sub(t0)
					xfer += t2.Sub(t1)
					cp += t4.Sub(t3)
					ratios = append(ratios, float64(t4.Sub(t3))/float64(t2.Sub(t1)))
					whole = append(whole, float64(t5.Sub(t4))/float64(t2.Sub(t1)))
					over = append(over, float64(t2.Sub(t1)-t4.Sub(t3))/n/1e3)
				}
				iters := float64(b.N)
				b.ReportMetric(median(ratios), "×copy")
				b.ReportMetric(median(whole), "×one-copy")
				b.ReportMetric(median(over), "µs/desc-over-copy")
				b.ReportMetric(float64(made)/iters/1e3, "create-µs")
				b.ReportMetric(float64(xfer)/iters/1e3, "op-µs")
				b.ReportMetric(float64(cp)/iters/1e3, "copy-µs")
			})
		}
	}
}

// median returns the median of xs, which it sorts.
func median(xs []float64) float64 {
	slices.Sort(xs)
	return xs[len(xs)/2]
}

func sizeName(n int) string {
	if n >= 1<<10 {
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// pool returns n blocks of size bytes cut from one allocation, filled from
// seed as buffers does. Each block's capacity runs to the pool's end, as
// when a KV pool is sliced with buf[i*size:(i+1)*size].
func pool(n, size, seed int) [][]byte {
	all := buffers([]int{n * size}, seed)[0]
	bufs := make([][]byte, n)
	for i := range bufs {
		bufs[i] = all[i*size : (i+1)*size]
	}
	return bufs
}
