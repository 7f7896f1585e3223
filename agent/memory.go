package agent

import (
	"cmp"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"sync"
	"unsafe"

	"github.com/goxfer/goxfer/internal/oneline"
)

// MemKind is the kind of memory a region lives in.
type MemKind uint8

const (
	// KindDRAM is host memory, reachable by the CPU.
	KindDRAM MemKind = iota
	// KindVRAM is GPU device memory; [Region].Device names the GPU.
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

// String returns a fingerprint of the key for logs and errors, such as
// "sha256:1a2b3c4d": the first 4 bytes of the key's SHA-256 in hex. It
// reveals no byte of the key, and is the fingerprint a redacted
// connect.Metadata shows, so that log lines about one exposure match.
func (k Key) String() string {
	sum := sha256.Sum256(k[:])
	return "sha256:" + hex.EncodeToString(sum[:4])
}

// Registrar is an optional [Backend] interface for backends that must prepare
// memory before it is used (pinning, RDMA registration). The agent calls
// RegisterMem when a region is first registered and DeregisterMem with the
// returned handle when its last reference is released.
type Registrar interface {
	RegisterMem(l Local) (handle any, err error)
	DeregisterMem(handle any) error
}

// regKey names a registered region. It has no padding, so the map hashes
// it as plain memory: registering thousands of blocks is map-bound.
type regKey struct {
	addr, len uint64
	where     uint64 // kind<<32 | device
}

func keyOf(l Local) regKey {
	return regKey{l.Addr, l.Len, uint64(l.Kind)<<32 | uint64(l.Device)}
}

type regEntry struct {
	refs    int
	handles []any // per backend implementing Registrar, in backend order
}

// Registration holds one reference to each of a set of registered regions.
// Release drops them; a region is deregistered from the backends when its
// last reference goes. Registering the same region twice yields two
// references to one entry, so two operations over one buffer never
// deregister each other.
type Registration struct {
	a    *Agent
	keys []regKey
	once sync.Once
}

// Register registers every region of ls with every backend that needs
// registration ([Registrar]) and returns one [Registration] holding a
// reference to each: one call and one lock for a KV hand-off's thousands of
// blocks. Registration is not required: transfers and exposures do not
// check it, and backends prepare unregistered memory per transfer, which
// costs time. The memory must stay alive and in place until the last
// reference is released. On error no reference is left taken. Safe for
// concurrent use.
func (a *Agent) Register(ls ...Local) (*Registration, error) {
	for i, l := range ls {
		if err := l.check(); err != nil {
			return nil, fmt.Errorf("region %d: %w", i, err)
		}
	}
	r := &Registration{a: a, keys: make([]regKey, 0, len(ls))}
	if !a.registrars {
		// Nothing to register with: the registration is its references,
		// counted by Registered, and costs no map entry per region.
		for _, l := range ls {
			r.keys = append(r.keys, keyOf(l))
		}
		a.regMu.Lock()
		defer a.regMu.Unlock()
		if a.isClosed() {
			return nil, ErrClosed
		}
		a.held[r] = struct{}{}
		return r, nil
	}
	a.regMu.Lock()
	defer a.regMu.Unlock()
	if a.isClosed() {
		return nil, ErrClosed
	}
	for i, l := range ls {
		k := keyOf(l)
		e, ok := a.regs[k]
		if !ok {
			var err error
			if e, err = a.registerNew(l); err != nil {
				a.unref(r.keys)
				return nil, fmt.Errorf("region %d: %w", i, err)
			}
		}
		e.refs++
		a.regs[k] = e
		r.keys = append(r.keys, k)
	}
	a.regsPeak = max(a.regsPeak, len(a.regs))
	return r, nil
}

// registerNew registers l with the backends that need it.
func (a *Agent) registerNew(l Local) (regEntry, error) {
	var e regEntry
	for _, b := range a.backends {
		reg, ok := b.(Registrar)
		if !ok {
			continue
		}
		h, err := reg.RegisterMem(l)
		if err != nil {
			_ = a.deregister(e)
			return regEntry{}, fmt.Errorf("register 0x%x+%d with %s: %w", l.Addr, l.Len, b.Name(), err)
		}
		e.handles = append(e.handles, h)
	}
	return e, nil
}

// Release drops the registration's references. It is idempotent.
func (r *Registration) Release() error {
	var err error
	r.once.Do(func() {
		r.a.regMu.Lock()
		defer r.a.regMu.Unlock()
		if !r.a.registrars {
			delete(r.a.held, r)
			return
		}
		err = r.a.unref(r.keys)
	})
	return err
}

// unref drops one reference to each key, deregistering entries that reach
// zero. The caller holds regMu.
func (a *Agent) unref(keys []regKey) error {
	var errs []error
	for _, k := range keys {
		e, ok := a.regs[k]
		if !ok {
			continue
		}
		if e.refs--; e.refs > 0 {
			a.regs[k] = e
			continue
		}
		delete(a.regs, k)
		if err := a.deregister(e); err != nil {
			errs = append(errs, err)
		}
	}
	a.shrinkRegs()
	return oneline.Join(errs...)
}

// shrinkRegs rebuilds the registration map once it holds a quarter of its
// peak: Go maps never give back their tables, so a burst of thousands of
// blocks would otherwise pin its peak size for the agent's life. The copy
// costs at most a quarter of the deletions that led to it.
func (a *Agent) shrinkRegs() {
	const floor = 1 << 14 // smaller maps are not worth a copy: a KV hand-off of 4096 blocks registers and releases them per operation, and a map rebuilt each time regrows each time
	if a.regsPeak < floor || len(a.regs) > a.regsPeak/4 {
		return
	}
	m := make(map[regKey]regEntry, len(a.regs))
	for k, e := range a.regs {
		m[k] = e
	}
	a.regs, a.regsPeak = m, len(m)
}

// Registered reports how many distinct regions are registered and how many
// references they have in all. When no backend needs registration it
// counts them from the live registrations, in time proportional to their
// references: a gauge to read now and then, not per operation.
func (a *Agent) Registered() (regions, refs int) {
	a.regMu.Lock()
	defer a.regMu.Unlock()
	if !a.registrars {
		distinct := make(map[regKey]struct{})
		for r := range a.held {
			refs += len(r.keys)
			for _, k := range r.keys {
				distinct[k] = struct{}{}
			}
		}
		return len(distinct), refs
	}
	for _, e := range a.regs {
		refs += e.refs
	}
	return len(a.regs), refs
}

func (a *Agent) deregister(e regEntry) error {
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
	return oneline.Join(errs...)
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
	byAddr := func(a, b Local) int { return cmp.Compare(a.Addr, b.Addr) }
	if !slices.IsSortedFunc(regs, byAddr) { // blocks from a pool usually come in order
		slices.SortFunc(regs, byAddr)
	}
	maxEnd := make([]uint64, len(regs))
	var m uint64
	for i, r := range regs {
		m = max(m, r.End())
		maxEnd[i] = m
	}
	return regionSet{regs: regs, maxEnd: maxEnd}
}

// find returns the region containing [addr, addr+n), or false.
func (s *regionSet) find(addr, n uint64) (Local, bool) { return s.findFrom(addr, n, nil) }

// findFrom is find for a caller that walks the regions in order, as a
// lease over a KV hand-off's blocks does: *hint, the index of the region
// found last, is tried before the binary search, then the next one, and is
// set to the index found. The answer is find's, whatever the hint.
func (s *regionSet) findFrom(addr, n uint64, hint *int) (Local, bool) {
	end := addr + n
	if n == 0 || end < addr {
		return Local{}, false
	}
	i := -1 // the last region that starts at or before addr
	if hint != nil {
		for _, h := range [2]int{*hint, *hint + 1} {
			if h >= 0 && h < len(s.regs) && s.regs[h].Addr <= addr && (h+1 == len(s.regs) || s.regs[h+1].Addr > addr) {
				i = h
				break
			}
		}
	}
	if i < 0 {
		lo, hi := 0, len(s.regs) // the first region that starts past addr is in [lo, hi]
		for lo < hi {
			m := int(uint(lo+hi) >> 1)
			if s.regs[m].Addr > addr {
				hi = m
			} else {
				lo = m + 1
			}
		}
		i = lo - 1
	}
	for ; i >= 0 && s.maxEnd[i] >= end; i-- {
		if r := s.regs[i]; r.Addr <= addr && end <= r.End() {
			if hint != nil {
				*hint = i
			}
			return r, true
		}
	}
	return Local{}, false
}
