//go:build linux && (amd64 || arm64)

package devmem

import (
	"bytes"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// newMissingCUDA returns a CUDA driver that looks for a library that is
// not there, whatever this machine has.
func newMissingCUDA(t *testing.T) Driver {
	old := libcuda
	libcuda = "libcuda-does-not-exist.so.1"
	t.Cleanup(func() { libcuda = old })
	d := &cudaDriver{}
	_, _ = d.load()
	return d
}

// TestCUDAUnavailable checks the error a machine without the driver gets,
// from every method: a library that cannot be loaded is named.
func TestCUDAUnavailable(t *testing.T) {
	d := newMissingCUDA(t)
	_, err := d.Devices()
	require.ErrorIs(t, err, ErrUnavailable)
	assert.Contains(t, err.Error(), "libcuda-does-not-exist.so.1")
	assert.Contains(t, err.Error(), "install the NVIDIA driver")
	assert.Contains(t, err.Error(), EnvDevice+"=sim")
	require.ErrorIs(t, d.Check(0x1000, 1, 0), ErrUnavailable)
	_, err = d.Alloc(0, 1)
	require.ErrorIs(t, err, ErrUnavailable)
	require.ErrorIs(t, d.Free(0x1000), ErrUnavailable)
	_, err = d.HostAlloc(1)
	require.ErrorIs(t, err, ErrUnavailable)
	require.ErrorIs(t, d.HostFree([]byte{1}), ErrUnavailable)
	_, err = d.NewStream(0)
	require.ErrorIs(t, err, ErrUnavailable)
	s := d.(Sharer)
	_, err = s.Export(0x1000, 0)
	require.ErrorIs(t, err, ErrUnavailable)
	_, err = s.Import(Share{Kind: ShareHandle, Size: 1}, -1)
	require.ErrorIs(t, err, ErrUnavailable)
	_, err = s.AllocShareable(0, 1)
	require.ErrorIs(t, err, ErrUnavailable)
	assert.Equal(t, "cuda", d.Name())
}

// fake is the test hooks of testdata/fakecuda.c, a stand-in libcuda.
type fake struct {
	wrongContext   func() int64
	retains        func(dev int32) int64
	liveAllocs     func() int64
	liveStreams    func() int64
	foreignContext func() uintptr

	// Sharing.
	fail             func(fn string, code int32)
	lastHandle       func(out *byte)
	liveIPC          func() int64
	liveVMM          func() int64
	liveReservations func() int64
}

// fakeCUDASource is embedded so that a test binary built here runs from
// any directory.
//
//go:embed testdata/fakecuda.c
var fakeCUDASource []byte

// fakeCUDA builds testdata/fakecuda.c with the C compiler into a library
// of the test's own, so each test has a fresh fake, and returns a CUDA
// driver bound to it through the same code as the real one. It skips the
// test where there is no C compiler; the test binary itself needs no cgo.
func fakeCUDA(t *testing.T, cflags ...string) (*cudaDriver, *fake) {
	t.Helper()
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skipf("no C compiler to build the fake libcuda: %v", err)
	}
	dir := t.TempDir()
	so, c := filepath.Join(dir, "libfakecuda.so"), filepath.Join(dir, "fakecuda.c")
	require.NoError(t, os.WriteFile(c, fakeCUDASource, 0o600))
	args := append(cflags, "-shared", "-fPIC", "-O1", "-o", so, c, "-lpthread")
	out, err := exec.Command(cc, args...).CombinedOutput()
	require.NoError(t, err, "building the fake libcuda: %s", out)

	old := libcuda
	libcuda = so
	d := &cudaDriver{}
	_, _ = d.load()
	libcuda = old

	lib, err := purego.Dlopen(so, purego.RTLD_NOW|purego.RTLD_LOCAL)
	require.NoError(t, err)
	f := &fake{}
	purego.RegisterLibFunc(&f.wrongContext, lib, "fake_wrong_context")
	purego.RegisterLibFunc(&f.retains, lib, "fake_retains")
	purego.RegisterLibFunc(&f.liveAllocs, lib, "fake_live_allocs")
	purego.RegisterLibFunc(&f.liveStreams, lib, "fake_live_streams")
	purego.RegisterLibFunc(&f.foreignContext, lib, "fake_foreign_context")
	purego.RegisterLibFunc(&f.fail, lib, "fake_fail")
	purego.RegisterLibFunc(&f.lastHandle, lib, "fake_last_handle")
	purego.RegisterLibFunc(&f.liveIPC, lib, "fake_live_ipc")
	purego.RegisterLibFunc(&f.liveVMM, lib, "fake_live_vmm")
	purego.RegisterLibFunc(&f.liveReservations, lib, "fake_live_reservations")
	return d, f
}

// TestCUDAFakeLoadFails checks the errors of a driver that loads but
// cannot be used: each says what failed, wraps ErrUnavailable, and every
// method returns it.
func TestCUDAFakeLoadFails(t *testing.T) {
	for _, c := range []struct {
		cflag string
		want  []string
	}{
		{"-DINIT_RESULT=100", []string{"cuInit: CUDA_ERROR_NO_DEVICE (CUresult 100)", "nvidia-smi"}},
		{"-DINIT_RESULT=999", []string{"cuInit: unknown error (CUresult 999)"}},
		{"-DVERSION=10010", []string{"CUDA driver version 10.1; goxfer needs 10.2 or later"}},
		{"-DOMIT_MEMALLOC", []string{"has no cuMemAlloc_v2"}},
	} {
		t.Run(c.cflag, func(t *testing.T) {
			d, _ := fakeCUDA(t, c.cflag)
			_, err := d.Devices()
			require.ErrorIs(t, err, ErrUnavailable)
			for _, w := range c.want {
				assert.Contains(t, err.Error(), w)
			}
			assert.Contains(t, err.Error(), EnvDevice+"=sim")
			_, err = d.Alloc(0, 1)
			require.ErrorIs(t, err, ErrUnavailable)
			require.ErrorIs(t, d.Check(0x10000, 1, 0), ErrUnavailable)
		})
	}
}

// TestCUDAFakeCheck checks Check's verdicts and Alloc, Free, HostAlloc
// and HostFree through the binding, against the fake driver.
func TestCUDAFakeCheck(t *testing.T) {
	d, f := fakeCUDA(t)
	n, err := d.Devices()
	require.NoError(t, err)
	require.Equal(t, 2, n)
	p, err := d.Alloc(1, 10000)
	require.NoError(t, err)
	pinned, err := d.HostAlloc(4096)
	require.NoError(t, err)
	require.Len(t, pinned, 4096)
	pinned[4095] = 1 // host memory, addressable
	goMem := make([]byte, 64)

	require.NoError(t, d.Check(p, 10000, 1))
	require.NoError(t, d.Check(p+100, 9900, 1))
	require.NoError(t, d.Check(p+9999, 1, 1))
	for _, c := range []struct {
		ptr  uintptr
		n    uint64
		dev  int
		want string
	}{
		{p, 10000, 0, fmt.Sprintf("0x%x is memory of GPU 1, not of GPU 0", p)},
		{p + 1, 10000, 1, fmt.Sprintf("runs past the end of its allocation [0x%x, +10000)", p)},
		{p + 9999, 2, 1, "runs past the end of its allocation"},
		{p, 16, 2, "GPU 2 does not exist (the driver sees 2)"},
		{p, 16, -1, "GPU -1 does not exist"},
		{uintptr(unsafe.Pointer(&pinned[0])), 16, 1, "is host memory"},
		{uintptr(unsafe.Pointer(&goMem[0])), 16, 1, "unregistered or unknown pointer"},
		{0x1000, 16, 1, "unregistered or unknown pointer (devmem: cuPointerGetAttributes: CUDA_ERROR_INVALID_VALUE (CUresult 1))"},
	} {
		err := d.Check(c.ptr, c.n, c.dev)
		require.ErrorIs(t, err, ErrNotDevice, "0x%x+%d on GPU %d", c.ptr, c.n, c.dev)
		assert.Contains(t, err.Error(), c.want)
	}
	runtime.KeepAlive(goMem)

	_, err = d.Alloc(0, 0)
	require.Error(t, err)
	_, err = d.HostAlloc(0)
	require.Error(t, err)
	require.ErrorIs(t, d.Free(uintptr(unsafe.Pointer(&pinned[0]))), ErrNotDevice, "Free of host memory")
	require.NoError(t, d.Free(p))
	require.ErrorIs(t, d.Free(p), ErrNotDevice, "a second Free")
	require.ErrorIs(t, d.Check(p, 1, 1), ErrNotDevice, "freed memory")
	require.NoError(t, d.HostFree(pinned))
	err = d.HostFree(goMem)
	require.Error(t, err, "HostFree of Go memory")
	assert.Contains(t, err.Error(), "cuMemFreeHost: CUDA_ERROR_INVALID_VALUE (CUresult 1)")
	assert.Zero(t, f.liveAllocs())
	assert.Zero(t, f.wrongContext(), "calls made without the right context current")
	assert.Equal(t, int64(1), f.retains(1), "GPU 1's primary context retained once")
}

// TestCUDAFakeStreams round-trips random bytes through the binding's
// streams against the fake driver, whose copies run only at Sync.
func TestCUDAFakeStreams(t *testing.T) {
	d, f := fakeCUDA(t)
	const n = 1<<20 + 7
	p, err := d.Alloc(1, n)
	require.NoError(t, err)
	src := randomBytes(n)
	st, err := d.NewStream(1)
	require.NoError(t, err)
	require.NoError(t, st.ToDevice(p, src))
	require.NoError(t, st.Sync())
	pinned, err := d.HostAlloc(n)
	require.NoError(t, err)
	require.NoError(t, st.ToHost(pinned, p))
	require.False(t, bytes.Equal(src, pinned), "the fake copies only at Sync")
	require.NoError(t, st.Sync())
	require.True(t, bytes.Equal(src, pinned))

	// Many small copies each way, one Sync each.
	src2 := randomBytes(n)
	for off := 0; off < n; off += 1000 {
		require.NoError(t, st.ToDevice(p+uintptr(off), src2[off:min(off+1000, n)]))
	}
	require.NoError(t, st.Sync())
	out := make([]byte, n)
	for off := 0; off < n; off += 777 {
		require.NoError(t, st.ToHost(out[off:min(off+777, n)], p+uintptr(off)))
	}
	require.NoError(t, st.Sync())
	require.True(t, bytes.Equal(src2, out))

	err = st.ToDevice(p+n-1, []byte{1, 2})
	require.Error(t, err, "a copy past the end of the allocation")
	assert.Contains(t, err.Error(), "cuMemcpyHtoDAsync_v2: CUDA_ERROR_INVALID_VALUE (CUresult 1)")

	require.NoError(t, st.Close())
	require.NoError(t, st.Close(), "a second Close")
	require.NoError(t, st.Sync(), "nothing to wait for after Close")
	require.ErrorIs(t, st.ToHost(out[:1], p), errStreamClosed)
	require.ErrorIs(t, st.ToDevice(p, out[:1]), errStreamClosed)
	assert.Zero(t, f.liveStreams())

	_, err = d.NewStream(2)
	require.ErrorIs(t, err, ErrNotDevice)
	require.NoError(t, CopyToHost(d, 1, out[:16], p))
	require.Equal(t, src2[:16], out[:16])
	require.NoError(t, d.Free(p))
	require.NoError(t, d.HostFree(pinned))
	assert.Zero(t, f.liveAllocs())
	assert.Zero(t, f.wrongContext(), "calls made without the right context current")
}

// TestCUDAFakeCopy copies device to device through the binding, on one
// GPU and between two, against the fake driver.
func TestCUDAFakeCopy(t *testing.T) {
	d, f := fakeCUDA(t)
	const n = 100003
	p0, err := d.Alloc(0, n)
	require.NoError(t, err)
	p1, err := d.Alloc(1, n)
	require.NoError(t, err)
	q1, err := d.Alloc(1, n)
	require.NoError(t, err)
	src := randomBytes(n)
	require.NoError(t, CopyToDevice(d, 0, p0, src))
	st, err := d.NewStream(1)
	require.NoError(t, err)
	require.NoError(t, st.Copy(p1, p0, n), "a peer copy")
	require.NoError(t, st.Copy(q1+10, p1, n-10), "in order on the stream, after the peer copy")
	require.NoError(t, st.Copy(q1, p1, 0))
	require.Error(t, st.Copy(q1, p1, -1))
	err = st.Copy(q1+1, p1, n)
	require.Error(t, err, "past the end of the destination")
	assert.Contains(t, err.Error(), "cuMemcpyAsync: CUDA_ERROR_INVALID_VALUE (CUresult 1)")
	require.NoError(t, st.Close())
	require.ErrorIs(t, st.Copy(q1, p1, 1), errStreamClosed)
	out := make([]byte, n)
	require.NoError(t, CopyToHost(d, 1, out, q1))
	require.Equal(t, src[:n-10], out[10:])
	require.NoError(t, CopyDevice(d, 0, p0, q1+10, n-10))
	require.NoError(t, CopyToHost(d, 0, out, p0))
	require.Equal(t, src[:n-10], out[:n-10])
	for _, p := range []uintptr{p0, p1, q1} {
		require.NoError(t, d.Free(p))
	}
	assert.Zero(t, f.liveAllocs())
	assert.Zero(t, f.wrongContext())
}

// currentContext returns the context current on the calling thread, which
// the caller has locked.
func currentContext(t *testing.T, d *cudaDriver) uintptr {
	t.Helper()
	var c uintptr
	require.NoError(t, d.api.check("cuCtxGetCurrent", call(d.api.ctxGetCurrent, uintptr(unsafe.Pointer(&c)))))
	return c
}

// setContext makes c current on the calling thread, which the caller has
// locked.
func setContext(t *testing.T, d *cudaDriver, c uintptr) {
	t.Helper()
	require.NoError(t, d.api.check("cuCtxSetCurrent", call(d.api.ctxSetCurrent, c)))
}

// exerciseGPU runs every call of the driver on GPU dev.
func exerciseGPU(t *testing.T, d *cudaDriver, dev int) {
	t.Helper()
	p, err := d.Alloc(dev, 4096)
	require.NoError(t, err)
	require.NoError(t, d.Check(p, 4096, dev))
	h, err := d.HostAlloc(4096)
	require.NoError(t, err)
	copy(h, randomBytes(4096))
	st, err := d.NewStream(dev)
	require.NoError(t, err)
	require.NoError(t, st.ToDevice(p, h))
	out := make([]byte, 4096)
	require.NoError(t, st.ToHost(out, p))
	require.NoError(t, st.Sync())
	require.NoError(t, st.Close())
	require.Equal(t, h, out)
	require.NoError(t, d.HostFree(h))
	require.NoError(t, d.Free(p))
}

// checkRestoresContext runs every call of the driver on a thread with
// each of the contexts given current in turn, and checks that the thread
// has the same context current after each.
func checkRestoresContext(t *testing.T, d *cudaDriver, contexts ...uintptr) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	was := currentContext(t, d)
	defer setContext(t, d, was)
	n, err := d.Devices()
	require.NoError(t, err)
	for _, c := range contexts {
		setContext(t, d, c)
		for dev := range n {
			exerciseGPU(t, d, dev)
			require.Equal(t, c, currentContext(t, d), "the context current before calls on GPU %d", dev)
		}
	}
}

// TestCUDAFakeContexts checks, against the fake driver, that every call
// runs with its GPU's primary context current and leaves the thread's
// own context (none, another library's, another GPU's) as it found it.
func TestCUDAFakeContexts(t *testing.T) {
	d, f := fakeCUDA(t)
	_, c0, err := d.primary(0)
	require.NoError(t, err)
	checkRestoresContext(t, d, 0, f.foreignContext(), c0)
	assert.Zero(t, f.wrongContext(), "calls made without the right context current")
	assert.Equal(t, int64(1), f.retains(0), "GPU 0's primary context retained once")
	assert.Equal(t, int64(1), f.retains(1), "GPU 1's primary context retained once")
	assert.Zero(t, f.liveAllocs())
	assert.Zero(t, f.liveStreams())
}

// TestCUDAFakeConcurrent uses the binding from many goroutines at once,
// on both GPUs: each call must still find its own GPU's context current.
func TestCUDAFakeConcurrent(t *testing.T) {
	d, f := fakeCUDA(t)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			dev := g % 2
			for range 20 {
				p, err := d.Alloc(dev, 8192)
				if err != nil {
					errs <- err
					return
				}
				src := randomBytes(8192)
				out := make([]byte, 8192)
				err = CopyToDevice(d, dev, p, src)
				if err == nil {
					err = CopyToHost(d, dev, out, p)
				}
				if err == nil && !bytes.Equal(src, out) {
					err = fmt.Errorf("GPU %d: the bytes read back differ from those written", dev)
				}
				if err == nil {
					err = d.Check(p, 8192, dev)
				}
				if ferr := d.Free(p); err == nil {
					err = ferr
				}
				if err != nil {
					errs <- err
					return
				}
				runtime.Gosched()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	assert.Zero(t, f.wrongContext(), "calls made without the right context current")
	assert.Equal(t, int64(1), f.retains(0))
	assert.Equal(t, int64(1), f.retains(1))
	assert.Zero(t, f.liveAllocs())
	assert.Zero(t, f.liveStreams())
}

// TestCUDARestoresContext is TestCUDAFakeContexts on a real GPU: the
// thread's context, none or a GPU's primary one, is left as it was.
func TestCUDARestoresContext(t *testing.T) {
	d := realCUDA(t).(*cudaDriver)
	_, c0, err := d.primary(0)
	require.NoError(t, err)
	checkRestoresContext(t, d, 0, c0)
}
