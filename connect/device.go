package connect

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// DeviceKind is where a Descriptor's memory lives.
type DeviceKind uint8

const (
	// DeviceHost is host memory (DRAM), reachable by the CPU.
	DeviceHost DeviceKind = iota
	// DeviceCUDA is the memory of a CUDA GPU; Device.ID names the GPU.
	DeviceCUDA
)

// String returns "host" or "cuda".
func (k DeviceKind) String() string {
	switch k {
	case DeviceHost:
		return "host"
	case DeviceCUDA:
		return "cuda"
	}
	return fmt.Sprintf("DeviceKind(%d)", uint8(k))
}

// Device names a memory location: the host, or one CUDA GPU by its ordinal.
// The zero Device is the host. Devices are plain values, safe to copy and
// compare.
type Device struct {
	Kind DeviceKind
	ID   int // the GPU ordinal for DeviceCUDA; 0 for DeviceHost
}

// maxDeviceID bounds GPU ordinals: the agent carries them as uint32.
const maxDeviceID = math.MaxInt32

// Host returns the host device.
func Host() Device { return Device{Kind: DeviceHost} }

// CUDA returns the CUDA GPU with ordinal id. A negative id yields a device
// that descriptors reject with [ErrInvalidDescriptor].
func CUDA(id int) Device { return Device{Kind: DeviceCUDA, ID: id} }

// ParseDevice parses "cpu" or "host" (the host), "cuda" (GPU 0) or "cuda:N"
// (GPU N), ignoring case. It is the inverse of [Device.String]. Errors quote
// s.
func ParseDevice(s string) (Device, error) {
	kind, id, hasID := strings.Cut(strings.ToLower(s), ":")
	switch kind {
	case "cpu", "host":
		if hasID {
			return Device{}, fmt.Errorf("connect: device %q: host memory takes no ordinal", s)
		}
		return Host(), nil
	case "cuda":
		if !hasID {
			return CUDA(0), nil
		}
		n, err := strconv.ParseUint(id, 10, 31)
		if err != nil {
			return Device{}, fmt.Errorf("connect: device %q: want a GPU ordinal in [0, %d] after \"cuda:\", found %q", s, maxDeviceID, id)
		}
		return CUDA(int(n)), nil
	}
	return Device{}, fmt.Errorf("connect: device %q: want \"cpu\", \"host\", \"cuda\" or \"cuda:N\"", s)
}

// String returns "host" or "cuda:N", which [ParseDevice] accepts.
func (d Device) String() string {
	if d.Kind == DeviceCUDA {
		return "cuda:" + strconv.Itoa(d.ID)
	}
	if d.Kind == DeviceHost && d.ID == 0 {
		return "host"
	}
	return fmt.Sprintf("%v:%d", d.Kind, d.ID)
}

func (d Device) check() error {
	switch {
	case d.Kind == DeviceHost && d.ID == 0:
		return nil
	case d.Kind == DeviceCUDA && d.ID >= 0 && d.ID <= maxDeviceID:
		return nil
	}
	return fmt.Errorf("device %s does not exist", d)
}
