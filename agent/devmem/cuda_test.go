package devmem

import (
	"bytes"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// realCUDA returns the process's CUDA driver, skipping the test on a
// machine where it does not load: these tests run on GPU machines, from
// a test binary built here with CGO_ENABLED=0.
func realCUDA(t *testing.T) Driver {
	t.Helper()
	d := CUDA()
	n, err := d.Devices()
	if err != nil || n == 0 {
		t.Skipf("no CUDA GPU here: %v (%d devices)", err, n)
	}
	return d
}

func TestCUDAAllocCheck(t *testing.T) {
	d := realCUDA(t)
	p, err := d.Alloc(0, 1<<20)
	require.NoError(t, err)
	defer func() { require.NoError(t, d.Free(p)) }()
	require.NoError(t, d.Check(p, 1<<20, 0))
	require.NoError(t, d.Check(p+4096, 4096, 0))
	err = d.Check(p+1, 1<<20, 0)
	require.ErrorIs(t, err, ErrNotDevice)
	assert.Contains(t, err.Error(), "past the end")
	if n, _ := d.Devices(); n > 1 {
		err = d.Check(p, 16, 1)
		require.ErrorIs(t, err, ErrNotDevice)
		assert.Contains(t, err.Error(), "GPU 0, not of GPU 1")
	}
	host := make([]byte, 64)
	err = d.Check(uintptr(unsafePointer(host)), 64, 0)
	require.ErrorIs(t, err, ErrNotDevice, "Go memory is not device memory")
	pinned, err := d.HostAlloc(4096)
	require.NoError(t, err)
	defer func() { require.NoError(t, d.HostFree(pinned)) }()
	require.ErrorIs(t, d.Check(uintptr(unsafePointer(pinned)), 4096, 0), ErrNotDevice, "pinned host memory is not device memory")
	_, err = d.Alloc(1<<20, 16)
	require.ErrorIs(t, err, ErrNotDevice, "a GPU that does not exist")
}

func TestCUDARoundTrip(t *testing.T) {
	d := realCUDA(t)
	const n = 8<<20 + 3
	p, err := d.Alloc(0, n)
	require.NoError(t, err)
	defer func() { require.NoError(t, d.Free(p)) }()
	src := randomBytes(n)
	pinned, err := d.HostAlloc(n)
	require.NoError(t, err)
	defer func() { require.NoError(t, d.HostFree(pinned)) }()
	copy(pinned, src)
	st, err := d.NewStream(0)
	require.NoError(t, err)
	require.NoError(t, st.ToDevice(p, pinned))
	require.NoError(t, st.Sync())
	out := make([]byte, n) // pageable Go memory works too
	require.NoError(t, st.ToHost(out, p))
	require.NoError(t, st.Sync())
	require.True(t, bytes.Equal(src, out))
	// Many small copies, one Sync.
	clear(pinned)
	for off := 0; off < n; off += 64 << 10 {
		end := min(off+64<<10, n)
		require.NoError(t, st.ToHost(pinned[off:end], p+uintptr(off)))
	}
	require.NoError(t, st.Close())
	require.True(t, bytes.Equal(src, pinned[:n]))
	err = CopyToHost(d, 0, out[:16], 0x10)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cuMemcpyDtoHAsync_v2", "a bad pointer names the failed call")
}

func unsafePointer(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }
