package devmem

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"
	"unsafe"
)

// Sim is a simulated device driver for machines without a GPU. Its device
// memory is two mappings of the same size: the device pointer the caller
// gets is reserved with no access rights (PROT_NONE), so any code that
// dereferences it crashes; the bytes live in a second mapping that only
// the simulator's copies reach. Pinned host memory is plain anonymous
// memory outside the Go heap.
//
// Copies on a stream run in order on a goroutine of the stream's, at the
// rate set by [Sim.SetRate] (unlimited by default). With [Sim.Record] on,
// the simulator keeps a record of when each copy ran, and of the intervals
// other code marks with [Sim.Mark], so tests can check what overlapped.
// Safe for concurrent use.
type Sim struct {
	devices int
	epoch   time.Time

	mu     sync.Mutex
	allocs []simAlloc // sorted by base
	hosts  map[uintptr]int
	rate   float64 // bytes per second; 0: unlimited
	record bool
	events []Event
}

type simAlloc struct {
	base uintptr
	size uint64
	dev  int
	view []byte // PROT_NONE: the address handed out
	back []byte // the bytes
}

// Event is one interval in a [Sim]'s record: a copy the simulator ran, or
// an interval marked with [Sim.Mark]. Times are offsets from the
// simulator's creation.
type Event struct {
	Kind       string // "to-host", "to-device", or the kind given to Mark
	Dev        int    // the GPU of a copy; -1 for a mark
	Bytes      uint64
	Start, End time.Duration
}

// NewSim returns a simulator with devices GPUs, numbered from 0.
func NewSim(devices int) *Sim {
	return &Sim{devices: devices, epoch: time.Now(), hosts: make(map[uintptr]int)}
}

// Name returns "sim".
func (s *Sim) Name() string { return "sim" }

// Devices returns the number of simulated GPUs.
func (s *Sim) Devices() (int, error) { return s.devices, nil }

// SetRate limits every copy to bytesPerSecond (0: unlimited), as a slow
// GPU link would: tests use it to make overlap visible.
func (s *Sim) SetRate(bytesPerSecond float64) {
	s.mu.Lock()
	s.rate = bytesPerSecond
	s.mu.Unlock()
}

// Record turns the record of copies and marks on or off; turning it on
// clears it.
func (s *Sim) Record(on bool) {
	s.mu.Lock()
	s.record, s.events = on, nil
	s.mu.Unlock()
}

// Events returns a copy of the record, in the order the intervals ended.
func (s *Sim) Events() []Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.events)
}

// Mark starts an interval of the given kind in the record (when recording)
// and returns the function that ends it.
func (s *Sim) Mark(kind string, bytes uint64) (end func()) {
	start := time.Since(s.epoch)
	return func() { s.note(Event{Kind: kind, Dev: -1, Bytes: bytes, Start: start, End: time.Since(s.epoch)}) }
}

func (s *Sim) note(e Event) {
	s.mu.Lock()
	if s.record {
		s.events = append(s.events, e)
	}
	s.mu.Unlock()
}

func (s *Sim) checkDev(dev int) error {
	if dev < 0 || dev >= s.devices {
		return fmt.Errorf("%w: GPU %d does not exist (the simulator has %d)", ErrNotDevice, dev, s.devices)
	}
	return nil
}

// Alloc reserves n bytes of simulated device memory on GPU dev.
func (s *Sim) Alloc(dev int, n int) (uintptr, error) {
	if err := s.checkDev(dev); err != nil {
		return 0, err
	}
	if n <= 0 {
		return 0, fmt.Errorf("devmem: sim: allocation of %d bytes", n)
	}
	size := (n + pageSize() - 1) &^ (pageSize() - 1)
	view, err := mapMem(size, false)
	if err != nil {
		return 0, fmt.Errorf("devmem: sim: reserve %d bytes: %w", size, err)
	}
	back, err := mapMem(size, true)
	if err != nil {
		_ = unmapMem(view)
		return 0, fmt.Errorf("devmem: sim: map %d bytes: %w", size, err)
	}
	a := simAlloc{base: uintptr(unsafe.Pointer(&view[0])), size: uint64(n), dev: dev, view: view, back: back}
	s.mu.Lock()
	i := sort.Search(len(s.allocs), func(i int) bool { return s.allocs[i].base > a.base })
	s.allocs = slices.Insert(s.allocs, i, a)
	s.mu.Unlock()
	return a.base, nil
}

// Free releases memory from Alloc. Copies still queued on it must have
// been synced, as with CUDA.
func (s *Sim) Free(ptr uintptr) error {
	s.mu.Lock()
	i, ok := slices.BinarySearchFunc(s.allocs, ptr, func(a simAlloc, p uintptr) int {
		switch {
		case a.base < p:
			return -1
		case a.base > p:
			return 1
		}
		return 0
	})
	if !ok {
		s.mu.Unlock()
		return fmt.Errorf("%w: sim: free of 0x%x, which Alloc did not return", ErrNotDevice, ptr)
	}
	a := s.allocs[i]
	s.allocs = slices.Delete(s.allocs, i, i+1)
	s.mu.Unlock()
	return errors.Join(unmapMem(a.view), unmapMem(a.back))
}

// find returns the allocation holding [ptr, ptr+n). The caller holds s.mu.
func (s *Sim) find(ptr uintptr, n uint64) (simAlloc, error) {
	i := sort.Search(len(s.allocs), func(i int) bool { return s.allocs[i].base > ptr }) - 1
	if i < 0 || ptr >= s.allocs[i].base+uintptr(s.allocs[i].size) {
		return simAlloc{}, fmt.Errorf("%w: 0x%x is not memory of any simulated GPU", ErrNotDevice, ptr)
	}
	a := s.allocs[i]
	if off := uint64(ptr - a.base); n > a.size-off {
		return simAlloc{}, fmt.Errorf("%w: [0x%x, +%d) runs past the end of its allocation [0x%x, +%d)", ErrNotDevice, ptr, n, a.base, a.size)
	}
	return a, nil
}

// Check verifies that [ptr, ptr+n) lies in one allocation of GPU dev.
func (s *Sim) Check(ptr uintptr, n uint64, dev int) error {
	s.mu.Lock()
	a, err := s.find(ptr, n)
	s.mu.Unlock()
	if err != nil {
		return err
	}
	if a.dev != dev {
		return fmt.Errorf("%w: 0x%x is memory of GPU %d, not of GPU %d", ErrNotDevice, ptr, a.dev, dev)
	}
	return nil
}

// bytes returns the simulator's own view of [ptr, ptr+n).
func (s *Sim) bytes(ptr uintptr, n uint64) ([]byte, error) {
	s.mu.Lock()
	a, err := s.find(ptr, n)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	off := uint64(ptr - a.base)
	return a.back[off : off+n : off+n], nil
}

// HostAlloc maps n bytes of anonymous memory outside the Go heap.
func (s *Sim) HostAlloc(n int) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("devmem: sim: host allocation of %d bytes", n)
	}
	b, err := mapMem(n, true)
	if err != nil {
		return nil, fmt.Errorf("devmem: sim: map %d bytes of host memory: %w", n, err)
	}
	s.mu.Lock()
	s.hosts[uintptr(unsafe.Pointer(&b[0]))] = n
	s.mu.Unlock()
	return b, nil
}

// HostFree unmaps memory from HostAlloc.
func (s *Sim) HostFree(b []byte) error {
	if len(b) == 0 {
		return fmt.Errorf("devmem: sim: free of empty host memory")
	}
	p := uintptr(unsafe.Pointer(&b[0]))
	s.mu.Lock()
	n, ok := s.hosts[p]
	delete(s.hosts, p)
	s.mu.Unlock()
	if !ok {
		return fmt.Errorf("devmem: sim: free of host memory at 0x%x, which HostAlloc did not return", p)
	}
	return unmapMem(unsafe.Slice(&b[0], n))
}

// NewStream returns a stream on GPU dev. Its copies run on a goroutine
// that exists only while copies are queued.
func (s *Sim) NewStream(dev int) (Stream, error) {
	if err := s.checkDev(dev); err != nil {
		return nil, err
	}
	st := &simStream{s: s, dev: dev}
	st.idle.L = &st.mu
	return st, nil
}

type simOp struct {
	toHost bool
	host   []byte
	dev    []byte // the simulator's view of the device bytes
}

type simStream struct {
	s   *Sim
	dev int

	mu      sync.Mutex
	idle    sync.Cond // signalled when the queue drains
	queue   []simOp
	running bool
	err     error
	closed  bool
}

func (st *simStream) enqueue(op simOp) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.closed {
		return fmt.Errorf("devmem: sim: stream used after Close")
	}
	st.queue = append(st.queue, op)
	if !st.running {
		st.running = true
		go st.run()
	}
	return nil
}

func (st *simStream) run() {
	st.mu.Lock()
	for len(st.queue) > 0 {
		op := st.queue[0]
		st.queue[0] = simOp{}
		st.queue = st.queue[1:]
		st.mu.Unlock()
		st.copy(op)
		st.mu.Lock()
	}
	st.queue = nil
	st.running = false
	st.idle.Broadcast()
	st.mu.Unlock()
}

func (st *simStream) copy(op simOp) {
	s := st.s
	start := time.Since(s.epoch)
	s.mu.Lock()
	rate := s.rate
	s.mu.Unlock()
	kind := "to-device"
	if op.toHost {
		kind = "to-host"
		copy(op.host, op.dev)
	} else {
		copy(op.dev, op.host)
	}
	n := uint64(len(op.host))
	if rate > 0 {
		want := start + time.Duration(float64(n)/rate*float64(time.Second))
		if d := want - time.Since(s.epoch); d > 0 {
			time.Sleep(d)
		}
	}
	s.note(Event{Kind: kind, Dev: st.dev, Bytes: n, Start: start, End: time.Since(s.epoch)})
}

func (st *simStream) check(ptr uintptr, n int) ([]byte, error) {
	b, err := st.s.bytes(ptr, uint64(n))
	if err != nil {
		return nil, err
	}
	if err := st.s.Check(ptr, uint64(n), st.dev); err != nil {
		return nil, fmt.Errorf("devmem: sim: copy on a stream of GPU %d: %w", st.dev, err)
	}
	return b, nil
}

// ToHost enqueues a copy from device memory at src into dst.
func (st *simStream) ToHost(dst []byte, src uintptr) error {
	if len(dst) == 0 {
		return nil
	}
	d, err := st.check(src, len(dst))
	if err != nil {
		return err
	}
	return st.enqueue(simOp{toHost: true, host: dst, dev: d})
}

// ToDevice enqueues a copy of src into device memory at dst.
func (st *simStream) ToDevice(dst uintptr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	d, err := st.check(dst, len(src))
	if err != nil {
		return err
	}
	return st.enqueue(simOp{host: src, dev: d})
}

// Sync waits for the queue to drain.
func (st *simStream) Sync() error {
	st.mu.Lock()
	defer st.mu.Unlock()
	for st.running {
		st.idle.Wait()
	}
	err := st.err
	st.err = nil
	return err
}

// Close waits for the queue and refuses further copies.
func (st *simStream) Close() error {
	err := st.Sync()
	st.mu.Lock()
	st.closed = true
	st.mu.Unlock()
	return err
}
