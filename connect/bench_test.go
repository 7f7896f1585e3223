package connect

import (
	"fmt"
	"testing"
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
				passive, err := NewConnector(quiet)
				if err != nil {
					b.Fatal(err)
				}
				defer passive.Close()
				activeConn, err := NewConnector(quiet, WithBackend(backend))
				if err != nil {
					b.Fatal(err)
				}
				defer activeConn.Close()
				src, dst := buffers(l.sizes, 1), buffers(l.sizes, 0)
				pop, err := passive.CreateReadable(b.Context(), descriptors(src)...)
				if err != nil {
					b.Fatal(err)
				}
				defer pop.Close()
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
