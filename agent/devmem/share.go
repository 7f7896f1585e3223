package devmem

import (
	"errors"
	"fmt"
)

// ShareKind says how a [Share] travels to the importing process.
type ShareKind uint8

const (
	// ShareHandle is a legacy CUDA IPC handle (cuIpcGetMemHandle) of an
	// allocation made with cuMemAlloc (cudaMalloc): 64 opaque bytes that
	// any process on the host may open. It travels in-band.
	ShareHandle ShareKind = 1
	// ShareFD is a POSIX file descriptor of a VMM allocation (cuMemCreate
	// with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), which legacy IPC
	// cannot share. It travels over a Unix socket (SCM_RIGHTS).
	ShareFD ShareKind = 2
)

// String returns "handle" or "fd".
func (k ShareKind) String() string {
	switch k {
	case ShareHandle:
		return "handle"
	case ShareFD:
		return "fd"
	}
	return fmt.Sprintf("ShareKind(%d)", uint8(k))
}

// HandleSize is the size of a [Share]'s Handle (CU_IPC_HANDLE_SIZE).
const HandleSize = 64

// Share describes one device allocation of the exporting process so that
// another process on the same host can map it ([Sharer.Import]). It is
// made by [Sharer.Export] and travels to the importer out of band; the
// importer must treat every field as untrusted input.
type Share struct {
	Kind ShareKind
	// GPU is the UUID of the GPU holding the allocation (cuDeviceGetUuid;
	// the simulator's are fixed per ordinal). Ordinals differ between
	// processes (CUDA_VISIBLE_DEVICES); UUIDs do not.
	GPU [16]byte
	// ID identifies the allocation in the exporting process for the
	// process's lifetime (CU_POINTER_ATTRIBUTE_BUFFER_ID): an importer
	// caches its mapping by (exporting process, ID).
	ID uint64
	// Base and Size are the allocation's first address in the exporting
	// process and its length in bytes: a device address A of the exporter
	// in [Base, Base+Size) is the importer's mapping's Ptr()+(A-Base).
	Base uintptr
	Size uint64
	// Handle holds the IPC handle of a ShareHandle.
	Handle [HandleSize]byte
	// FD is a ShareFD's file descriptor, owned by whoever holds the Share:
	// Export's caller closes it once it has been sent; Import does not
	// close it. Export sets it to -1 in a ShareHandle, and Import ignores
	// it there.
	FD int
}

// Sharer is implemented by drivers whose device memory other processes on
// the same host can map: the CUDA driver (legacy IPC handles and VMM
// file descriptors) and the simulator (memory backed by memfd, mapped by
// the importer). Its methods are safe for concurrent use.
//
// Trust: a mapping reaches the whole allocation, not only the range a
// caller meant to share. Whoever holds a Share may read and write all of
// it.
type Sharer interface {
	// Export describes the allocation holding device address ptr of GPU
	// dev, of the kind it can be shared by: ShareHandle for cuMemAlloc
	// memory, ShareFD for VMM memory created shareable by file descriptor.
	// Memory that cannot be shared (managed memory, VMM memory without a
	// POSIX handle type, memory from a pool) fails with an error wrapping
	// [ErrNotShareable], saying what was found. A ShareFD's FD is new and
	// the caller's to close.
	Export(ptr uintptr, dev int) (Share, error)
	// Import maps s, exported by another process on this host, into this
	// process and returns the mapping. near is the GPU (ordinal) of the
	// local memory the caller will copy to or from, or -1 for host memory:
	// the mapping is opened on the GPU named by s.GPU when this process
	// sees it, else on near with peer access enabled. Import does not take
	// ownership of s.FD. Opening fails with [ErrNotShareable] when the
	// share names no live allocation or its GPU is not reachable, and with
	// [ErrNotDevice] for a malformed share.
	//
	// Each Import maps anew (CUDA may refuse a second opening of the same
	// IPC handle in one process, and always refuses a process's own), so
	// an importer caches its mappings by (exporting process, Share.ID) and
	// closes them when the exporter goes.
	Import(s Share, near int) (Mapping, error)
	// AllocShareable allocates n bytes on GPU dev as a VMM allocation
	// (cuMemCreate) that can be exported only by file descriptor
	// ([ShareFD]); Free frees it. For tests, benchmarks and examples.
	AllocShareable(dev int, n int) (uintptr, error)
}

// Mapping is another process's device allocation mapped into this one by
// [Sharer.Import].
type Mapping interface {
	// Ptr is the mapping's first device address in this process, standing
	// for the exporter's Share.Base. It may be used on streams as any
	// device address ([Stream.ToHost], [Stream.ToDevice], [Stream.Copy]).
	Ptr() uintptr
	// Size is the mapping's length, the Share's Size.
	Size() uint64
	// Dev is the ordinal of the GPU the mapping was opened on: the one to
	// copy on.
	Dev() int
	// Close unmaps it; copies on it must have completed. The exporter's
	// allocation is freed only once every importer has closed its mapping
	// and the exporter has freed it.
	Close() error
}

// ErrNotShareable reports device memory that cannot be shared with another
// process (see [Sharer.Export]), or a share that cannot be opened here.
var ErrNotShareable = errors.New("devmem: device memory not shareable")
