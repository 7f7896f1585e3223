//go:build unix

package connect

import (
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// Raw host memory outside the Go heap (here an anonymous mapping, as a C
// allocator or a pinned-memory pool would hand out) moves like a []byte.
func TestRawHostMemory(t *testing.T) {
	const size = 1 << 20
	for _, backend := range transferBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive, activeConn := pair(t, backend)
			m, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, syscall.Munmap(m)) })
			src := buffers([]int{size}, 8)
			copy(m, src[0])

			raw := NewDeviceDescriptor(uintptr(unsafe.Pointer(&m[0])), size, Host())
			require.Equal(t, &m[0], &raw.Bytes()[0])
			pop, err := passive.CreateReadable(ctx, raw)
			require.NoError(t, err)
			defer func() { require.NoError(t, pop.Close()) }()

			dst := buffers([]int{size}, 0)
			rop, err := activeConn.BeginRead(ctx, pop.Metadata(), NewDescriptor(dst[0]))
			require.NoError(t, err)
			require.NoError(t, rop.Wait(ctx))
			requireSame(t, src, dst)
		})
	}
}
