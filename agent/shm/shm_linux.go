//go:build linux

package shm

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Buffer is one allocation: host memory in a segment of its own. The
// caller owns it and frees it with [Buffer.Free]; the garbage collector
// never does. Its methods are safe for concurrent use.
type Buffer struct {
	seg  *segment
	size int
}

type segment struct {
	id   uint64
	fd   int
	mem  []byte // the whole mapping
	pins atomic.Int64
	free bool // under reg.mu
}

var ids atomic.Uint64

// reg lists the live segments, sorted by base address.
var reg struct {
	mu   sync.RWMutex
	segs []*segment
}

// Alloc returns size bytes of zeroed host memory in a new shared-memory
// segment, which same-host peers granted access to an exposure of it may
// map. The segment is created readable and writable by this process only
// (mode 0600, no name in any file system), and sealed against resizing.
// The memory stays valid until [Buffer.Free]; the caller must free it.
// size must be in [1, MaxSize]. Safe for concurrent use.
func Alloc(size int) (*Buffer, error) {
	if size <= 0 || uint64(size) > MaxSize {
		return nil, fmt.Errorf("%w: size %d, want 1 to %d bytes", ErrInvalid, size, uint64(MaxSize))
	}
	page := unix.Getpagesize()
	n := (size + page - 1) &^ (page - 1)
	fd, err := unix.MemfdCreate("goxfer-shm", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("shm: memfd_create: %w", err)
	}
	if err := unix.Fchmod(fd, 0o600); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("shm: fchmod: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(n)); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("shm: sizing a segment of %d bytes: %w", n, err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("shm: sealing a segment: %w", err)
	}
	mem, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("shm: mapping a segment of %d bytes: %w", n, err)
	}
	s := &segment{id: ids.Add(1), fd: fd, mem: mem}
	reg.mu.Lock()
	i, _ := slices.BinarySearchFunc(reg.segs, s.base(), func(x *segment, b uint64) int { return cmpU(x.base(), b) })
	reg.segs = slices.Insert(reg.segs, i, s)
	reg.mu.Unlock()
	return &Buffer{seg: s, size: size}, nil
}

func cmpU(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (s *segment) base() uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(s.mem)))) }

// Bytes returns the buffer's memory: len and cap are the size asked of
// Alloc. It must not be used after Free.
func (b *Buffer) Bytes() []byte { return b.seg.mem[:b.size:b.size] }

// Free unmaps the buffer and closes its segment. It fails with [ErrBusy],
// freeing nothing, while memory of the buffer is exposed (an exposure not
// yet revoked); peers that mapped the segment keep their mapping of it
// until the exposures that granted them it are revoked, which is what made
// it free. The caller must not use the memory afterwards, nor free it
// while a transfer of its own uses it. Freeing again does nothing.
func (b *Buffer) Free() error {
	s := b.seg
	reg.mu.Lock()
	if s.free {
		reg.mu.Unlock()
		return nil
	}
	if n := s.pins.Load(); n > 0 {
		reg.mu.Unlock()
		return fmt.Errorf("%w: %d exposures of segment %d are not revoked", ErrBusy, n, s.id)
	}
	s.free = true
	if i := slices.Index(reg.segs, s); i >= 0 {
		reg.segs = slices.Delete(reg.segs, i, i+1)
	}
	reg.mu.Unlock()
	err := unix.Munmap(s.mem)
	if cerr := unix.Close(s.fd); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("shm: freeing segment %d: %w", s.id, err)
	}
	return nil
}

// find returns the live segment holding [addr, addr+n). The caller holds
// reg.mu.
func find(addr, n uint64) *segment {
	if n == 0 || addr+n < addr {
		return nil
	}
	i, found := slices.BinarySearchFunc(reg.segs, addr, func(x *segment, a uint64) int { return cmpU(x.base(), a) })
	if !found {
		i-- // the segment starting before addr, if any
	}
	if i < 0 {
		return nil
	}
	s := reg.segs[i]
	if addr+n > s.base()+uint64(len(s.mem)) {
		return nil
	}
	return s
}

// Find reports the segment that holds all of [addr, addr+n), if this
// process allocated one there with [Alloc] and has not freed it.
func Find(addr, n uint64) (Seg, bool) {
	reg.mu.RLock()
	defer reg.mu.RUnlock()
	s := find(addr, n)
	if s == nil {
		return Seg{}, false
	}
	return Seg{ID: s.id, Base: s.base(), Size: uint64(len(s.mem))}, true
}

// Pin marks [addr, addr+n) exposed, if it lies in a segment: Free refuses
// that segment until unpin is called (once). It returns nil if the range
// lies in none. The agent pins the regions of each exposure.
func Pin(addr, n uint64) (unpin func()) {
	reg.mu.RLock()
	defer reg.mu.RUnlock()
	s := find(addr, n)
	if s == nil {
		return nil
	}
	s.pins.Add(1)
	var once sync.Once
	return func() { once.Do(func() { s.pins.Add(-1) }) }
}

// DupFD returns a new file descriptor for segment id (close-on-exec), for
// handing it to a peer; the caller closes it. It fails once the segment
// was freed.
func DupFD(id uint64) (int, error) {
	reg.mu.RLock()
	defer reg.mu.RUnlock()
	for _, s := range reg.segs {
		if s.id == id {
			fd, err := unix.FcntlInt(uintptr(s.fd), unix.F_DUPFD_CLOEXEC, 0)
			if err != nil {
				return -1, fmt.Errorf("shm: duplicating segment %d: %w", id, err)
			}
			return fd, nil
		}
	}
	return -1, fmt.Errorf("shm: segment %d was freed", id)
}

// Map maps a segment a peer handed over (fd) into this process, readable
// and writable; its pages are faulted in as they are first touched. The file must be a sealed memory file at least size bytes long
// (size is what the peer claims; the file's own size is checked). The
// caller unmaps it with [Unmap] and keeps fd's ownership.
func Map(fd int, size uint64) ([]byte, error) {
	if size == 0 || size > MaxSize {
		return nil, fmt.Errorf("%w: a segment of %d bytes, want 1 to %d", ErrInvalid, size, uint64(MaxSize))
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: the descriptor is no memory file: %w", ErrInvalid, err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return nil, fmt.Errorf("%w: the memory file can shrink (seals %#x): a mapping of it could fault", ErrInvalid, seals)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("shm: fstat: %w", err)
	}
	if uint64(st.Size) < size {
		return nil, fmt.Errorf("%w: the memory file holds %d bytes, the peer claims %d", ErrInvalid, st.Size, size)
	}
	// Not MAP_POPULATE: faulting in a sparse segment (a pool mostly
	// untouched) would allocate all of it, here, for a peer that claims a
	// terabyte. Pages are faulted in as copies first touch them.
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("shm: mapping a peer's segment of %d bytes: %w", size, err)
	}
	return mem, nil
}

// Unmap undoes [Map].
func Unmap(mem []byte) error { return unix.Munmap(mem) }
