//go:build linux && (amd64 || arm64)

package devmem

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"unsafe"

	"github.com/ebitengine/purego"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/internal/oneline"
)

// Constants of sharing, from cuda.h.
const (
	cuAttrBufferID       = 7  // CU_POINTER_ATTRIBUTE_BUFFER_ID: unsigned long long
	cuAttrLegacyIPC      = 10 // CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: bool
	cuAttrHandleTypes    = 14 // CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: a CUmemAllocationHandleType bitmask
	cuAttrMempool        = 17 // CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: CUmemoryPool
	cuAttrMappingSize    = 18 // CU_POINTER_ATTRIBUTE_MAPPING_SIZE: size_t
	cuAttrMappingBase    = 19 // CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: void*
	cuHandlePosixFD      = 1  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
	cuAllocPinned        = 1  // CU_MEM_ALLOCATION_TYPE_PINNED
	cuLocationDevice     = 1  // CU_MEM_LOCATION_TYPE_DEVICE
	cuAccessReadWrite    = 3  // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
	cuGranularityMinimum = 0  // CU_MEM_ALLOC_GRANULARITY_MINIMUM
	cuIPCLazyPeerAccess  = 1  // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
)

// cuIpcMemHandle is CUipcMemHandle: 64 opaque bytes that
// cuIpcOpenMemHandle takes by value. The C ABIs pass a struct of that size
// differently (System V amd64 copies it onto the stack, AAPCS64 passes a
// pointer to a copy), so the call goes through purego.RegisterFunc, which
// implements both, rather than through call.
type cuIpcMemHandle struct{ Reserved [HandleSize]byte }

// cuMemLocation is CUmemLocation.
type cuMemLocation struct {
	Type uint32 // CUmemLocationType
	ID   int32
}

// cuMemAllocationProp is CUmemAllocationProp (CUDA 11.1 and later; 10.2's
// and 11.0's put 8 reserved bytes where allocFlags is, of the same size).
type cuMemAllocationProp struct {
	Type                 uint32 // CUmemAllocationType
	RequestedHandleTypes uint32 // CUmemAllocationHandleType
	Location             cuMemLocation
	Win32HandleMetaData  uintptr
	AllocFlags           [8]byte // compressionType, gpuDirectRDMACapable, usage, reserved[4]: zero
}

// cuMemAccessDesc is CUmemAccessDesc.
type cuMemAccessDesc struct {
	Location cuMemLocation
	Flags    uint32 // CUmemAccess_flags
}

// The layouts above must be cuda.h's on both ABIs.
var (
	_ [32]byte = [unsafe.Sizeof(cuMemAllocationProp{})]byte{}
	_ [12]byte = [unsafe.Sizeof(cuMemAccessDesc{})]byte{}
	_ [64]byte = [unsafe.Sizeof(cuIpcMemHandle{})]byte{}
)

// cudaShareAPI holds the driver's entry points of sharing. They are bound
// when present: a driver without them (older than CUDA 11, or a stub)
// still serves everything else, and sharing fails with ErrNotShareable
// naming the entry point missing.
type cudaShareAPI struct {
	ipcGet, ipcOpen, ipcClose                   uintptr
	uuid                                        uintptr
	uuidName                                    string
	granularity, create, release                uintptr
	reserve, addressFree, mapMem, unmap, access uintptr
	retain, exportHandle, importHandle          uintptr
	ipcOpenFn                                   func(p *uintptr, h cuIpcMemHandle, flags uint32) int32
	missing                                     map[uintptr]string // names of the entry points not found, by field address
}

// load looks up every entry point of sharing in lib.
func (sa *cudaShareAPI) load(lib uintptr) {
	sa.missing = make(map[uintptr]string)
	for _, s := range []struct {
		p    *uintptr
		name string
	}{
		{&sa.ipcGet, "cuIpcGetMemHandle"},
		{&sa.ipcOpen, "cuIpcOpenMemHandle_v2"},
		{&sa.ipcClose, "cuIpcCloseMemHandle"},
		{&sa.granularity, "cuMemGetAllocationGranularity"},
		{&sa.create, "cuMemCreate"},
		{&sa.release, "cuMemRelease"},
		{&sa.reserve, "cuMemAddressReserve"},
		{&sa.addressFree, "cuMemAddressFree"},
		{&sa.mapMem, "cuMemMap"},
		{&sa.unmap, "cuMemUnmap"},
		{&sa.access, "cuMemSetAccess"},
		{&sa.retain, "cuMemRetainAllocationHandle"},
		{&sa.exportHandle, "cuMemExportToShareableHandle"},
		{&sa.importHandle, "cuMemImportFromShareableHandle"},
	} {
		if a, err := purego.Dlsym(lib, s.name); err == nil {
			*s.p = a
		} else {
			sa.missing[uintptr(unsafe.Pointer(s.p))] = s.name
		}
	}
	// cuDeviceGetUuid_v2 (CUDA 11.4) tells MIG instances apart; the first
	// version names their parent GPU, which is right without MIG.
	for _, name := range []string{"cuDeviceGetUuid_v2", "cuDeviceGetUuid"} {
		if a, err := purego.Dlsym(lib, name); err == nil {
			sa.uuid, sa.uuidName = a, name
			break
		}
	}
	if sa.uuid == 0 {
		sa.missing[uintptr(unsafe.Pointer(&sa.uuid))] = "cuDeviceGetUuid"
	}
	if sa.ipcOpen != 0 {
		purego.RegisterFunc(&sa.ipcOpenFn, sa.ipcOpen)
	}
}

// need returns an error wrapping ErrNotShareable for the first of the
// entry points fns (fields of sa) that the driver lacks.
func (sa *cudaShareAPI) need(fns ...*uintptr) error {
	for _, p := range fns {
		if *p == 0 {
			return fmt.Errorf("%w: %s has no %s (a driver older than CUDA 11?)", ErrNotShareable, libcuda, sa.missing[uintptr(unsafe.Pointer(p))])
		}
	}
	return nil
}

// cudaVMM is an allocation of AllocShareable.
type cudaVMM struct {
	size uint64
	dev  int
}

// cudaMapping is a share opened by Import.
type cudaMapping struct {
	d      *cudaDriver
	ptr    uintptr
	size   uint64
	dev    int
	kind   ShareKind
	closed atomic.Bool
}

func (m *cudaMapping) Ptr() uintptr { return m.ptr }
func (m *cudaMapping) Size() uint64 { return m.size }
func (m *cudaMapping) Dev() int     { return m.dev }

// Close unmaps the mapping: cuIpcCloseMemHandle for a handle share,
// cuMemUnmap and cuMemAddressFree for an fd share. A second Close does
// nothing.
func (m *cudaMapping) Close() error {
	if m.closed.Swap(true) {
		return nil
	}
	d := m.d
	d.mu.Lock()
	delete(d.imports, m.ptr)
	d.mu.Unlock()
	return d.inContext(m.dev, func(a *cudaAPI) error {
		sa := &a.share
		if m.kind == ShareHandle {
			return a.check("cuIpcCloseMemHandle", call(sa.ipcClose, m.ptr))
		}
		return oneline.Join(
			a.check("cuMemUnmap", call(sa.unmap, m.ptr, uintptr(m.size))),
			a.check("cuMemAddressFree", call(sa.addressFree, m.ptr, uintptr(m.size))))
	})
}

// uuid returns the UUID of GPU dev, reading every GPU's at first use.
func (d *cudaDriver) uuid(dev int) ([16]byte, error) {
	a, err := d.load()
	if err != nil {
		return [16]byte{}, err
	}
	if dev < 0 || dev >= a.devices {
		return [16]byte{}, fmt.Errorf("%w: GPU %d does not exist (the driver sees %d)", ErrNotDevice, dev, a.devices)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.uuids == nil {
		if err := a.share.need(&a.share.uuid); err != nil {
			return [16]byte{}, err
		}
		uuids := make([][16]byte, a.devices)
		for i := range uuids {
			var cudev int32
			if err := a.check("cuDeviceGet", call(a.deviceGet, uintptr(unsafe.Pointer(&cudev)), uintptr(i))); err != nil {
				return [16]byte{}, err
			}
			u := new([16]byte)
			if err := a.check(a.share.uuidName, call(a.share.uuid, uintptr(unsafe.Pointer(u)), uintptr(cudev))); err != nil {
				return [16]byte{}, err
			}
			uuids[i] = *u
		}
		d.uuids = uuids
	}
	return d.uuids[dev], nil
}

// localGPU returns the ordinal of the GPU with UUID u, else near.
func (d *cudaDriver) localGPU(u [16]byte, near int) (int, error) {
	n, err := d.Devices()
	if err != nil {
		return 0, err
	}
	for dev := range n {
		v, err := d.uuid(dev)
		if err != nil {
			return 0, err
		}
		if v == u {
			return dev, nil
		}
	}
	if near >= 0 {
		return near, nil
	}
	return 0, fmt.Errorf("%w: share of GPU %x, which this process does not see (CUDA_VISIBLE_DEVICES?), and no near GPU to open it on", ErrNotShareable, u)
}

// shareInfo is what cuPointerGetAttributes says of a pointer to export.
// Every value is read into 8 zeroed bytes, whatever the width the driver
// writes (a bool, an unsigned int, a size_t).
type shareInfo struct {
	memType, managed, bufferID uint64
	ordinal                    int32
	start, size                uint64
	legacy, handleTypes        uint64
	legacyErr, typesErr        error
	mapBase, mapSize           uint64 // zero where the driver has no MAPPING_* attributes
	mempool                    uint64
}

// attrs reads attributes of ptr in one cuPointerGetAttributes call.
func (a *cudaAPI) attrs(ptr uintptr, attrs []uint32, data []unsafe.Pointer) error {
	err := a.check("cuPointerGetAttributes", call(a.pointerGetAttributes, uintptr(len(attrs)),
		uintptr(unsafe.Pointer(&attrs[0])), uintptr(unsafe.Pointer(&data[0])), ptr))
	runtime.KeepAlive(data)
	return err
}

// shareInfo queries what Export needs of ptr in GPU dev's context. The
// attributes newer than CUDA 11.0 are asked for one by one, so that a
// driver that does not know one still answers the others.
func (d *cudaDriver) shareInfo(ptr uintptr, dev int) (*shareInfo, error) {
	si := &shareInfo{}
	err := d.inContext(dev, func(a *cudaAPI) error {
		if err := a.attrs(ptr,
			[]uint32{cuAttrMemoryType, cuAttrIsManaged, cuAttrDevOrdinal, cuAttrBufferID, cuAttrRangeStart, cuAttrRangeSize},
			[]unsafe.Pointer{unsafe.Pointer(&si.memType), unsafe.Pointer(&si.managed), unsafe.Pointer(&si.ordinal), unsafe.Pointer(&si.bufferID), unsafe.Pointer(&si.start), unsafe.Pointer(&si.size)}); err != nil {
			return err
		}
		si.legacyErr = a.attrs(ptr, []uint32{cuAttrLegacyIPC}, []unsafe.Pointer{unsafe.Pointer(&si.legacy)})
		si.typesErr = a.attrs(ptr, []uint32{cuAttrHandleTypes}, []unsafe.Pointer{unsafe.Pointer(&si.handleTypes)})
		var base, size uint64
		if a.attrs(ptr, []uint32{cuAttrMappingBase, cuAttrMappingSize}, []unsafe.Pointer{unsafe.Pointer(&base), unsafe.Pointer(&size)}) == nil {
			si.mapBase, si.mapSize = base, size
		}
		_ = a.attrs(ptr, []uint32{cuAttrMempool}, []unsafe.Pointer{unsafe.Pointer(&si.mempool)})
		return nil
	})
	if ce := (*cudaError)(nil); errors.As(err, &ce) && ce.code == cuErrInvalidValue {
		return nil, fmt.Errorf("%w: CUDA: export: 0x%x is not memory CUDA knows (%v)", ErrNotDevice, ptr, err)
	}
	return si, err
}

// Export describes the allocation holding ptr, memory of GPU dev: a
// ShareHandle (cuIpcGetMemHandle) for memory that legacy IPC can share
// (cuMemAlloc, cudaMalloc, caching allocators built on them), a ShareFD
// (cuMemExportToShareableHandle) for VMM memory created with the POSIX
// file descriptor handle type, such as AllocShareable's. Base and Size
// are the allocation's (for VMM memory, the mapping's that holds ptr:
// a reserved range may hold several). A ShareFD's FD is the caller's to
// close; a ShareHandle's is -1.
func (d *cudaDriver) Export(ptr uintptr, dev int) (Share, error) {
	if _, _, err := d.primary(dev); err != nil {
		return Share{}, err
	}
	if from := d.importedAt(ptr); from != nil {
		return Share{}, fmt.Errorf("%w: CUDA: 0x%x is in a mapping imported from another process; only its owner exports it", ErrNotShareable, ptr)
	}
	si, err := d.shareInfo(ptr, dev)
	switch {
	case err != nil:
		return Share{}, err
	case si.memType == 0:
		return Share{}, fmt.Errorf("%w: CUDA: export: 0x%x is not memory CUDA knows", ErrNotDevice, ptr)
	case si.memType != cuMemTypeDevice:
		return Share{}, fmt.Errorf("%w: CUDA: export: 0x%x is CUDA memory of type %d, not device memory", ErrNotDevice, ptr, si.memType)
	case si.managed != 0:
		return Share{}, fmt.Errorf("%w: CUDA: 0x%x is managed (unified) memory, which no IPC shares", ErrNotShareable, ptr)
	case int(si.ordinal) != dev:
		return Share{}, fmt.Errorf("%w: CUDA: export: 0x%x is memory of GPU %d, not of GPU %d", ErrNotDevice, ptr, si.ordinal, dev)
	}
	u, err := d.uuid(dev)
	if err != nil {
		return Share{}, err
	}
	sh := Share{GPU: u, ID: si.bufferID, Base: uintptr(si.start), Size: si.size, FD: -1}
	a := d.api
	sa := &a.share
	if si.legacyErr == nil && si.legacy != 0 {
		if err := sa.need(&sa.ipcGet); err != nil {
			return Share{}, err
		}
		h := new(cuIpcMemHandle)
		err := d.inContext(dev, func(a *cudaAPI) error {
			return a.check("cuIpcGetMemHandle", call(sa.ipcGet, uintptr(unsafe.Pointer(h)), uintptr(si.start)))
		})
		if err != nil {
			return Share{}, fmt.Errorf("%w: CUDA: 0x%x: %w", ErrNotShareable, ptr, err)
		}
		sh.Kind, sh.Handle = ShareHandle, h.Reserved
		return sh, nil
	}
	if si.typesErr != nil || si.handleTypes&cuHandlePosixFD == 0 {
		what := fmt.Sprintf("allowed handle types 0x%x", si.handleTypes)
		if si.typesErr != nil {
			what = fmt.Sprintf("no allowed handle types (%v)", si.typesErr)
		}
		legacy := "not legacy IPC capable"
		if si.legacyErr != nil {
			legacy = fmt.Sprintf("legacy IPC capability unknown (%v)", si.legacyErr)
		}
		pool := ""
		if si.mempool != 0 {
			pool = ", from a memory pool (cuMemAllocAsync)"
		}
		return Share{}, fmt.Errorf("%w: CUDA: 0x%x is %s%s, and %s: neither an IPC handle nor a POSIX file descriptor exports it", ErrNotShareable, ptr, legacy, pool, what)
	}
	if err := sa.need(&sa.retain, &sa.exportHandle, &sa.release); err != nil {
		return Share{}, err
	}
	if si.mapSize != 0 {
		sh.Base, sh.Size = uintptr(si.mapBase), si.mapSize
	}
	fd := new(int32)
	*fd = -1
	err = d.inContext(dev, func(a *cudaAPI) error {
		var h uint64
		if err := a.check("cuMemRetainAllocationHandle", call(sa.retain, uintptr(unsafe.Pointer(&h)), ptr)); err != nil {
			return err
		}
		err := a.check("cuMemExportToShareableHandle", call(sa.exportHandle, uintptr(unsafe.Pointer(fd)), uintptr(h), cuHandlePosixFD, 0))
		return oneline.Join(err, a.check("cuMemRelease", call(sa.release, uintptr(h))))
	})
	if err != nil {
		if *fd >= 0 {
			_ = unix.Close(int(*fd))
		}
		return Share{}, fmt.Errorf("%w: CUDA: 0x%x: %w", ErrNotShareable, ptr, err)
	}
	sh.Kind, sh.FD = ShareFD, int(*fd)
	return sh, nil
}

// importedAt returns the open mapping of Import that holds ptr, if any.
func (d *cudaDriver) importedAt(ptr uintptr) *cudaMapping {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, m := range d.imports {
		if ptr >= m.ptr && uint64(ptr-m.ptr) < m.size {
			return m
		}
	}
	return nil
}

// maxCUDAShare bounds the size of a share Import maps: no GPU has more.
const maxCUDAShare = 1 << 44

// Import opens s in GPU's primary context: the GPU with the share's UUID,
// else near, with peer access enabled lazily. A ShareHandle opens with
// cuIpcOpenMemHandle, which refuses a handle of this process's own memory
// and, on some drivers, a second opening of the same handle: callers
// cache mappings by (process, Share.ID). A ShareFD is imported with
// cuMemImportFromShareableHandle and mapped into a range of its own
// (cuMemAddressReserve, cuMemMap, cuMemSetAccess); s.FD stays the
// caller's to close.
func (d *cudaDriver) Import(s Share, near int) (Mapping, error) {
	n, err := d.Devices()
	if err != nil {
		return nil, err
	}
	switch {
	case near < -1 || near >= n:
		return nil, fmt.Errorf("%w: CUDA: import near GPU %d, want -1 or a GPU of [0, %d)", ErrNotDevice, near, n)
	case s.Kind != ShareHandle && s.Kind != ShareFD:
		return nil, fmt.Errorf("%w: CUDA: share of kind %v, want handle or fd", ErrNotDevice, s.Kind)
	case s.Size == 0 || s.Size > maxCUDAShare:
		return nil, fmt.Errorf("%w: CUDA: share of %d bytes, want 1 to %d", ErrNotDevice, s.Size, uint64(maxCUDAShare))
	case s.Kind == ShareHandle && s.Handle == [HandleSize]byte{}:
		return nil, fmt.Errorf("%w: CUDA: handle share with an empty handle", ErrNotDevice)
	case s.Kind == ShareFD && s.FD < 0:
		return nil, fmt.Errorf("%w: CUDA: fd share with file descriptor %d", ErrNotDevice, s.FD)
	}
	dev, err := d.localGPU(s.GPU, near)
	if err != nil {
		return nil, err
	}
	a := d.api
	sa := &a.share
	m := &cudaMapping{d: d, size: s.Size, dev: dev, kind: s.Kind}
	if s.Kind == ShareHandle {
		if err := sa.need(&sa.ipcOpen, &sa.ipcClose); err != nil {
			return nil, err
		}
		p := new(uintptr)
		err = d.inContext(dev, func(a *cudaAPI) error {
			if err := a.check("cuIpcOpenMemHandle_v2", sa.ipcOpenFn(p, cuIpcMemHandle{s.Handle}, cuIPCLazyPeerAccess)); err != nil {
				return err
			}
			// The handle names an allocation of its own size: a share
			// claiming more would let copies run past the mapping. A
			// driver that does not answer for the range is trusted.
			var start, size uint64
			if a.attrs(*p, []uint32{cuAttrRangeStart, cuAttrRangeSize}, []unsafe.Pointer{unsafe.Pointer(&start), unsafe.Pointer(&size)}) != nil || start == 0 {
				return nil
			}
			if uint64(*p) < start || uint64(*p)-start > size || s.Size > size-(uint64(*p)-start) {
				err := fmt.Errorf("%w: CUDA: share of %d bytes of an allocation of %d bytes at 0x%x (opened at 0x%x)", ErrNotDevice, s.Size, size, start, *p)
				return oneline.Join(err, a.check("cuIpcCloseMemHandle", call(sa.ipcClose, *p)))
			}
			return nil
		})
		if err != nil {
			if errors.Is(err, ErrNotDevice) {
				return nil, err
			}
			return nil, fmt.Errorf("%w: CUDA: open the IPC handle of allocation %d on GPU %d: %w", ErrNotShareable, s.ID, dev, err)
		}
		m.ptr = *p
	} else {
		if err := sa.need(&sa.importHandle, &sa.reserve, &sa.mapMem, &sa.access, &sa.release, &sa.unmap, &sa.addressFree); err != nil {
			return nil, err
		}
		err = d.inContext(dev, func(a *cudaAPI) error {
			var h uint64
			if err := a.check("cuMemImportFromShareableHandle", call(sa.importHandle, uintptr(unsafe.Pointer(&h)), uintptr(s.FD), cuHandlePosixFD)); err != nil {
				return err
			}
			p, err := a.mapVMM(h, uintptr(s.Size), dev)
			m.ptr = p
			return oneline.Join(err, a.check("cuMemRelease", call(sa.release, uintptr(h))))
		})
		if err != nil && m.ptr != 0 {
			err = oneline.Join(err, d.inContext(dev, func(a *cudaAPI) error { return a.unmapVMM(m.ptr, uintptr(s.Size)) }))
		}
		if err != nil {
			return nil, fmt.Errorf("%w: CUDA: import allocation %d by file descriptor on GPU %d: %w", ErrNotShareable, s.ID, dev, err)
		}
	}
	d.mu.Lock()
	if d.imports == nil {
		d.imports = make(map[uintptr]*cudaMapping)
	}
	d.imports[m.ptr] = m
	d.mu.Unlock()
	return m, nil
}

// mapVMM reserves size bytes of address space, maps allocation h there
// and gives GPU dev read and write access, unwinding on failure. It
// returns 0 with the error.
func (a *cudaAPI) mapVMM(h uint64, size uintptr, dev int) (uintptr, error) {
	sa := &a.share
	var p uintptr
	if err := a.check("cuMemAddressReserve", call(sa.reserve, uintptr(unsafe.Pointer(&p)), size, 0, 0, 0)); err != nil {
		return 0, err
	}
	if err := a.check("cuMemMap", call(sa.mapMem, p, size, 0, uintptr(h), 0)); err != nil {
		return 0, oneline.Join(err, a.check("cuMemAddressFree", call(sa.addressFree, p, size)))
	}
	desc := &cuMemAccessDesc{Location: cuMemLocation{Type: cuLocationDevice, ID: int32(dev)}, Flags: cuAccessReadWrite}
	if err := a.check("cuMemSetAccess", call(sa.access, p, size, uintptr(unsafe.Pointer(desc)), 1)); err != nil {
		return 0, oneline.Join(err, a.unmapVMM(p, size))
	}
	return p, nil
}

// unmapVMM undoes mapVMM.
func (a *cudaAPI) unmapVMM(p, size uintptr) error {
	sa := &a.share
	return oneline.Join(
		a.check("cuMemUnmap", call(sa.unmap, p, size)),
		a.check("cuMemAddressFree", call(sa.addressFree, p, size)))
}

// AllocShareable allocates n bytes, rounded up to the allocation
// granularity, on GPU dev with cuMemCreate, shareable by POSIX file
// descriptor, and maps them with read and write access for dev. Free
// unmaps them, which frees the memory once no importer maps it.
func (d *cudaDriver) AllocShareable(dev int, n int) (uintptr, error) {
	if n <= 0 {
		return 0, fmt.Errorf("devmem: CUDA: allocation of %d bytes", n)
	}
	a, err := d.load()
	if err != nil {
		return 0, err
	}
	sa := &a.share
	if err := sa.need(&sa.granularity, &sa.create, &sa.release, &sa.reserve, &sa.mapMem, &sa.access, &sa.unmap, &sa.addressFree); err != nil {
		return 0, err
	}
	var p uintptr
	var size uintptr
	err = d.inContext(dev, func(a *cudaAPI) error {
		prop := &cuMemAllocationProp{Type: cuAllocPinned, RequestedHandleTypes: cuHandlePosixFD, Location: cuMemLocation{Type: cuLocationDevice, ID: int32(dev)}}
		var g uintptr
		if err := a.check("cuMemGetAllocationGranularity", call(sa.granularity, uintptr(unsafe.Pointer(&g)), uintptr(unsafe.Pointer(prop)), cuGranularityMinimum)); err != nil {
			return err
		}
		if g == 0 {
			return fmt.Errorf("devmem: CUDA: cuMemGetAllocationGranularity: granularity 0")
		}
		size = (uintptr(n) + g - 1) / g * g
		var h uint64
		if err := a.check("cuMemCreate", call(sa.create, uintptr(unsafe.Pointer(&h)), size, uintptr(unsafe.Pointer(prop)), 0)); err != nil {
			return err
		}
		var err error
		p, err = a.mapVMM(h, size, dev)
		// The mapping holds the memory from here on: Free's unmapping
		// releases it.
		err = oneline.Join(err, a.check("cuMemRelease", call(sa.release, uintptr(h))))
		if err != nil && p != 0 {
			err = oneline.Join(err, a.unmapVMM(p, size))
		}
		return err
	})
	if err != nil {
		return 0, err
	}
	d.mu.Lock()
	if d.vmm == nil {
		d.vmm = make(map[uintptr]cudaVMM)
	}
	d.vmm[p] = cudaVMM{size: uint64(size), dev: dev}
	d.mu.Unlock()
	return p, nil
}

// freeShared frees memory of AllocShareable and refuses mappings of
// Import; done is false for other memory, which cuMemFree frees.
func (d *cudaDriver) freeShared(ptr uintptr) (done bool, err error) {
	d.mu.Lock()
	v, isVMM := d.vmm[ptr]
	if isVMM {
		delete(d.vmm, ptr)
	}
	_, imported := d.imports[ptr]
	d.mu.Unlock()
	switch {
	case imported:
		return true, fmt.Errorf("%w: CUDA: free of 0x%x, a mapping imported from another process; Close the Mapping", ErrNotDevice, ptr)
	case isVMM:
		return true, d.inContext(v.dev, func(a *cudaAPI) error { return a.unmapVMM(ptr, uintptr(v.size)) })
	}
	return false, nil
}
