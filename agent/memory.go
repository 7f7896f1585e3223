package agent

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sort"
	"sync"
	"unsafe"
)

// MemKind is the kind of memory a region lives in.
type MemKind uint8

const (
	// KindDRAM is host memory, reachable by the CPU.
	KindDRAM MemKind = iota
	// KindVRAM is GPU device memory; Region.Device names the GPU.
	KindVRAM
)

// String returns "DRAM" or "VRAM".
func (k MemKind) String() string {
	switch k {
	case KindDRAM:
		return "DRAM"
	case KindVRAM:
		return "VRAM"
	}
	return fmt.Sprintf("MemKind(%d)", uint8(k))
}

// Region is a span of memory: its address in its owner's address space, its
// length, its kind and device. Regions travel between agents; they carry no
// access rights of their own.
type Region struct {
	Addr   uint64
	Len    uint64
	Kind   MemKind
	Device uint32
}

// End returns the first address past the region.
func (r Region) End() uint64 { return r.Addr + r.Len }

// Local is memory of this process: a Region and, for DRAM, the bytes it
// spans. The agent never copies Mem; the caller keeps it alive and unchanged
// in place while any registration, exposure or transfer uses it.
type Local struct {
	Region
	Mem []byte // the region's bytes; nil for VRAM
}

// DRAM describes host memory held in buf as a Local. buf must not be empty.
func DRAM(buf []byte) Local {
	return Local{Region: Region{Addr: addrOf(buf), Len: uint64(len(buf)), Kind: KindDRAM}, Mem: buf}
}

// Device describes raw memory at addr (for example a CUDA device pointer)
// as a Local with no Go-visible bytes.
func Device(addr uintptr, size int, kind MemKind, device uint32) Local {
	return Local{Region: Region{Addr: uint64(addr), Len: uint64(size), Kind: kind, Device: device}}
}

func addrOf(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
}

func (l Local) check() error {
	if l.Len == 0 {
		return fmt.Errorf("%w: empty region at 0x%x", ErrInvalid, l.Addr)
	}
	if l.Kind == KindDRAM {
		if uint64(len(l.Mem)) != l.Len || addrOf(l.Mem) != l.Addr {
			return fmt.Errorf("%w: DRAM region 0x%x+%d does not match its %d bytes of memory", ErrInvalid, l.Addr, l.Len, len(l.Mem))
		}
	}
	return nil
}

// Key is a 128-bit capability naming one exposure. Keys come from
// crypto/rand; whoever holds one may access the exposure's regions in the
// exposure's access kind until it is revoked.
type Key [16]byte

// NewKey returns a fresh random key.
func NewKey() Key {
	var k Key
	if _, err := rand.Read(k[:]); err != nil {
		panic("goxfer: crypto/rand failed: " + err.Error()) // rand.Read never fails on Linux
	}
	return k
}

// String returns a short, non-secret fingerprint of the key for logs: the
// first four bytes in hex. The full key is never printed.
func (k Key) String() string { return hex.EncodeToString(k[:4]) + "…" }

// Registrar is an optional Backend interface for backends that must prepare
// memory before it is used (pinning, RDMA registration). The agent calls
// RegisterMem when a region is first registered and DeregisterMem with the
// returned handle when its last reference is released.
type Registrar interface {
	RegisterMem(l Local) (handle any, err error)
	DeregisterMem(handle any) error
}

type regKey struct {
	addr, len uint64
	kind      MemKind
	dev       uint32
}

type regEntry struct {
	refs    int
	handles []any // per backend implementing Registrar, in backend order
}

// Registration is one reference to registered memory. Release drops it; the
// memory is deregistered from the backends when its last reference goes.
// Registering the same region twice yields two references to one entry, so
// two operations over one buffer never deregister each other.
type Registration struct {
	a    *Agent
	key  regKey
	once sync.Once
}

// Register registers l with every backend that needs registration and
// returns a reference to it. Safe for concurrent use.
func (a *Agent) Register(l Local) (*Registration, error) {
	if err := l.check(); err != nil {
		return nil, err
	}
	k := regKey{l.Addr, l.Len, l.Kind, l.Device}
	a.regMu.Lock()
	defer a.regMu.Unlock()
	if a.isClosed() {
		return nil, ErrClosed
	}
	if e, ok := a.regs[k]; ok {
		e.refs++
		return &Registration{a: a, key: k}, nil
	}
	e := &regEntry{refs: 1}
	for _, b := range a.backends {
		r, ok := b.(Registrar)
		if !ok {
			continue
		}
		h, err := r.RegisterMem(l)
		if err != nil {
			a.deregister(e)
			return nil, fmt.Errorf("register 0x%x+%d with %s: %w", l.Addr, l.Len, b.Name(), err)
		}
		e.handles = append(e.handles, h)
	}
	a.regs[k] = e
	return &Registration{a: a, key: k}, nil
}

// Release drops this reference. It is idempotent.
func (r *Registration) Release() error {
	var err error
	r.once.Do(func() {
		a := r.a
		a.regMu.Lock()
		defer a.regMu.Unlock()
		e := a.regs[r.key]
		if e == nil {
			return
		}
		if e.refs--; e.refs == 0 {
			delete(a.regs, r.key)
			err = a.deregister(e)
		}
	})
	return err
}

// Registered reports how many distinct regions are registered and how many
// references they have in all.
func (a *Agent) Registered() (regions, refs int) {
	a.regMu.Lock()
	defer a.regMu.Unlock()
	for _, e := range a.regs {
		refs += e.refs
	}
	return len(a.regs), refs
}

func (a *Agent) deregister(e *regEntry) error {
	var errs []error
	i := 0
	for _, b := range a.backends {
		r, ok := b.(Registrar)
		if !ok || i >= len(e.handles) {
			continue
		}
		if err := r.DeregisterMem(e.handles[i]); err != nil {
			errs = append(errs, err)
		}
		i++
	}
	return joinErrs(errs)
}

// regionSet answers "which exposed region holds [addr, addr+n)" quickly for
// thousands of regions: regions sorted by address, with the running maximum
// end so overlapping regions are still found.
type regionSet struct {
	regs   []Local
	maxEnd []uint64
}

func newRegionSet(ls []Local) regionSet {
	regs := append([]Local(nil), ls...)
	sort.Slice(regs, func(i, j int) bool { return regs[i].Addr < regs[j].Addr })
	maxEnd := make([]uint64, len(regs))
	var m uint64
	for i, r := range regs {
		m = max(m, r.End())
		maxEnd[i] = m
	}
	return regionSet{regs: regs, maxEnd: maxEnd}
}

// find returns the region containing [addr, addr+n), or false.
func (s *regionSet) find(addr, n uint64) (Local, bool) {
	end := addr + n
	if n == 0 || end < addr {
		return Local{}, false
	}
	i := sort.Search(len(s.regs), func(i int) bool { return s.regs[i].Addr > addr }) - 1
	for ; i >= 0 && s.maxEnd[i] >= end; i-- {
		if r := s.regs[i]; r.Addr <= addr && end <= r.End() {
			return r, true
		}
	}
	return Local{}, false
}
