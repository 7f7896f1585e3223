//go:build linux && (amd64 || arm64)

package devmem

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"github.com/ebitengine/purego"
)

// libcuda is the driver library's name; tests point it elsewhere.
var libcuda = "libcuda.so.1"

// CUDA driver API constants, from cuda.h.
const (
	cuSuccess          = 0
	cuErrNotReady      = 600
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
	memcpyDtoHAsync, memcpyHtoDAsync               uintptr
	devices                                        int
	version                                        int
}

func loadCUDA() (*cudaAPI, error) {
	lib, err := purego.Dlopen(libcuda, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, err // dlerror's text names the library
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
	} {
		if *s.p, err = purego.Dlsym(lib, s.name); err != nil {
			return nil, fmt.Errorf("%s has no %s (a driver older than CUDA 10.2?): %w", libcuda, s.name, err)
		}
	}
	if err := a.check("cuInit", call(cuInit, 0)); err != nil {
		return nil, err
	}
	var v, n int32
	if err := a.check("cuDriverGetVersion", call(a.driverGetVersion, uintptr(unsafe.Pointer(&v)))); err != nil {
		return nil, err
	}
	if v < cudaMinimumVersion {
		return nil, fmt.Errorf("the CUDA driver is version %d.%d; goxfer needs 10.2 or later", v/1000, v%1000/10)
	}
	if err := a.check("cuDeviceGetCount", call(a.deviceGetCount, uintptr(unsafe.Pointer(&n)))); err != nil {
		return nil, err
	}
	a.version, a.devices = int(v), int(n)
	return a, nil
}

// call calls a driver function and returns its CUresult.
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
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 && n < 256 {
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

// Check verifies through cuPointerGetAttributes that [ptr, ptr+n) is
// device memory of GPU dev, inside one allocation.
func (d *cudaDriver) Check(ptr uintptr, n uint64, dev int) error {
	var (
		memType, managed uint32
		ordinal          int32
		start            uintptr
		size             uint64
	)
	attrs := [...]uint32{cuAttrMemoryType, cuAttrIsManaged, cuAttrDevOrdinal, cuAttrRangeStart, cuAttrRangeSize}
	data := [...]unsafe.Pointer{unsafe.Pointer(&memType), unsafe.Pointer(&managed), unsafe.Pointer(&ordinal), unsafe.Pointer(&start), unsafe.Pointer(&size)}
	err := d.inContext(dev, func(a *cudaAPI) error {
		return a.check("cuPointerGetAttributes", call(a.pointerGetAttributes, uintptr(len(attrs)),
			uintptr(unsafe.Pointer(&attrs[0])), uintptr(unsafe.Pointer(&data[0])), ptr))
	})
	runtime.KeepAlive(&data)
	var ce *cudaError
	switch {
	case errors.As(err, &ce) && ce.code == 1: // CUDA_ERROR_INVALID_VALUE: a pointer CUDA never saw
		return fmt.Errorf("%w: 0x%x is not memory CUDA knows (%v)", ErrNotDevice, ptr, err)
	case err != nil:
		return err
	case memType == cuMemTypeHost:
		return fmt.Errorf("%w: 0x%x is host memory registered with CUDA, not device memory", ErrNotDevice, ptr)
	case memType != cuMemTypeDevice:
		return fmt.Errorf("%w: 0x%x is not memory CUDA knows (memory type %d)", ErrNotDevice, ptr, memType)
	case managed != 0:
		return fmt.Errorf("%w: 0x%x is managed (unified) memory; goxfer moves device memory from cuMemAlloc or a caching allocator", ErrNotDevice, ptr)
	case int(ordinal) != dev:
		return fmt.Errorf("%w: 0x%x is memory of GPU %d, not of GPU %d", ErrNotDevice, ptr, ordinal, dev)
	case uint64(ptr-start) > size || n > size-uint64(ptr-start):
		return fmt.Errorf("%w: [0x%x, +%d) runs past the end of its allocation [0x%x, +%d)", ErrNotDevice, ptr, n, start, size)
	}
	return nil
}

// Alloc allocates device memory with cuMemAlloc in GPU dev's primary
// context.
func (d *cudaDriver) Alloc(dev int, n int) (uintptr, error) {
	if n <= 0 {
		return 0, fmt.Errorf("devmem: cuda: allocation of %d bytes", n)
	}
	var p uintptr
	err := d.inContext(dev, func(a *cudaAPI) error {
		return a.check("cuMemAlloc_v2", call(a.memAlloc, uintptr(unsafe.Pointer(&p)), uintptr(n)))
	})
	return p, err
}

// Free frees memory from Alloc.
func (d *cudaDriver) Free(ptr uintptr) error {
	dev, err := d.ownerOf(ptr)
	if err != nil {
		return err
	}
	return d.inContext(dev, func(a *cudaAPI) error { return a.check("cuMemFree_v2", call(a.memFree, ptr)) })
}

// ownerOf returns the GPU that device memory at ptr belongs to.
func (d *cudaDriver) ownerOf(ptr uintptr) (int, error) {
	a, err := d.load()
	if err != nil {
		return 0, err
	}
	var ordinal int32 = -1
	attr := uint32(cuAttrDevOrdinal)
	data := unsafe.Pointer(&ordinal)
	if err := d.inContext(0, func(a *cudaAPI) error {
		return a.check("cuPointerGetAttributes", call(a.pointerGetAttributes, 1, uintptr(unsafe.Pointer(&attr)), uintptr(unsafe.Pointer(&data)), ptr))
	}); err != nil {
		return 0, err
	}
	if ordinal < 0 || int(ordinal) >= a.devices {
		return 0, fmt.Errorf("%w: 0x%x is not memory of any GPU", ErrNotDevice, ptr)
	}
	return int(ordinal), nil
}

// HostAlloc allocates pinned host memory with cuMemHostAlloc, portable to
// every context.
func (d *cudaDriver) HostAlloc(n int) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("devmem: cuda: host allocation of %d bytes", n)
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

// HostFree frees memory from HostAlloc.
func (d *cudaDriver) HostFree(b []byte) error {
	if len(b) == 0 {
		return fmt.Errorf("devmem: cuda: free of empty host memory")
	}
	return d.inContext(0, func(a *cudaAPI) error {
		return a.check("cuMemFreeHost", call(a.memFreeHost, uintptr(unsafe.Pointer(unsafe.SliceData(b)))))
	})
}

// NewStream creates a non-blocking stream in GPU dev's primary context.
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

// cudaStream is a CUDA stream. It keeps the host memory of the copies it
// queued alive until Sync.
type cudaStream struct {
	d    *cudaDriver
	dev  int
	s    uintptr
	held [][]byte
	err  error
}

func (st *cudaStream) ToHost(dst []byte, src uintptr) error {
	if len(dst) == 0 {
		return nil
	}
	st.held = append(st.held, dst)
	return st.d.inContext(st.dev, func(a *cudaAPI) error {
		return a.check("cuMemcpyDtoHAsync_v2", call(a.memcpyDtoHAsync, uintptr(unsafe.Pointer(unsafe.SliceData(dst))), src, uintptr(len(dst)), st.s))
	})
}

func (st *cudaStream) ToDevice(dst uintptr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	st.held = append(st.held, src)
	return st.d.inContext(st.dev, func(a *cudaAPI) error {
		return a.check("cuMemcpyHtoDAsync_v2", call(a.memcpyHtoDAsync, dst, uintptr(unsafe.Pointer(unsafe.SliceData(src))), uintptr(len(src)), st.s))
	})
}

func (st *cudaStream) Sync() error {
	err := st.d.inContext(st.dev, func(a *cudaAPI) error {
		return a.check("cuStreamSynchronize", call(a.streamSynchronize, st.s))
	})
	clear(st.held)
	st.held = st.held[:0]
	return err
}

func (st *cudaStream) Close() error {
	err := st.Sync()
	if st.s != 0 {
		derr := st.d.inContext(st.dev, func(a *cudaAPI) error {
			return a.check("cuStreamDestroy_v2", call(a.streamDestroy, st.s))
		})
		st.s = 0
		err = errors.Join(err, derr)
	}
	return err
}
