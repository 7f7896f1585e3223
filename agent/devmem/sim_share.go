package devmem

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"unsafe"

	"github.com/goxfer/goxfer/internal/oneline"
)

// How the simulator shares memory between processes. Each allocation's
// bytes are a memory file (memfd on Linux) named goxfer-sim:<pid>:<id>,
// which the allocating process keeps open until Free and maps shared; its
// device pointer is a separate PROT_NONE reservation, as in one process.
//
// A ShareHandle, made for Alloc's memory as CUDA makes legacy IPC handles
// for cuMemAlloc's, names the file by the exporter's process ID and file
// descriptor number: the importer opens /proc/<pid>/fd/<fd>, which Linux
// allows a process of the same user, and checks the file's name before
// and after opening it, so a descriptor number that Free released and a
// later allocation reused is refused instead of mapped. A ShareFD, made
// for AllocShareable's memory as CUDA makes POSIX descriptors for
// shareable VMM memory, carries a duplicate of the descriptor itself.
//
// The handle's 64 bytes, little-endian:
//
//	[0, 8)   "GXSIMIPC"
//	[8, 12)  the exporter's process ID
//	[12, 16) the memory file's descriptor number in the exporter
//	[16, 24) the allocation ID (Share.ID)
//	[24, 32) the allocation's size (Share.Size)
//	[32, 36) the exporter's GPU ordinal
//	[36, 64) zero
const simHandleMagic = "GXSIMIPC"

var _ Sharer = (*Sim)(nil)

// simGPUPrefix begins a simulated GPU's UUID; the ordinal, big-endian,
// ends it.
const simGPUPrefix = "goxfer-sim-gpu"

// maxSimShare bounds the size of a share the simulator maps.
const maxSimShare = 1 << 40

// simGPU returns the UUID of simulated GPU dev.
func simGPU(dev int) [16]byte {
	var u [16]byte
	copy(u[:], simGPUPrefix)
	binary.BigEndian.PutUint16(u[14:], uint16(dev))
	return u
}

// simGPUOrdinal returns the ordinal of a simulated GPU's UUID, or false
// for another UUID.
func simGPUOrdinal(u [16]byte) (int, bool) {
	if string(u[:14]) != simGPUPrefix {
		return 0, false
	}
	return int(binary.BigEndian.Uint16(u[14:])), true
}

// simHandle is a decoded ShareHandle of the simulator.
type simHandle struct {
	pid, fd, dev int
	id, size     uint64
}

func (h simHandle) encode() [HandleSize]byte {
	var b [HandleSize]byte
	copy(b[:8], simHandleMagic)
	binary.LittleEndian.PutUint32(b[8:], uint32(h.pid))
	binary.LittleEndian.PutUint32(b[12:], uint32(h.fd))
	binary.LittleEndian.PutUint64(b[16:], h.id)
	binary.LittleEndian.PutUint64(b[24:], h.size)
	binary.LittleEndian.PutUint32(b[32:], uint32(h.dev))
	return b
}

// decodeSimHandle decodes and checks a simulator's ShareHandle, which
// comes from another process and is untrusted. Its errors wrap
// ErrNotDevice.
func decodeSimHandle(b [HandleSize]byte) (simHandle, error) {
	if string(b[:8]) != simHandleMagic {
		return simHandle{}, fmt.Errorf("%w: sim: a handle beginning %q, not %q: not the simulator's", ErrNotDevice, b[:8], simHandleMagic)
	}
	h := simHandle{
		pid:  int(binary.LittleEndian.Uint32(b[8:])),
		fd:   int(binary.LittleEndian.Uint32(b[12:])),
		id:   binary.LittleEndian.Uint64(b[16:]),
		size: binary.LittleEndian.Uint64(b[24:]),
		dev:  int(binary.LittleEndian.Uint32(b[32:])),
	}
	switch {
	case h.pid <= 0 || h.pid > math.MaxInt32:
		return simHandle{}, fmt.Errorf("%w: sim: handle of process %d", ErrNotDevice, int64(binary.LittleEndian.Uint32(b[8:])))
	case h.fd > math.MaxInt32:
		return simHandle{}, fmt.Errorf("%w: sim: handle of file descriptor %d", ErrNotDevice, h.fd)
	case h.dev > math.MaxUint16:
		return simHandle{}, fmt.Errorf("%w: sim: handle of GPU %d", ErrNotDevice, h.dev)
	case !bytes.Equal(b[36:], make([]byte, HandleSize-36)):
		return simHandle{}, fmt.Errorf("%w: sim: handle with bytes set after byte 36, which must be zero", ErrNotDevice)
	}
	return h, nil
}

// validate checks every field of a share from another process and
// decodes its handle. Its errors wrap ErrNotDevice.
func (s *Sim) validate(sh Share) (simHandle, error) {
	ps := uint64(pageSize())
	switch {
	case sh.Kind != ShareHandle && sh.Kind != ShareFD:
		return simHandle{}, fmt.Errorf("%w: sim: share of kind %v, want handle or fd", ErrNotDevice, sh.Kind)
	case sh.Size == 0 || sh.Size > maxSimShare || sh.Size > math.MaxInt-ps:
		return simHandle{}, fmt.Errorf("%w: sim: share of %d bytes, want 1 to %d", ErrNotDevice, sh.Size, uint64(maxSimShare))
	case sh.ID == 0:
		return simHandle{}, fmt.Errorf("%w: sim: share of allocation ID 0, which the simulator never gives", ErrNotDevice)
	case sh.Base == 0 || uint64(sh.Base)%ps != 0 || uint64(sh.Base) > math.MaxUint64-sh.Size:
		return simHandle{}, fmt.Errorf("%w: sim: share based at 0x%x, want a page-aligned address with %d bytes after it", ErrNotDevice, sh.Base, sh.Size)
	}
	if sh.Kind == ShareFD {
		if sh.FD < 0 {
			return simHandle{}, fmt.Errorf("%w: sim: fd share with file descriptor %d", ErrNotDevice, sh.FD)
		}
		if sh.Handle != [HandleSize]byte{} {
			return simHandle{}, fmt.Errorf("%w: sim: fd share with a handle set, which only a handle share has", ErrNotDevice)
		}
		return simHandle{}, nil
	}
	h, err := decodeSimHandle(sh.Handle)
	if err != nil {
		return simHandle{}, err
	}
	if h.id != sh.ID || h.size != sh.Size {
		return simHandle{}, fmt.Errorf("%w: sim: handle of allocation %d of %d bytes in a share of allocation %d of %d bytes", ErrNotDevice, h.id, h.size, sh.ID, sh.Size)
	}
	if dev, ok := simGPUOrdinal(sh.GPU); ok && dev != h.dev {
		return simHandle{}, fmt.Errorf("%w: sim: handle of GPU %d in a share of simulated GPU %d", ErrNotDevice, h.dev, dev)
	}
	return h, nil
}

// Export describes the allocation holding ptr, which must be memory of
// GPU dev: a [ShareHandle] for Alloc's memory, a [ShareFD] (with a new
// descriptor, FD, the caller's to close) for AllocShareable's. A
// ShareHandle's FD is -1. Memory imported from another process is not
// exported again: only its owner exports it.
func (s *Sim) Export(ptr uintptr, dev int) (Share, error) {
	if err := s.checkDev(dev); err != nil {
		return Share{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	a, err := s.find(ptr, 1)
	if err != nil {
		return Share{}, fmt.Errorf("devmem: sim: export: %w", err)
	}
	if a.dev != dev {
		return Share{}, fmt.Errorf("devmem: sim: export: %w: 0x%x is memory of GPU %d, not of GPU %d", ErrNotDevice, ptr, a.dev, dev)
	}
	if a.imported {
		return Share{}, fmt.Errorf("%w: sim: 0x%x is a mapping imported from %s; only its owner exports it", ErrNotShareable, ptr, simProcess(a.from))
	}
	sh := Share{GPU: simGPU(a.dev), ID: a.id, Base: a.base, Size: a.size, FD: -1}
	if !a.vmm {
		sh.Kind = ShareHandle
		sh.Handle = simHandle{pid: os.Getpid(), fd: a.fd, dev: a.dev, id: a.id, size: a.size}.encode()
		return sh, nil
	}
	fd, err := simDupFD(a.fd)
	if err != nil {
		return Share{}, fmt.Errorf("devmem: sim: export 0x%x: duplicate its memory file's descriptor: %w", ptr, err)
	}
	sh.Kind, sh.FD = ShareFD, fd
	return sh, nil
}

// simProcess names the exporting process of an imported mapping.
func simProcess(pid int) string {
	if pid <= 0 {
		return "another process"
	}
	return "process " + strconv.Itoa(pid)
}

// localGPU returns the ordinal to open a share of GPU u on: the simulated
// GPU with that UUID, else near.
func (s *Sim) localGPU(u [16]byte, near int) (int, error) {
	if dev, ok := simGPUOrdinal(u); ok && dev < s.devices {
		return dev, nil
	}
	if near >= 0 {
		return near, nil
	}
	return 0, fmt.Errorf("%w: sim: share of GPU %x, which this simulator (%d GPUs) does not have, and no near GPU to open it on", ErrNotShareable, u, s.devices)
}

// Import maps a share of another process's simulated device memory (or
// of this process's own) into this process, on the simulated GPU of the
// same UUID, else on near. The mapping's device address is reserved with
// no access rights, as Alloc's; stream copies accept it, Check reports it
// as memory of the GPU it was opened on, Free refuses it and Close unmaps
// it. Importing the same share twice maps it twice: callers that import
// repeatedly cache their mappings by (process, Share.ID). Import does
// not take ownership of s.FD.
//
// A ShareHandle is opened through /proc/<pid>/fd/<fd> of the exporting
// process (Linux only), which must still have the allocation: one freed
// or in a process that has exited fails with [ErrNotShareable].
func (s *Sim) Import(sh Share, near int) (Mapping, error) {
	if near < -1 || near >= s.devices {
		return nil, fmt.Errorf("%w: sim: import near GPU %d, want -1 or a GPU of [0, %d)", ErrNotDevice, near, s.devices)
	}
	h, err := s.validate(sh)
	if err != nil {
		return nil, err
	}
	dev, err := s.localGPU(sh.GPU, near)
	if err != nil {
		return nil, err
	}
	fd, from := sh.FD, -1
	if sh.Kind == ShareHandle {
		from = h.pid
		if fd, err = simOpenPeer(h.pid, h.fd, simFileName(h.pid, sh.ID)); err != nil {
			return nil, fmt.Errorf("%w: sim: allocation %d of process %d: %w", ErrNotShareable, sh.ID, h.pid, err)
		}
		defer func() { _ = simCloseFD(fd) }()
	} else if name, ok, err := simFDName(fd); err != nil {
		return nil, fmt.Errorf("%w: sim: fd share of allocation %d: descriptor %d: %w", ErrNotShareable, sh.ID, fd, err)
	} else if ok {
		pid, id, good := parseSimFileName(name)
		if !good || id != sh.ID {
			return nil, fmt.Errorf("%w: sim: fd share of allocation %d: descriptor %d is %q, not a memory file of the simulator's allocation %d", ErrNotDevice, sh.ID, fd, name, sh.ID)
		}
		from = pid
	}
	if err := simSealed(fd); err != nil {
		return nil, fmt.Errorf("%w: sim: share of allocation %d: %w", ErrNotDevice, sh.ID, err)
	}
	size := (sh.Size + uint64(pageSize()) - 1) &^ uint64(pageSize()-1)
	got, err := simFileSize(fd)
	if err != nil {
		return nil, fmt.Errorf("%w: sim: share of allocation %d: %w", ErrNotShareable, sh.ID, err)
	}
	if got != int64(size) {
		return nil, fmt.Errorf("%w: sim: share of %d bytes (%d in whole pages) of a memory file of %d bytes", ErrNotDevice, sh.Size, size, got)
	}
	view, err := mapMem(int(size), false)
	if err != nil {
		return nil, fmt.Errorf("devmem: sim: import: reserve %d bytes: %w", size, err)
	}
	back, err := simMapShared(fd, int(size))
	if err != nil {
		_ = unmapMem(view)
		return nil, fmt.Errorf("devmem: sim: import: map %d bytes: %w", size, err)
	}
	a := simAlloc{base: uintptr(unsafe.Pointer(&view[0])), size: sh.Size, dev: dev, view: view, back: back, id: sh.ID, fd: -1, imported: true, from: from}
	s.insert(a)
	return &simMapping{s: s, base: a.base, size: a.size, dev: dev}, nil
}

// parseSimFileName parses the name of a simulator's memory file.
func parseSimFileName(name string) (pid int, id uint64, ok bool) {
	rest, ok := strings.CutPrefix(name, "goxfer-sim:")
	if !ok {
		return 0, 0, false
	}
	p, i, ok := strings.Cut(rest, ":")
	if !ok {
		return 0, 0, false
	}
	pid, err1 := strconv.Atoi(p)
	id, err2 := strconv.ParseUint(i, 10, 64)
	return pid, id, err1 == nil && err2 == nil
}

// Mappings returns how many imported mappings are open (imported and not
// yet closed): tests use it to check that importers drop their mappings.
func (s *Sim) Mappings() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, a := range s.allocs {
		if a.imported {
			n++
		}
	}
	return n
}

// simMapping is a share mapped by Sim.Import.
type simMapping struct {
	s      *Sim
	base   uintptr
	size   uint64
	dev    int
	closed atomic.Bool
}

func (m *simMapping) Ptr() uintptr { return m.base }
func (m *simMapping) Size() uint64 { return m.size }
func (m *simMapping) Dev() int     { return m.dev }

// Close unmaps the mapping; a second Close does nothing.
func (m *simMapping) Close() error {
	if m.closed.Swap(true) {
		return nil
	}
	s := m.s
	s.mu.Lock()
	i, ok := s.index(m.base)
	if !ok || !s.allocs[i].imported {
		s.mu.Unlock()
		return errors.New("devmem: sim: close of a mapping the simulator no longer has")
	}
	a := s.allocs[i]
	s.allocs = slices.Delete(s.allocs, i, i+1)
	s.mu.Unlock()
	return oneline.Join(unmapMem(a.view), unmapMem(a.back))
}
