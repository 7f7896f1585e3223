package main

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/agent/shm"
	"github.com/goxfer/goxfer/connect"
)

// GPU memory: where a side's buffers live (-initiator-mem, -target-mem), the
// buffers themselves, and a meter on the device driver the connectors copy
// through (staging, or cma's same-host device path), so that a row can
// report how fast its device copies ran.

// memKind is where one side's buffers live, as nixlbench's segment types:
// host memory on the Go heap (dram), the memory of a GPU (vram), or host
// memory in shared-memory segments that same-host peers map (shm,
// agent/shm: what connect.Connector.AllocHost returns).
type memKind uint8

const (
	memDRAM memKind = iota
	memVRAM
	memSHM
)

// String is the kind as the flags, results and the protocol spell it.
func (k memKind) String() string {
	switch k {
	case memVRAM:
		return "vram"
	case memSHM:
		return "shm"
	}
	return "dram"
}

func parseMem(s string) (memKind, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "dram", "":
		return memDRAM, nil
	case "vram":
		return memVRAM, nil
	case "shm":
		return memSHM, nil
	}
	return 0, fmt.Errorf("unknown memory %q: want dram, vram or shm", s)
}

// MarshalText keeps the protocol's "mem" a word, so that a target of
// another build that does not know it fails instead of measuring DRAM.
func (k memKind) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

func (k *memKind) UnmarshalText(b []byte) error {
	v, err := parseMem(string(b))
	if err != nil {
		return err
	}
	*k = v
	return nil
}

// mems are the memory kinds of a point: the initiator's local buffers and
// the target's exposed buffers.
type mems struct{ init, target memKind }

func (m mems) vram() bool { return m.init == memVRAM || m.target == memVRAM }

// shm reports whether either side's buffers are shared host memory.
func (m mems) shm() bool { return m.init == memSHM || m.target == memSHM }

// String is "dram/vram": initiator, then target.
func (m mems) String() string { return m.init.String() + "/" + m.target.String() }

var dramOnly = mems{memDRAM, memDRAM}

// deviceDriver returns the process's device driver ([devmem.Default]), or
// nil when there is none (the CUDA driver is loaded lazily: a driver
// returned here may still fail at its first call).
func deviceDriver() devmem.Driver {
	d, err := devmem.Default()
	if err != nil {
		return nil
	}
	return d
}

// gpuDriver returns the process's device driver, checked to see GPU gpu,
// or an error saying what is missing.
func gpuDriver(gpu int) (devmem.Driver, error) {
	d, err := devmem.Default()
	if err == nil && d == nil {
		err = devmem.ErrUnavailable
	}
	if err != nil {
		return nil, fmt.Errorf("GPU memory needs a device driver: %w (on a machine without a GPU, set %s=sim to run with a simulated one)", err, devmem.EnvDevice)
	}
	n, err := d.Devices()
	if err != nil {
		return nil, fmt.Errorf("GPU memory needs a device driver: the %s driver: %w (on a machine without a GPU, set %s=sim to run with a simulated one)", d.Name(), err, devmem.EnvDevice)
	}
	if gpu >= n {
		return nil, fmt.Errorf("-gpu %d: the %s driver sees %d GPU(s), numbered from 0", gpu, d.Name(), n)
	}
	return d, nil
}

// region is one buffer of a point: host memory (the Go heap's, a
// backend's allocator's or a shared segment's), or device memory reached
// only through the driver's copies. Used by one goroutine at a time.
type region struct {
	kind memKind
	size int
	host []byte  // dram, shm: the memory
	ptr  uintptr // vram: the device pointer
	gpu  int
	// drv copies the pattern in and out of device memory: the bare
	// driver, never the meter, so that filling and checking do not count
	// as staging.
	drv     devmem.Driver
	scratch []byte // vram: host bytes for fill and verify, made at first use
	free    func() error
}

// scratchMax bounds the host memory a device region fills and verifies
// through: the pattern goes in and out in pieces of this size.
const scratchMax = 4 << 20

// newRegion allocates size bytes of kind: device memory on gpu through
// drv, a shared-memory segment (shm.Alloc, freed by release, which fails
// while an exposure of it is open), or host memory from alloc (a
// backend's allocator), or the Go heap.
func newRegion(kind memKind, drv devmem.Driver, gpu, size int, alloc func(int) ([]byte, func() error, error)) (*region, error) {
	r := &region{kind: kind, size: size, gpu: gpu, drv: drv}
	switch {
	case kind == memVRAM:
		if drv == nil {
			return nil, fmt.Errorf("GPU memory of %d bytes: no device driver", size)
		}
		p, err := drv.Alloc(gpu, size)
		if err != nil {
			return nil, fmt.Errorf("allocate %s on GPU %d (%s driver): %w", fmtSize(float64(size)), gpu, drv.Name(), err)
		}
		r.ptr, r.free = p, func() error { return drv.Free(p) }
	case kind == memSHM:
		if alloc != nil {
			return nil, errors.New("shared host memory uses no backend's allocator")
		}
		b, err := shm.Alloc(size)
		if err != nil {
			return nil, fmt.Errorf("allocate %s of shared host memory: %w", fmtSize(float64(size)), err)
		}
		r.host, r.free = b.Bytes(), b.Free
	case alloc != nil:
		buf, free, err := alloc(size)
		if err != nil {
			return nil, err
		}
		r.host, r.free = buf, free
	default:
		r.host = make([]byte, size)
	}
	return r, nil
}

// descriptors cuts the region into n descriptors of block bytes.
func (r *region) descriptors(block, n int) []connect.Descriptor {
	if r.kind != memVRAM {
		return descriptors(r.host, block, n)
	}
	ds := make([]connect.Descriptor, n)
	for i := range ds {
		ds[i] = connect.NewDeviceDescriptor(r.ptr+uintptr(i*block), block, connect.CUDA(r.gpu))
	}
	return ds
}

// addr is the host address for process_vm_readv, 0 for device memory.
func (r *region) addr() uint64 {
	if r.kind == memVRAM {
		return 0
	}
	return sliceAddr(r.host)
}

// pieces calls f for each piece of the region of at most scratchMax bytes,
// with the scratch buffer cut to its length (device memory only).
func (r *region) pieces(f func(off int, buf []byte) error) error {
	if r.scratch == nil {
		r.scratch = make([]byte, min(r.size, scratchMax))
	}
	for off := 0; off < r.size; off += len(r.scratch) {
		if err := f(off, r.scratch[:min(len(r.scratch), r.size-off)]); err != nil {
			return err
		}
	}
	return nil
}

// fill writes fill's pattern of seed over the whole region.
func (r *region) fill(seed uint64) error {
	if r.kind != memVRAM {
		fill(r.host, seed)
		return nil
	}
	return r.pieces(func(off int, buf []byte) error {
		fillFrom(buf, seed, off)
		return devmem.CopyToDevice(r.drv, r.gpu, r.ptr+uintptr(off), buf)
	})
}

// poison overwrites the region (and so faults its pages in).
func (r *region) poison() error {
	if r.kind != memVRAM {
		poison(r.host)
		return nil
	}
	first := true
	return r.pieces(func(off int, buf []byte) error {
		if first {
			poison(buf)
			first = false
		}
		return devmem.CopyToDevice(r.drv, r.gpu, r.ptr+uintptr(off), buf)
	})
}

// verify reports the first byte of the region that differs from fill's
// pattern of seed; every byte is checked, device memory through copies.
func (r *region) verify(seed uint64) error {
	if r.kind != memVRAM {
		return verify(r.host, seed)
	}
	return r.pieces(func(off int, buf []byte) error {
		if err := devmem.CopyToHost(r.drv, r.gpu, buf, r.ptr+uintptr(off)); err != nil {
			return err
		}
		return verifyFrom(buf, seed, off)
	})
}

// release frees the region's memory; no operation may use it any more.
func (r *region) release() error {
	if r.free == nil {
		return nil
	}
	err := r.free()
	r.free = nil
	return err
}

// copyStat is what a meter saw of one direction of device copies: bytes,
// the time from the first copy of a batch being enqueued to the stream's
// Sync returning, summed over batches, and the batches.
type copyStat struct {
	Bytes   int64 `json:"bytes"`
	Ns      int64 `json:"ns"`
	Batches int64 `json:"batches"`
}

func (c copyStat) sub(o copyStat) copyStat {
	return copyStat{c.Bytes - o.Bytes, c.Ns - o.Ns, c.Batches - o.Batches}
}

func (c copyStat) add(o copyStat) copyStat {
	return copyStat{c.Bytes + o.Bytes, c.Ns + o.Ns, c.Batches + o.Batches}
}

// gbps is the copy rate in 10^9 bytes per second, 0 if nothing was copied.
func (c copyStat) gbps() float64 {
	if c.Ns <= 0 || c.Bytes <= 0 {
		return 0
	}
	return float64(c.Bytes) / float64(c.Ns)
}

// stageStats is a meter's reading: device to host, host to device, and
// device to device (cma's same-host device path copying between its own
// GPU memory and a mapping of the peer's).
type stageStats struct {
	D2H copyStat `json:"d2h"`
	H2D copyStat `json:"h2d"`
	D2D copyStat `json:"d2d"`
}

func (s stageStats) sub(o stageStats) stageStats {
	return stageStats{s.D2H.sub(o.D2H), s.H2D.sub(o.H2D), s.D2D.sub(o.D2D)}
}
func (s stageStats) add(o stageStats) stageStats {
	return stageStats{s.D2H.add(o.D2H), s.H2D.add(o.H2D), s.D2D.add(o.D2D)}
}

// meter counts the device copies of the connectors whose driver it wraps
// (metered). Safe for concurrent use.
type meter struct {
	mu sync.Mutex
	s  stageStats
}

func (m *meter) read() stageStats {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.s
}

// batch adds one batch of copies (bytes by direction) that took ns from
// its first enqueue to its Sync.
func (m *meter) batch(b stageStats, ns int64) {
	total := b.D2H.Bytes + b.H2D.Bytes + b.D2D.Bytes
	if total == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	// A batch of several directions shares its time by bytes.
	count := func(c copyStat) copyStat {
		if c.Bytes == 0 {
			return copyStat{}
		}
		return copyStat{c.Bytes, int64(float64(ns) * float64(c.Bytes) / float64(total)), 1}
	}
	m.s = m.s.add(stageStats{count(b.D2H), count(b.H2D), count(b.D2D)})
}

// meteredDriver is the driver the connectors get (connect.WithDevice): it
// passes everything to the real driver and times their streams' copies.
// The agent enqueues a chunk's copies and syncs at once, and so does cma's
// device path a window's, so the time from a batch's first enqueue to its
// Sync is the copy time.
type meteredDriver struct {
	devmem.Driver
	m *meter
}

// NewStream returns a metered stream of the real driver's.
func (d meteredDriver) NewStream(dev int) (devmem.Stream, error) {
	s, err := d.Driver.NewStream(dev)
	if err != nil {
		return nil, err
	}
	return &meteredStream{Stream: s, m: d.m}, nil
}

// meteredSharer is meteredDriver over a driver that shares memory across
// processes: cma takes its same-host device path only when the agent's
// driver is a devmem.Sharer, so the meter must not hide it. A value, as
// meteredDriver: cma caches the peer mappings of a process by driver, and
// the connectors of one meter then share them.
type meteredSharer struct {
	meteredDriver
	devmem.Sharer
}

// metered wraps d so that m counts its streams' copies, keeping
// devmem.Sharer when d has it.
func metered(d devmem.Driver, m *meter) devmem.Driver {
	md := meteredDriver{Driver: d, m: m}
	if sh, ok := d.(devmem.Sharer); ok {
		return meteredSharer{meteredDriver: md, Sharer: sh}
	}
	return md
}

// meteredStream counts a stream's copies by direction until its Sync.
type meteredStream struct {
	devmem.Stream
	m     *meter
	start time.Time  // zero: nothing enqueued since the last Sync
	n     stageStats // bytes enqueued since start
}

func (s *meteredStream) begin() {
	if s.start.IsZero() {
		s.start = time.Now()
	}
}

func (s *meteredStream) ToHost(dst []byte, src uintptr) error {
	s.begin()
	err := s.Stream.ToHost(dst, src)
	if err == nil {
		s.n.D2H.Bytes += int64(len(dst))
	}
	return err
}

func (s *meteredStream) ToDevice(dst uintptr, src []byte) error {
	s.begin()
	err := s.Stream.ToDevice(dst, src)
	if err == nil {
		s.n.H2D.Bytes += int64(len(src))
	}
	return err
}

// Copy counts device-to-device copies: cma's same-host device path
// between local GPU memory and a mapping of the peer's.
func (s *meteredStream) Copy(dst, src uintptr, n int) error {
	s.begin()
	err := s.Stream.Copy(dst, src, n)
	if err == nil {
		s.n.D2D.Bytes += int64(n)
	}
	return err
}

func (s *meteredStream) end(err error) error {
	if !s.start.IsZero() {
		if err == nil {
			s.m.batch(s.n, time.Since(s.start).Nanoseconds())
		}
		s.start, s.n = time.Time{}, stageStats{}
	}
	return err
}

func (s *meteredStream) Sync() error { return s.end(s.Stream.Sync()) }

func (s *meteredStream) Close() error { return s.end(s.Stream.Close()) }

// deviceOptions are the connector options of a side: the metered driver
// (when the process has one) and the staging chunk and pool.
func deviceOptions(cfg *config, m *meter) []connect.Option {
	opts := []connect.Option{connect.WithStaging(cfg.stageChunk, cfg.stagePool)}
	if d := deviceDriver(); d != nil {
		opts = append(opts, connect.WithDevice(metered(d, m)))
	}
	return opts
}
