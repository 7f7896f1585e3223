//go:build ucx

package ucx

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/goxfer/goxfer/agent"
)

// Alloc returns n bytes of host memory allocated by UCX in this backend's
// context (ucp_mem_map with UCP_MEM_MAP_ALLOCATE), as ucx_perftest and
// NIXL's UCX backend place their buffers. UCX picks the allocator by
// UCX_ALLOC_PRIO: with the shared-memory transports (posix, sysv) it is a
// shared segment that a peer on the same host maps when it unpacks the
// remote key, so RMA into or out of it is a plain copy instead of UCX
// 1.13's software emulation over active messages, which is what
// memory UCX did not allocate gets. On RDMA transports it is registered
// memory like any other.
//
// Register, expose and transfer the memory like any other ([agent.DRAM] of
// the returned slice, or of parts of it): registration recognises it and
// reuses its mapping instead of mapping it again. Ownership:
//
//   - The memory is not Go heap: the garbage collector neither frees it nor
//     scans it, so it must not hold the only reference to a Go pointer.
//     Its contents are unspecified until written (fresh mappings are
//     zeroed, but UCX does not promise it).
//   - It lives until [Backend.Free], or until the backend closes,
//     whichever comes first: Close unmaps every block still allocated. Any
//     use of the slice (or of a slice of it) afterwards is a use after free
//     and may fault.
//   - Free fails with [ErrInUse] while a region inside the block is
//     registered with the agent (an operation over it is still open) or a
//     lease or transfer uses it, and with [ErrNotAllocated] for memory this
//     backend did not allocate or has freed already (a double Free).
//
// The backend must have been started (by its agent); n must be positive.
// Safe for concurrent use.
func (b *Backend) Alloc(n int) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("%w: Alloc of %d bytes", agent.ErrInvalid, n)
	}
	b.mu.Lock()
	started := b.started
	b.mu.Unlock()
	if !started {
		return nil, errors.New("ucx: Alloc before the backend was started by its agent")
	}
	b.regMu.Lock()
	defer b.regMu.Unlock()
	if b.dead {
		return nil, agent.ErrClosed
	}
	h, p, got, err := b.n.allocMem(uint64(n))
	if err != nil {
		return nil, fmt.Errorf("ucx: allocate %d bytes: %w", n, err)
	}
	m := &mapping{id: b.regSeq.Add(1), addr: uint64(uintptr(p)), len: got, memh: h, registered: true, alloc: true}
	b.live[m] = struct{}{}
	b.allocs[m.addr] = m
	return unsafe.Slice((*byte)(p), n), nil
}

// Free returns memory from [Backend.Alloc] to UCX. buf must be the slice
// Alloc returned (or start where it starts). See Alloc for the ownership
// rules and errors. Safe for concurrent use.
func (b *Backend) Free(buf []byte) error {
	if len(buf) == 0 {
		return fmt.Errorf("%w: Free of an empty slice", ErrNotAllocated)
	}
	addr := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(buf))))
	b.regMu.Lock()
	defer b.regMu.Unlock()
	m := b.allocs[addr]
	if m == nil {
		return fmt.Errorf("%w: 0x%x", ErrNotAllocated, addr)
	}
	if m.refs > 0 || m.users > 0 {
		return fmt.Errorf("%w: 0x%x+%d: %d registrations, %d leases or transfers", ErrInUse, addr, m.len, m.refs, m.users)
	}
	delete(b.allocs, addr)
	delete(b.live, m)
	h := m.memh
	m.memh = nil
	if h == nil || b.dead {
		return nil
	}
	return b.n.unmap(h)
}
