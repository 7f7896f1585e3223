package connect

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// BenchmarkRead reads 256 MiB as one region and as 4096 KV-cache blocks of
// 64 KiB, which should run near the speed of the single region. It reports
// bytes/s and the cost per descriptor.
func BenchmarkRead(b *testing.B) {
	layouts := []struct {
		name  string
		sizes []int
	}{
		{"1x256MiB", []int{256 << 20}},
		{"4096x64KiB", uniform(4096, 64<<10)},
	}
	for _, backend := range transferBackends {
		for _, l := range layouts {
			b.Run(fmt.Sprintf("%s/%s", backend, l.name), func(b *testing.B) {
				passive, activeConn := pair(b, backend)
				src, dst := buffers(l.sizes, 1), buffers(l.sizes, 0)
				pop := expose(b, passive, KindRead, src)
				md, local := pop.Metadata(), descriptors(dst)
				total := 0
				for _, n := range l.sizes {
					total += n
				}
				b.SetBytes(int64(total))
				b.ResetTimer()
				for b.Loop() {
					rop, err := activeConn.BeginRead(b.Context(), md, local...)
					if err != nil {
						b.Fatal(err)
					}
					if err := rop.Wait(b.Context()); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(l.sizes)), "ns/descriptor")
			})
		}
	}
}

// BenchmarkLatency4KiB measures a 4 KiB READ from BeginRead until the
// passive side's Wait returns, over each backend; p50 and p99 are reported
// in µs. Creating and closing the readable is outside the measured span.
func BenchmarkLatency4KiB(b *testing.B) {
	for _, backend := range transferBackends {
		b.Run(backend, func(b *testing.B) {
			passive, activeConn := pair(b, backend)
			src, dst := buffers([]int{4096}, 1), buffers([]int{4096}, 0)
			lat := make([]time.Duration, 0, 1<<16)
			ctx := b.Context()
			b.ReportAllocs()
			for b.Loop() {
				pop, err := passive.CreateReadable(ctx, descriptors(src)...)
				if err != nil {
					b.Fatal(err)
				}
				t0 := time.Now()
				rop, err := activeConn.BeginRead(ctx, pop.Metadata(), descriptors(dst)...)
				if err != nil {
					b.Fatal(err)
				}
				if err := rop.Wait(ctx); err != nil {
					b.Fatal(err)
				}
				if err := pop.Wait(ctx); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
				_ = pop.Close()
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
		})
	}
}

// BenchmarkCreateReadable measures exposing memory and producing its token.
func BenchmarkCreateReadable(b *testing.B) {
	for _, n := range []int{1, 4096} {
		b.Run(fmt.Sprintf("descriptors=%d", n), func(b *testing.B) {
			c := newConnector(b)
			descs := descriptors(buffers(uniform(n, 64), 1))
			b.ReportAllocs()
			for b.Loop() {
				op, err := c.CreateReadable(b.Context(), descs...)
				if err != nil {
					b.Fatal(err)
				}
				_ = op.Metadata()
				_ = op.Close()
			}
		})
	}
}

// BenchmarkToken measures encoding a token to text and parsing it back, per
// descriptor.
func BenchmarkToken(b *testing.B) {
	for _, n := range []int{1, 4096} {
		b.Run(fmt.Sprintf("descriptors=%d", n), func(b *testing.B) {
			md := expose(b, newConnector(b), KindRead, buffers(uniform(n, 64), 1)).Metadata()
			b.ReportAllocs()
			for b.Loop() {
				if _, err := ParseMetadata(md.Text()); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/descriptor")
			b.ReportMetric(float64(md.EncodedLen()), "token-bytes")
		})
	}
}
