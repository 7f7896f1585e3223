//go:build linux && (amd64 || arm64)

package devmem

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/goxfer/goxfer/internal/oneline"
)

// libcuda is the driver library's name; tests point it elsewhere.
var libcuda = "libcuda.so.1"

// CUDA driver API constants, from cuda.h.
const (
	cuSuccess          = 0
	cuErrInvalidValue  = 1    // CUDA_ERROR_INVALID_VALUE
	cuMemHostPortable  = 0x01 // CU_MEMHOSTALLOC_PORTABLE
	cuStreamNonBlock   = 0x01 // CU_STREAM_NON_BLOCKING
	cuMemTypeHost      = 1    // CU_MEMORYTYPE_HOST
	cuMemTypeDevice    = 2    // CU_MEMORYTYPE_DEVICE
	cuAttrMemoryType   = 2    // CU_POINTER_ATTRIBUTE_MEMORY_TYPE: unsigned int
	cuAttrIsManaged    = 8    // CU_POINTER_ATTRIBUTE_IS_MANAGED: unsigned int (bool)
	cuAttrDevOrdinal   = 9    // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: int
	cuAttrRangeStart   = 11   // CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: void*
	cuAttrRangeSize    = 12   // CU_POINTER_ATTRIBUTE_RANGE_SIZE: size_t
	cudaMinimumVersion = 10020
)

// cudaAPI holds the driver's entry points.
type cudaAPI struct {
	getErrorName, driverGetVersion                 uintptr
	deviceGetCount, deviceGet                      uintptr
	primaryCtxRetain, ctxGetCurrent, ctxSetCurrent uintptr
	memAlloc, memFree, memHostAlloc, memFreeHost   uintptr
	pointerGetAttributes                           uintptr
	streamCreate, streamSynchronize, streamDestroy uintptr
	memcpyDtoHAsync, memcpyHtoDAsync, memcpyAsync  uintptr
	devices                                        int
	version                                        int
	share                                          cudaShareAPI // optional entry points of sharing
}

func loadCUDA() (*cudaAPI, error) {
	lib, err := purego.Dlopen(libcuda, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, fmt.Errorf("%w; install the NVIDIA driver", err) // dlerror's text names the library
	}
	a := &cudaAPI{}
	var cuInit uintptr
	for _, s := range []struct {
		p    *uintptr
		name string
	}{
		{&cuInit, "cuInit"},
		{&a.getErrorName, "cuGetErrorName"},
		{&a.driverGetVersion, "cuDriverGetVersion"},
		{&a.deviceGetCount, "cuDeviceGetCount"},
		{&a.deviceGet, "cuDeviceGet"},
		{&a.primaryCtxRetain, "cuDevicePrimaryCtxRetain"},
		{&a.ctxGetCurrent, "cuCtxGetCurrent"},
		{&a.ctxSetCurrent, "cuCtxSetCurrent"},
		{&a.memAlloc, "cuMemAlloc_v2"},
		{&a.memFree, "cuMemFree_v2"},
		{&a.memHostAlloc, "cuMemHostAlloc"},
		{&a.memFreeHost, "cuMemFreeHost"},
		{&a.pointerGetAttributes, "cuPointerGetAttributes"},
		{&a.streamCreate, "cuStreamCreate"},
		{&a.streamSynchronize, "cuStreamSynchronize"},
		{&a.streamDestroy, "cuStreamDestroy_v2"},
		{&a.memcpyDtoHAsync, "cuMemcpyDtoHAsync_v2"},
		{&a.memcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"},
		{&a.memcpyAsync, "cuMemcpyAsync"},
	} {
		if *s.p, err = purego.Dlsym(lib, s.name); err != nil {
			return nil, fmt.Errorf("%s has no %s (a driver older than CUDA 10.2?): %w", libcuda, s.name, err)
		}
	}
	a.share.load(lib)
	if err := a.check("cuInit", call(cuInit, 0)); err != nil {
		return nil, a.initError(err, "the library loaded but the driver found no usable GPU: see nvidia-smi, dmesg and CUDA_VISIBLE_DEVICES")
	}
	var v, n int32
	if err := a.check("cuDriverGetVersion", call(a.driverGetVersion, uintptr(unsafe.Pointer(&v)))); err != nil {
		return nil, a.initError(err, "")
	}
	if v < cudaMinimumVersion {
		return nil, fmt.Errorf("%s is CUDA driver version %d.%d; goxfer needs 10.2 or later", libcuda, v/1000, v%1000/10)
	}
	if err := a.check("cuDeviceGetCount", call(a.deviceGetCount, uintptr(unsafe.Pointer(&n)))); err != nil {
		return nil, a.initError(err, "")
	}
	a.version, a.devices = int(v), int(n)
	return a, nil
}

// initError rewords a failed call of loading, whose error [cudaDriver.load]
// wraps in ErrUnavailable, without a second "devmem:" and with a hint.
func (a *cudaAPI) initError(err error, hint string) error {
	ce := err.(*cudaError)
	if hint != "" {
		hint = "; " + hint
	}
	return fmt.Errorf("%s: %s: %s (CUresult %d)%s", libcuda, ce.fn, ce.name, ce.code, hint)
}

// call calls a driver function and returns its CUresult.
//
// Arguments are often addresses of Go variables converted to uintptr.
// uintptrescapes moves those variables to the heap and keeps them alive
// for the call: without it they could stay on the goroutine's stack, which
// the runtime may move (growing it on the way into this function) while
// the driver still writes to the old address.
//
//go:uintptrescapes
func call(fn uintptr, args ...uintptr) int32 {
	r, _, _ := purego.SyscallN(fn, args...)
	return int32(r)
}

// cudaError is a failed driver call.
type cudaError struct {
	fn   string
	code int32
	name string
}

func (e *cudaError) Error() string {
	return fmt.Sprintf("devmem: %s: %s (CUresult %d)", e.fn, e.name, e.code)
}

// check turns a CUresult into an error naming the call and the result.
func (a *cudaAPI) check(fn string, r int32) error {
	if r == cuSuccess {
		return nil
	}
	name := "unknown error"
	var p *byte
	if call(a.getErrorName, uintptr(r), uintptr(unsafe.Pointer(&p))) == cuSuccess && p != nil {
		name = cString(p)
	}
	return &cudaError{fn: fn, code: r, name: name}
}

// cString copies a NUL-terminated C string that the driver owns.
func cString(p *byte) string {
	n := 0
	for n < 256 && *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(p, n))
}

// Devices returns how many GPUs the driver sees.
func (d *cudaDriver) Devices() (int, error) {
	a, err := d.load()
	if err != nil {
		return 0, err
	}
	return a.devices, nil
}

// primary returns GPU dev's primary context, retained at first use.
func (d *cudaDriver) primary(dev int) (*cudaAPI, uintptr, error) {
	a, err := d.load()
	if err != nil {
		return nil, 0, err
	}
	if dev < 0 || dev >= a.devices {
		return nil, 0, fmt.Errorf("%w: GPU %d does not exist (the driver sees %d)", ErrNotDevice, dev, a.devices)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if c, ok := d.ctxs[dev]; ok {
		return a, c, nil
	}
	var cudev int32
	if err := a.check("cuDeviceGet", call(a.deviceGet, uintptr(unsafe.Pointer(&cudev)), uintptr(dev))); err != nil {
		return nil, 0, err
	}
	var c uintptr
	if err := a.check("cuDevicePrimaryCtxRetain", call(a.primaryCtxRetain, uintptr(unsafe.Pointer(&c)), uintptr(cudev))); err != nil {
		return nil, 0, err
	}
	if d.ctxs == nil {
		d.ctxs = make(map[int]uintptr)
	}
	d.ctxs[dev] = c // held for the life of the process, as the CUDA runtime does
	return a, c, nil
}

// inContext runs f on a locked OS thread with GPU dev's primary context
// current, then restores the thread's previous context.
//
// The driver keeps the current context per OS thread, while the Go
// scheduler moves goroutines between threads at any call, so a context
// made current by one call may be gone, or someone else's, at the next.
// Hence every call that needs a context is made inside inContext: the
// goroutine is locked to its thread for the duration, the context the
// thread had (none, or one PyTorch or UCX made current there) is read
// with cuCtxGetCurrent, the GPU's primary context is set with
// cuCtxSetCurrent if it is not already current, and the previous one is
// set back before the thread is unlocked. Nothing outlives the call on
// the thread, so goxfer neither depends on nor disturbs what other code
// keeps current.
func (d *cudaDriver) inContext(dev int, f func(a *cudaAPI) error) error {
	a, c, err := d.primary(dev)
	if err != nil {
		return err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var prev uintptr
	if err := a.check("cuCtxGetCurrent", call(a.ctxGetCurrent, uintptr(unsafe.Pointer(&prev)))); err != nil {
		return err
	}
	if prev != c {
		if err := a.check("cuCtxSetCurrent", call(a.ctxSetCurrent, c)); err != nil {
			return err
		}
		defer call(a.ctxSetCurrent, prev)
	}
	return f(a)
}

// pointerInfo is what cuPointerGetAttributes says of a pointer. A pointer
// the driver does not know reads as memory type 0.
type pointerInfo struct {
	// memType and managed are read wider than the driver writes (an enum,
	// a boolean) and zeroed first, so any width up to 8 reads correctly.
	memType, managed uint64
	ordinal          int32
	start            uintptr
	size             uint64
	unknown          error // the driver's refusal of a pointer it never saw, if it refused
}

// pointerInfo queries ptr's memory type, managedness, GPU and allocation
// range in GPU dev's primary context.
func (d *cudaDriver) pointerInfo(dev int, ptr uintptr) (*pointerInfo, error) {
	pi := &pointerInfo{}
	attrs := [...]uint32{cuAttrMemoryType, cuAttrIsManaged, cuAttrDevOrdinal, cuAttrRangeStart, cuAttrRangeSize}
	data := [...]unsafe.Pointer{unsafe.Pointer(&pi.memType), unsafe.Pointer(&pi.managed), unsafe.Pointer(&pi.ordinal), unsafe.Pointer(&pi.start), unsafe.Pointer(&pi.size)}
	err := d.inContext(dev, func(a *cudaAPI) error {
		return a.check("cuPointerGetAttributes", call(a.pointerGetAttributes, uintptr(len(attrs)),
			uintptr(unsafe.Pointer(&attrs[0])), uintptr(unsafe.Pointer(&data[0])), ptr))
	})
	runtime.KeepAlive(&data)
	// Since CUDA 11 an unknown pointer reads as memory type 0; older
	// drivers refuse it with CUDA_ERROR_INVALID_VALUE.
	if ce := (*cudaError)(nil); errors.As(err, &ce) && ce.code == cuErrInvalidValue {
		return &pointerInfo{unknown: err}, nil
	}
	return pi, err
}

// Check verifies through cuPointerGetAttributes that [ptr, ptr+n) is
// device memory of GPU dev, inside one allocation. Managed (unified)
// memory is refused: it is not what a KV cache is allocated with, and its
// pages may live on the host.
func (d *cudaDriver) Check(ptr uintptr, n uint64, dev int) error {
	pi, err := d.pointerInfo(dev, ptr)
	switch {
	case err != nil:
		return err
	case pi.unknown != nil:
		return fmt.Errorf("%w: 0x%x is not memory CUDA knows: an unregistered or unknown pointer (%v)", ErrNotDevice, ptr, pi.unknown)
	case pi.memType == 0:
		return fmt.Errorf("%w: 0x%x is not memory CUDA knows: an unregistered or unknown pointer", ErrNotDevice, ptr)
	case pi.memType == cuMemTypeHost:
		return fmt.Errorf("%w: 0x%x is host memory (pinned or registered with CUDA), not device memory", ErrNotDevice, ptr)
	case pi.memType != cuMemTypeDevice:
		return fmt.Errorf("%w: 0x%x is CUDA memory of type %d, not device memory (type %d)", ErrNotDevice, ptr, pi.memType, cuMemTypeDevice)
	case pi.managed != 0:
		return fmt.Errorf("%w: 0x%x is managed (unified) memory; goxfer moves device memory from cuMemAlloc or a caching allocator", ErrNotDevice, ptr)
	case int(pi.ordinal) != dev:
		return fmt.Errorf("%w: 0x%x is memory of GPU %d, not of GPU %d", ErrNotDevice, ptr, pi.ordinal, dev)
	case ptr < pi.start || uint64(ptr-pi.start) > pi.size || n > pi.size-uint64(ptr-pi.start):
		return fmt.Errorf("%w: [0x%x, +%d) runs past the end of its allocation [0x%x, +%d)", ErrNotDevice, ptr, n, pi.start, pi.size)
	}
	return nil
}

// Alloc allocates device memory with cuMemAlloc in GPU dev's primary
// context.
func (d *cudaDriver) Alloc(dev int, n int) (uintptr, error) {
	if n <= 0 {
		return 0, fmt.Errorf("devmem: CUDA: allocation of %d bytes", n)
	}
	var p uintptr
	err := d.inContext(dev, func(a *cudaAPI) error {
		return a.check("cuMemAlloc_v2", call(a.memAlloc, uintptr(unsafe.Pointer(&p)), uintptr(n)))
	})
	return p, err
}

// Free frees memory from Alloc with cuMemFree, in the primary context of
// the GPU it belongs to, and memory from AllocShareable by unmapping it.
// It refuses a mapping from Import: Close unmaps it.
func (d *cudaDriver) Free(ptr uintptr) error {
	if done, err := d.freeShared(ptr); done {
		return err
	}
	pi, err := d.pointerInfo(0, ptr)
	if err != nil {
		return err
	}
	if pi.unknown != nil || pi.memType != cuMemTypeDevice {
		return fmt.Errorf("%w: CUDA: free of 0x%x, which is not device memory CUDA knows", ErrNotDevice, ptr)
	}
	return d.inContext(int(pi.ordinal), func(a *cudaAPI) error { return a.check("cuMemFree_v2", call(a.memFree, ptr)) })
}

// HostAlloc allocates pinned host memory with cuMemHostAlloc, portable to
// every context. The memory is outside the Go heap; goxfer never pins Go
// memory.
func (d *cudaDriver) HostAlloc(n int) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("devmem: CUDA: host allocation of %d bytes", n)
	}
	var p unsafe.Pointer
	err := d.inContext(0, func(a *cudaAPI) error {
		return a.check("cuMemHostAlloc", call(a.memHostAlloc, uintptr(unsafe.Pointer(&p)), uintptr(n), cuMemHostPortable))
	})
	if err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), n), nil
}

// HostFree frees memory from HostAlloc with cuMemFreeHost.
func (d *cudaDriver) HostFree(b []byte) error {
	if len(b) == 0 {
		return fmt.Errorf("devmem: CUDA: free of empty host memory")
	}
	return d.inContext(0, func(a *cudaAPI) error {
		return a.check("cuMemFreeHost", call(a.memFreeHost, uintptr(unsafe.Pointer(unsafe.SliceData(b)))))
	})
}

// NewStream creates a non-blocking stream (it does not wait for the
// legacy default stream, which other code in the process may use) in GPU
// dev's primary context.
func (d *cudaDriver) NewStream(dev int) (Stream, error) {
	var s uintptr
	err := d.inContext(dev, func(a *cudaAPI) error {
		return a.check("cuStreamCreate", call(a.streamCreate, uintptr(unsafe.Pointer(&s)), cuStreamNonBlock))
	})
	if err != nil {
		return nil, err
	}
	return &cudaStream{d: d, dev: dev, s: s}, nil
}

// errStreamClosed is the error of a stream used after Close.
var errStreamClosed = errors.New("devmem: CUDA: stream used after Close")

// cudaStream is a CUDA stream. The driver reads and writes the host
// memory of a queued copy after the call that queued it returns, so the
// stream holds a reference to it until Sync: the Go heap does not move,
// and held memory is not freed.
type cudaStream struct {
	d    *cudaDriver
	dev  int
	s    uintptr // CUstream; 0 once closed
	held [][]byte
}

// ToHost queues cuMemcpyDtoHAsync from src into dst.
func (st *cudaStream) ToHost(dst []byte, src uintptr) error {
	if st.s == 0 {
		return errStreamClosed
	}
	if len(dst) == 0 {
		return nil
	}
	err := st.d.inContext(st.dev, func(a *cudaAPI) error {
		return a.check("cuMemcpyDtoHAsync_v2", call(a.memcpyDtoHAsync, uintptr(unsafe.Pointer(unsafe.SliceData(dst))), src, uintptr(len(dst)), st.s))
	})
	if err == nil {
		st.held = append(st.held, dst)
	}
	return err
}

// ToDevice queues cuMemcpyHtoDAsync from src into dst.
func (st *cudaStream) ToDevice(dst uintptr, src []byte) error {
	if st.s == 0 {
		return errStreamClosed
	}
	if len(src) == 0 {
		return nil
	}
	err := st.d.inContext(st.dev, func(a *cudaAPI) error {
		return a.check("cuMemcpyHtoDAsync_v2", call(a.memcpyHtoDAsync, dst, uintptr(unsafe.Pointer(unsafe.SliceData(src))), uintptr(len(src)), st.s))
	})
	if err == nil {
		st.held = append(st.held, src)
	}
	return err
}

// Copy queues cuMemcpyAsync from src to dst. With unified addressing
// (every 64-bit process since CUDA 4) the driver finds each end's GPU
// from its address, so the copy may be a peer copy between two GPUs, or
// touch memory of another process opened by Import.
func (st *cudaStream) Copy(dst, src uintptr, n int) error {
	if st.s == 0 {
		return errStreamClosed
	}
	if n < 0 {
		return fmt.Errorf("devmem: CUDA: copy of %d bytes", n)
	}
	if n == 0 {
		return nil
	}
	return st.d.inContext(st.dev, func(a *cudaAPI) error {
		return a.check("cuMemcpyAsync", call(a.memcpyAsync, dst, src, uintptr(n), st.s))
	})
}

// Sync waits with cuStreamSynchronize for the copies queued, then lets go
// of their host memory. After Close it has nothing to wait for.
func (st *cudaStream) Sync() error {
	if st.s == 0 {
		return nil
	}
	err := st.d.inContext(st.dev, func(a *cudaAPI) error {
		return a.check("cuStreamSynchronize", call(a.streamSynchronize, st.s))
	})
	runtime.KeepAlive(st.held)
	clear(st.held)
	st.held = st.held[:0]
	return err
}

// Close waits for the stream's copies and destroys it with
// cuStreamDestroy. A second Close does nothing.
func (st *cudaStream) Close() error {
	if st.s == 0 {
		return nil
	}
	err := st.Sync()
	derr := st.d.inContext(st.dev, func(a *cudaAPI) error {
		return a.check("cuStreamDestroy_v2", call(a.streamDestroy, st.s))
	})
	st.s, st.held = 0, nil
	return oneline.Join(err, derr)
}
