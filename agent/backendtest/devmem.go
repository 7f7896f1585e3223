package backendtest

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/internal/pattern"
)

// Device memory in the suite. Every agent of the device cases has its own
// simulated GPUs (devmem.Sim): its device pointers mean nothing to another
// agent's driver, as across processes, and the simulator's memory is not
// addressable by ordinary code, so a path that dereferences a device
// pointer crashes the test instead of passing by accident.
const (
	// activeGPU holds the device memory of the side that posts a
	// transfer, passiveGPU that of the side that exposes: a GPU ordinal
	// other than 0 must travel intact.
	activeGPU  = 1
	passiveGPU = 0
	// devChunk and devPool are the staging of the suite's agents
	// (agent.WithStaging): small chunks, so that a MiB is a pipeline of
	// many chunks, and a pool whose half for peers' leases holds the
	// largest span a backend leases at once.
	devChunk = 64 << 10
	devPool  = 64 << 20
	// devEdge guard bytes lie before the first descriptor and after the
	// last, in host and in device memory; between descriptors lie
	// pattern.GuardLen bytes of pattern.GuardByte, as in a pattern.Slab.
	devEdge = 4096 + 2
	// edgeSeed is the pattern of the edge guards.
	edgeSeed = 0x6a09e667f3bcc908
)

// stagingEnv passes the parent's staging options to a child process
// ("chunk,pool"), so that its pipelines have as many chunks.
const stagingEnv = "GOXFER_BACKENDTEST_STAGING"

// childStaging returns the staging options a child process was given.
func childStaging() ([]agent.Option, error) {
	v := os.Getenv(stagingEnv)
	if v == "" {
		return nil, nil
	}
	c, p, ok := strings.Cut(v, ",")
	chunk, err1 := strconv.Atoi(c)
	pool, err2 := strconv.Atoi(p)
	if !ok || err1 != nil || err2 != nil {
		return nil, fmt.Errorf("%s=%q: want \"chunk,pool\" in bytes", stagingEnv, v)
	}
	return []agent.Option{agent.WithStaging(chunk, pool)}, nil
}

// devSide is one side's memory in the device cases: descriptors of the
// given sizes, each in device memory or in host memory. Host and device
// memory have the same layout (edge guard, then each descriptor between
// guard bytes, then edge guard), and the copy of a descriptor that does not
// live in one of them is guard bytes there: every byte of both is known, so
// a stray write anywhere shows. The first descriptor starts at an odd
// offset of the device allocation.
type devSide struct {
	drv    devmem.Driver
	gpu    int
	sizes  []int
	onDev  []bool
	offs   []int
	host   []byte
	dev    uintptr // the device allocation, len(host) bytes; 0 if nothing lives there
	locals []agent.Local
}

// newDevSide lays out descriptors of sizes, descriptor i in device memory
// of GPU gpu if onDev(i), and fills them with pattern 0 (zeros).
func newDevSide(drv devmem.Driver, gpu int, sizes []int, onDev func(int) bool) (*devSide, error) {
	s := &devSide{drv: drv, gpu: gpu, sizes: sizes, onDev: make([]bool, len(sizes)), offs: make([]int, len(sizes))}
	off := devEdge
	some := false
	for i, n := range sizes {
		off += pattern.GuardLen
		s.offs[i] = off
		off += n
		s.onDev[i] = onDev(i)
		some = some || s.onDev[i]
	}
	off += pattern.GuardLen + devEdge
	s.host = make([]byte, off)
	if some {
		p, err := drv.Alloc(gpu, off)
		if err != nil {
			return nil, fmt.Errorf("device memory of %d bytes on GPU %d: %w", off, gpu, err)
		}
		s.dev = p
	}
	for i, n := range sizes {
		if s.onDev[i] {
			s.locals = append(s.locals, agent.Device(s.dev+uintptr(s.offs[i]), n, agent.KindVRAM, uint32(gpu)))
		} else {
			s.locals = append(s.locals, agent.DRAM(s.host[s.offs[i]:s.offs[i]+n:s.offs[i]+n]))
		}
	}
	if err := s.Fill(0); err != nil {
		_ = s.free()
		return nil, err
	}
	return s, nil
}

// devMask returns which of n descriptors onDev puts in device memory, for
// a child process.
func devMask(n int, onDev func(int) bool) []bool {
	m := make([]bool, n)
	for i := range m {
		m[i] = onDev(i)
	}
	return m
}

// onDevice reports whether any descriptor lives in device memory.
func (s *devSide) onDevice() bool { return s.dev != 0 }

// image is what host (device false) or device memory holds once filled
// with pattern seed.
func (s *devSide) image(seed uint64, device bool) []byte {
	img := make([]byte, len(s.host))
	for i := range img {
		img[i] = pattern.GuardByte
	}
	pattern.Fill(img[:devEdge], edgeSeed, -1, 0)
	pattern.Fill(img[len(img)-devEdge:], edgeSeed, -2, 0)
	for i, n := range s.sizes {
		if s.onDev[i] == device {
			pattern.Fill(img[s.offs[i]:s.offs[i]+n], seed, i, 0)
		}
	}
	return img
}

// Fill writes pattern seed into every descriptor, wherever it lives, and
// resets every guard byte.
func (s *devSide) Fill(seed uint64) error {
	copy(s.host, s.image(seed, false))
	if s.dev == 0 {
		return nil
	}
	if err := devmem.CopyToDevice(s.drv, s.gpu, s.dev, s.image(seed, true)); err != nil {
		return fmt.Errorf("fill device memory: %w", err)
	}
	return nil
}

// Check reports the first byte of host or device memory that differs from
// what Fill(seed) wrote: a descriptor's byte, or a guard's.
func (s *devSide) Check(seed uint64) error {
	if err := s.compare("host", s.host, s.image(seed, false)); err != nil {
		return err
	}
	if s.dev == 0 {
		return nil
	}
	got := make([]byte, len(s.host))
	if err := devmem.CopyToHost(s.drv, s.gpu, got, s.dev); err != nil {
		return fmt.Errorf("read device memory back: %w", err)
	}
	return s.compare(fmt.Sprintf("device (GPU %d)", s.gpu), got, s.image(seed, true))
}

func (s *devSide) compare(where string, got, want []byte) error {
	if bytes.Equal(got, want) {
		return nil
	}
	first, n := -1, 0
	for i := range got {
		if got[i] != want[i] {
			if first < 0 {
				first = i
			}
			n++
		}
	}
	return fmt.Errorf("%s memory: %d bytes differ, the first %s: got 0x%02x, want 0x%02x", where, n, s.locate(first), got[first], want[first])
}

// locate names what lies at offset off of the layout.
func (s *devSide) locate(off int) string {
	for i, o := range s.offs {
		kind := "host"
		if s.onDev[i] {
			kind = "device"
		}
		switch {
		case off < o:
			if i == 0 && off < devEdge {
				return fmt.Sprintf("in the leading guard region, byte %d", off)
			}
			return fmt.Sprintf("in the guard bytes before descriptor %d (%s memory), byte %d", i, kind, off)
		case off < o+s.sizes[i]:
			return fmt.Sprintf("at byte %d of descriptor %d (%d bytes, in %s memory)", off-o, i, s.sizes[i], kind)
		}
	}
	if end := len(s.host) - devEdge; off >= end {
		return fmt.Sprintf("in the trailing guard region, byte %d", off-end)
	}
	return fmt.Sprintf("in the guard bytes after the last descriptor, byte %d", off)
}

// regions returns the descriptors as a peer addresses them.
func (s *devSide) regions() []agent.Region {
	rs := make([]agent.Region, len(s.locals))
	for i, l := range s.locals {
		rs[i] = l.Region
	}
	return rs
}

// free frees the device memory; nothing may use it any more.
func (s *devSide) free() error {
	if s.dev == 0 {
		return nil
	}
	p := s.dev
	s.dev = 0
	return s.drv.Free(p)
}

// unavailableDevice is a device driver with no GPU behind it, as on a
// machine without the CUDA driver: every call fails with
// devmem.ErrUnavailable.
type unavailableDevice struct{}

var errNoDriver = fmt.Errorf("%w: backendtest: no device driver in this agent", devmem.ErrUnavailable)

func (unavailableDevice) Name() string                         { return "none" }
func (unavailableDevice) Devices() (int, error)                { return 0, errNoDriver }
func (unavailableDevice) Check(uintptr, uint64, int) error     { return errNoDriver }
func (unavailableDevice) Alloc(int, int) (uintptr, error)      { return 0, errNoDriver }
func (unavailableDevice) Free(uintptr) error                   { return errNoDriver }
func (unavailableDevice) HostAlloc(int) ([]byte, error)        { return nil, errNoDriver }
func (unavailableDevice) HostFree([]byte) error                { return errNoDriver }
func (unavailableDevice) NewStream(int) (devmem.Stream, error) { return nil, errNoDriver }

// oldOrNew reports the first byte, of host or device memory, that holds
// neither what Fill(old) nor what Fill(new) wrote there: a transfer cut
// short may leave a mix of the two, nothing else.
func (s *devSide) oldOrNew(old, new uint64) error {
	check := func(where string, got []byte, device bool) error {
		o, n := s.image(old, device), s.image(new, device)
		for i := range got {
			if got[i] != o[i] && got[i] != n[i] {
				return fmt.Errorf("%s memory %s is 0x%02x: neither the old (0x%02x) nor the new (0x%02x) value", where, s.locate(i), got[i], o[i], n[i])
			}
		}
		return nil
	}
	if err := check("host", s.host, false); err != nil || s.dev == 0 {
		return err
	}
	got := make([]byte, len(s.host))
	if err := devmem.CopyToHost(s.drv, s.gpu, got, s.dev); err != nil {
		return fmt.Errorf("read device memory back: %w", err)
	}
	return check(fmt.Sprintf("device (GPU %d)", s.gpu), got, true)
}
