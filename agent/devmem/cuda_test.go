package devmem

import (
	"bytes"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// realCUDA returns the process's CUDA driver, skipping the test on a
// machine where it does not load: these tests run on GPU machines, from
// a test binary built with CGO_ENABLED=0.
func realCUDA(t *testing.T) Driver {
	t.Helper()
	d := CUDA()
	n, err := d.Devices()
	if err != nil || n == 0 {
		t.Skipf("no CUDA GPU here: %v (%d devices)", err, n)
	}
	return d
}

// TestCUDAProcessDriverUnavailable checks what the process's driver says
// on a machine without the NVIDIA driver.
func TestCUDAProcessDriverUnavailable(t *testing.T) {
	d := CUDA()
	require.Same(t, d, CUDA(), "one driver per process")
	_, err := d.Devices()
	if err == nil {
		t.Skip("this machine has a CUDA driver")
	}
	require.ErrorIs(t, err, ErrUnavailable)
	if runtime.GOOS == "linux" && (runtime.GOARCH == "amd64" || runtime.GOARCH == "arm64") {
		assert.Contains(t, err.Error(), "libcuda.so.1")
	} else {
		assert.Contains(t, err.Error(), runtime.GOOS+"/"+runtime.GOARCH)
	}
	assert.Contains(t, err.Error(), EnvDevice+"=sim")
	_, err = d.NewStream(0)
	require.ErrorIs(t, err, ErrUnavailable)
	require.ErrorIs(t, d.Check(0x10000, 1, 0), ErrUnavailable)
}

func TestCUDAAllocCheck(t *testing.T) {
	d := realCUDA(t)
	devices, err := d.Devices()
	require.NoError(t, err)
	// A multiple of 2 MiB, so that the allocation's range is the size
	// asked for whatever granularity the driver rounds to.
	const size = 4 << 20
	p, err := d.Alloc(0, size)
	require.NoError(t, err)
	defer func() { require.NoError(t, d.Free(p)) }()
	require.NoError(t, d.Check(p, size, 0))
	require.NoError(t, d.Check(p+4096, 4096, 0))
	require.NoError(t, d.Check(p+size-1, 1, 0))

	pinned, err := d.HostAlloc(4096)
	require.NoError(t, err)
	defer func() { require.NoError(t, d.HostFree(pinned)) }()
	pinned[4095] = 1 // host memory, addressable
	goMem := make([]byte, 64)
	wrong := "GPU 1 does not exist"
	if devices > 1 {
		wrong = "is memory of GPU 0, not of GPU 1"
	}
	for _, c := range []struct {
		ptr  uintptr
		n    uint64
		dev  int
		want string
	}{
		{p + 1, size, 0, fmt.Sprintf("runs past the end of its allocation [0x%x, +%d)", p, size)},
		{p + size - 1, 2, 0, "runs past the end of its allocation"},
		{p, 16, 1, wrong},
		{p, 16, devices, fmt.Sprintf("GPU %d does not exist", devices)},
		{uintptr(unsafePointer(pinned)), 16, 0, "is host memory"},
	} {
		err := d.Check(c.ptr, c.n, c.dev)
		require.ErrorIs(t, err, ErrNotDevice, "0x%x+%d on GPU %d", c.ptr, c.n, c.dev)
		assert.Contains(t, err.Error(), c.want)
	}
	// Go memory is unknown to CUDA, or host memory where the system
	// manages pageable memory for the GPU (HMM).
	err = d.Check(uintptr(unsafePointer(goMem)), 16, 0)
	require.ErrorIs(t, err, ErrNotDevice)
	assert.True(t, strings.Contains(err.Error(), "unregistered or unknown pointer") || strings.Contains(err.Error(), "is host memory"), "%v", err)
	runtime.KeepAlive(goMem)
	_, err = d.Alloc(devices, 16)
	require.ErrorIs(t, err, ErrNotDevice, "a GPU that does not exist")
	require.ErrorIs(t, d.Free(uintptr(unsafePointer(pinned))), ErrNotDevice, "Free of host memory")
	if devices > 1 {
		q, err := d.Alloc(1, 4096)
		require.NoError(t, err)
		require.NoError(t, d.Check(q, 4096, 1))
		err = d.Check(q, 4096, 0)
		require.ErrorIs(t, err, ErrNotDevice)
		assert.Contains(t, err.Error(), "is memory of GPU 1, not of GPU 0")
		require.NoError(t, d.Free(q), "Free of GPU 1's memory")
	}
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

	// Many small copies each way, one Sync each.
	src2 := randomBytes(n)
	for off := 0; off < n; off += 4096 {
		require.NoError(t, st.ToDevice(p+uintptr(off), src2[off:min(off+4096, n)]))
	}
	require.NoError(t, st.Sync())
	clear(pinned)
	for off := 0; off < n; off += 64 << 10 {
		end := min(off+64<<10, n)
		require.NoError(t, st.ToHost(pinned[off:end], p+uintptr(off)))
	}
	require.NoError(t, st.Close())
	require.True(t, bytes.Equal(src2, pinned))
	require.NoError(t, st.Close(), "a second Close")
	require.Error(t, st.ToHost(pinned[:1], p), "a closed stream refuses copies")
}

// TestCUDAConcurrent round-trips bytes from many goroutines at once, each
// on its own stream, on every GPU.
func TestCUDAConcurrent(t *testing.T) {
	d := realCUDA(t)
	devices, err := d.Devices()
	require.NoError(t, err)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			dev := g % devices
			const n = 1 << 20
			p, err := d.Alloc(dev, n)
			if err != nil {
				errs <- err
				return
			}
			defer func() { _ = d.Free(p) }()
			st, err := d.NewStream(dev)
			if err != nil {
				errs <- err
				return
			}
			defer func() { _ = st.Close() }()
			for range 10 {
				src, out := randomBytes(n), make([]byte, n)
				for off := 0; off < n && err == nil; off += 16 << 10 {
					err = st.ToDevice(p+uintptr(off), src[off:off+16<<10])
				}
				for off := 0; off < n && err == nil; off += 16 << 10 {
					err = st.ToHost(out[off:off+16<<10], p+uintptr(off))
				}
				if err == nil {
					err = st.Sync()
				}
				if err == nil && !bytes.Equal(src, out) {
					err = fmt.Errorf("GPU %d: the bytes read back differ from those written", dev)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

// TestCUDABadPointer comes last of the real-GPU tests: a copy from an
// address CUDA never allocated must fail with an error that names the
// call that failed.
func TestCUDABadPointer(t *testing.T) {
	d := realCUDA(t)
	out := make([]byte, 16)
	err := CopyToHost(d, 0, out, 0x10)
	require.Error(t, err)
	msg := err.Error()
	assert.True(t, strings.Contains(msg, "cuMemcpyDtoHAsync_v2") || strings.Contains(msg, "cuStreamSynchronize"),
		"the error names the copy, refused when queued, or the Sync that met it: %v", err)
	assert.Contains(t, msg, "CUresult")
}

func unsafePointer(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }

// TestCUDACopy copies device to device on one GPU and, where there are
// two, between them.
func TestCUDACopy(t *testing.T) {
	d := realCUDA(t)
	n, err := d.Devices()
	require.NoError(t, err)
	const size = 3<<20 + 17
	src := randomBytes(size)
	p, err := d.Alloc(0, size)
	require.NoError(t, err)
	defer func() { require.NoError(t, d.Free(p)) }()
	require.NoError(t, CopyToDevice(d, 0, p, src))
	for dev := range min(n, 2) {
		q, err := d.Alloc(dev, size)
		require.NoError(t, err)
		require.NoError(t, CopyDevice(d, 0, q, p, size), "GPU 0 to GPU %d", dev)
		out := make([]byte, size)
		require.NoError(t, CopyToHost(d, dev, out, q))
		require.True(t, bytes.Equal(src, out), "GPU 0 to GPU %d", dev)
		require.NoError(t, d.Free(q))
	}
}
