package devmem

import (
	"fmt"
	"os"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/goxfer/goxfer/internal/oneline"
)

// Sim is a simulated device driver for machines without a GPU. Its device
// memory is two mappings of the same size: the device pointer the caller
// gets is reserved with no access rights (PROT_NONE), so any code that
// dereferences it crashes; the bytes live in a second mapping that only
// the simulator's copies reach. Pinned host memory is plain anonymous
// memory outside the Go heap.
//
// Sim is a [Sharer]: the bytes of each allocation are a memory file
// (memfd on Linux) that other processes of the same user on the host map
// with [Sim.Import], by handle (through /proc, Linux only) for Alloc's
// memory and by file descriptor for AllocShareable's, as CUDA shares
// cuMemAlloc and VMM memory.
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
	back []byte // the bytes: the memory file mapped shared
	id   uint64 // the allocation's Share.ID
	fd   int    // the memory file, open until Free; -1 for an imported mapping
	vmm  bool   // from AllocShareable: exported by file descriptor only

	imported bool // a mapping of another process's allocation (Sim.Import)
	from     int  // the exporting process of an imported mapping, -1 if unknown
}

// Event is one interval in a [Sim]'s record: a copy the simulator ran, or
// an interval marked with [Sim.Mark]. Times are offsets from the
// simulator's creation.
type Event struct {
	Kind       string // "to-host", "to-device", "device-to-device", or the kind given to Mark
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

// Alloc reserves n bytes of simulated device memory on GPU dev. Other
// processes can map it by [ShareHandle] ([Sim.Export]), as CUDA's legacy
// IPC maps cuMemAlloc memory.
func (s *Sim) Alloc(dev int, n int) (uintptr, error) {
	return s.alloc(dev, n, false)
}

// AllocShareable reserves n bytes of simulated device memory on GPU dev
// that, like CUDA's VMM memory made shareable by file descriptor, is
// exported only by [ShareFD]. Free frees it.
func (s *Sim) AllocShareable(dev int, n int) (uintptr, error) {
	return s.alloc(dev, n, true)
}

// simIDs numbers the simulator's allocations in this process, across
// simulators, so that an ID is never reused: a memory file's name carries
// it, and an importer checks the name against the share's ID.
var simIDs atomic.Uint64

// simFileName names the memory file of allocation id of process pid, as
// an importer finds it in /proc.
func simFileName(pid int, id uint64) string {
	return fmt.Sprintf("goxfer-sim:%d:%d", pid, id)
}

func (s *Sim) alloc(dev int, n int, vmm bool) (uintptr, error) {
	if err := s.checkDev(dev); err != nil {
		return 0, err
	}
	if n <= 0 {
		return 0, fmt.Errorf("devmem: sim: allocation of %d bytes", n)
	}
	size := (n + pageSize() - 1) &^ (pageSize() - 1)
	id := simIDs.Add(1)
	fd, err := simMemCreate(simFileName(os.Getpid(), id), size)
	if err != nil {
		return 0, fmt.Errorf("devmem: sim: create a memory file of %d bytes: %w", size, err)
	}
	view, err := mapMem(size, false)
	if err != nil {
		_ = simCloseFD(fd)
		return 0, fmt.Errorf("devmem: sim: reserve %d bytes: %w", size, err)
	}
	back, err := simMapShared(fd, size)
	if err != nil {
		_ = unmapMem(view)
		_ = simCloseFD(fd)
		return 0, fmt.Errorf("devmem: sim: map %d bytes: %w", size, err)
	}
	a := simAlloc{base: uintptr(unsafe.Pointer(&view[0])), size: uint64(n), dev: dev, view: view, back: back, id: id, fd: fd, vmm: vmm}
	s.insert(a)
	return a.base, nil
}

// insert adds a to the allocation table.
func (s *Sim) insert(a simAlloc) {
	s.mu.Lock()
	i := sort.Search(len(s.allocs), func(i int) bool { return s.allocs[i].base > a.base })
	s.allocs = slices.Insert(s.allocs, i, a)
	s.mu.Unlock()
}

// index returns the index of the allocation starting at ptr. The caller
// holds s.mu.
func (s *Sim) index(ptr uintptr) (int, bool) {
	return slices.BinarySearchFunc(s.allocs, ptr, func(a simAlloc, p uintptr) int {
		switch {
		case a.base < p:
			return -1
		case a.base > p:
			return 1
		}
		return 0
	})
}

// Free releases memory from Alloc or AllocShareable. Copies still queued
// on it must have been synced, as with CUDA. Processes that imported it
// keep their mappings, and the memory, until they close them. Free
// refuses an imported mapping: [Mapping.Close] unmaps it.
func (s *Sim) Free(ptr uintptr) error {
	s.mu.Lock()
	i, ok := s.index(ptr)
	if !ok {
		s.mu.Unlock()
		return fmt.Errorf("%w: sim: free of 0x%x, which Alloc did not return", ErrNotDevice, ptr)
	}
	a := s.allocs[i]
	if a.imported {
		s.mu.Unlock()
		return fmt.Errorf("%w: sim: free of 0x%x, a mapping imported from %s; Close the Mapping", ErrNotDevice, ptr, simProcess(a.from))
	}
	s.allocs = slices.Delete(s.allocs, i, i+1)
	s.mu.Unlock()
	return oneline.Join(unmapMem(a.view), unmapMem(a.back), simCloseFD(a.fd))
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
	kind     string // the Event's
	dst, src []byte // host memory, or the simulator's view of device bytes
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
	copy(op.dst, op.src)
	n := uint64(len(op.src))
	if rate > 0 {
		want := start + time.Duration(float64(n)/rate*float64(time.Second))
		if d := want - time.Since(s.epoch); d > 0 {
			time.Sleep(d)
		}
	}
	s.note(Event{Kind: op.kind, Dev: st.dev, Bytes: n, Start: start, End: time.Since(s.epoch)})
}

// device returns the simulator's own bytes of [ptr, ptr+n) and the GPU
// they belong to.
func (st *simStream) device(ptr uintptr, n int) ([]byte, int, error) {
	s := st.s
	s.mu.Lock()
	a, err := s.find(ptr, uint64(n))
	s.mu.Unlock()
	if err != nil {
		return nil, 0, err
	}
	off := uint64(ptr - a.base)
	return a.back[off : off+uint64(n) : off+uint64(n)], a.dev, nil
}

// check returns the bytes of [ptr, ptr+n), which must be memory of the
// stream's GPU.
func (st *simStream) check(ptr uintptr, n int) ([]byte, error) {
	b, dev, err := st.device(ptr, n)
	if err != nil {
		return nil, err
	}
	if dev != st.dev {
		return nil, fmt.Errorf("devmem: sim: copy on a stream of GPU %d: %w: 0x%x is memory of GPU %d, not of GPU %d", st.dev, ErrNotDevice, ptr, dev, st.dev)
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
	return st.enqueue(simOp{kind: "to-host", dst: dst, src: d})
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
	return st.enqueue(simOp{kind: "to-device", dst: d, src: src})
}

// Copy enqueues a copy of n bytes of device memory from src to dst. One
// of the two must be memory of the stream's GPU; the other may be on any
// simulated GPU (a peer copy), and either may be an imported mapping.
func (st *simStream) Copy(dst, src uintptr, n int) error {
	if n < 0 {
		return fmt.Errorf("devmem: sim: copy of %d bytes", n)
	}
	if n == 0 {
		return nil
	}
	d, ddev, err := st.device(dst, n)
	if err != nil {
		return fmt.Errorf("devmem: sim: device-to-device copy, destination: %w", err)
	}
	sb, sdev, err := st.device(src, n)
	if err != nil {
		return fmt.Errorf("devmem: sim: device-to-device copy, source: %w", err)
	}
	if ddev != st.dev && sdev != st.dev {
		return fmt.Errorf("devmem: sim: copy on a stream of GPU %d: %w: neither end is its memory (0x%x of GPU %d from 0x%x of GPU %d)", st.dev, ErrNotDevice, dst, ddev, src, sdev)
	}
	return st.enqueue(simOp{kind: "device-to-device", dst: d, src: sb})
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
