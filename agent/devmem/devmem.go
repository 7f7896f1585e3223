// Package devmem is goxfer's device-memory layer: the calls the agent makes
// to check GPU pointers, to allocate pinned host memory for staging, and to
// copy between GPU memory and host memory on streams.
//
// Two drivers implement it. [CUDA] binds the NVIDIA driver API
// (libcuda.so.1) at first use without cgo, so the pure-Go build keeps
// working on machines without a GPU: there the first CUDA call fails with
// [ErrUnavailable], saying what is missing. [Sim] simulates GPUs for
// machines without one: its device memory is reserved with no access
// rights, so code that dereferences a device pointer crashes instead of
// passing by accident, and it keeps a record of when each copy ran, so
// tests can check that staging overlapped the network.
//
// Both drivers are a [Sharer]: a process exports an allocation of its
// device memory as a [Share] (a CUDA IPC handle, or a file descriptor of
// VMM memory), another process on the same host imports it as a
// [Mapping], and copies between its own device memory and the mapping
// with [Stream.Copy], without staging through host memory.
//
// [Default] picks the driver for the process: the CUDA driver, unless the
// environment variable GOXFER_DEVICE is "sim". The simulator is never
// chosen silently: only that variable, or an explicit option of the agent
// (agent.WithDevice), selects it.
package devmem

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
)

// Driver is one implementation of device memory. Its methods are safe for
// concurrent use.
type Driver interface {
	// Name is "cuda" or "sim".
	Name() string
	// Devices returns how many GPUs the driver sees.
	Devices() (int, error)
	// Check verifies that [ptr, ptr+n) is device memory of GPU dev and lies
	// inside one allocation. Its error wraps [ErrNotDevice] and says what
	// was found instead, or [ErrUnavailable].
	Check(ptr uintptr, n uint64, dev int) error
	// Alloc allocates n bytes of device memory on GPU dev. The agent never
	// calls it: it is for tests, benchmarks and examples.
	Alloc(dev int, n int) (uintptr, error)
	// Free frees memory from Alloc.
	Free(ptr uintptr) error
	// HostAlloc allocates n bytes of pinned host memory, outside the Go
	// heap, that copies to and from any GPU may use at full speed. The
	// memory stays valid until HostFree.
	HostAlloc(n int) ([]byte, error)
	// HostFree frees memory from HostAlloc.
	HostFree(b []byte) error
	// NewStream returns a stream of copies on GPU dev.
	NewStream(dev int) (Stream, error)
}

// Stream is an ordered queue of copies on one GPU. Copies are enqueued
// without waiting; Sync waits for all of them. A Stream is used by one
// goroutine at a time.
type Stream interface {
	// ToHost enqueues a copy of len(dst) bytes from device memory at src
	// into dst. dst must stay alive and untouched until Sync returns; for
	// full speed it is pinned memory from [Driver.HostAlloc].
	ToHost(dst []byte, src uintptr) error
	// ToDevice enqueues a copy of src into device memory at dst. src must
	// stay alive and unchanged until Sync returns.
	ToDevice(dst uintptr, src []byte) error
	// Copy enqueues a copy of n bytes of device memory from src to dst:
	// on one GPU, or between two (a peer copy), either end possibly a
	// [Mapping] of another process's memory. One end should be memory of
	// the stream's GPU (the simulator insists). The ranges must not
	// overlap.
	Copy(dst, src uintptr, n int) error
	// Sync waits until every copy enqueued so far has completed, and
	// returns the first error any of them met.
	Sync() error
	// Close waits for the stream's copies and frees it.
	Close() error
}

// Errors of the device-memory layer. Match them with [errors.Is].
var (
	// ErrUnavailable reports that no CUDA driver could be loaded, or that it
	// failed to initialise: device memory cannot be used in this process.
	ErrUnavailable = errors.New("devmem: CUDA driver unavailable")
	// ErrNotDevice reports memory that is not device memory of the GPU
	// named, or a range that runs past the end of its allocation.
	ErrNotDevice = errors.New("devmem: not device memory")
)

// EnvDevice is the environment variable that selects the process's
// driver in [Default]: "sim" for the simulator, "cuda" or unset for the
// CUDA driver.
const EnvDevice = "GOXFER_DEVICE"

// EnvSimDevices sets how many GPUs the process's simulator has (default 2).
const EnvSimDevices = "GOXFER_SIM_DEVICES"

var (
	defaultOnce sync.Once
	defaultDrv  Driver
	defaultErr  error
)

// Default returns the process's driver, chosen once by [EnvDevice]: the
// simulator (with [EnvSimDevices] GPUs) for "sim", the CUDA driver
// otherwise. The CUDA driver is loaded lazily: Default does not fail on a
// machine without one; its first call does, with [ErrUnavailable].
func Default() (Driver, error) {
	defaultOnce.Do(func() {
		switch v := os.Getenv(EnvDevice); v {
		case "sim":
			n := 2
			if s := os.Getenv(EnvSimDevices); s != "" {
				var err error
				if n, err = strconv.Atoi(s); err != nil || n < 1 || n > 64 {
					defaultErr = fmt.Errorf("devmem: %s=%q: want a GPU count in [1, 64]", EnvSimDevices, s)
					return
				}
			}
			defaultDrv = NewSim(n)
		case "", "cuda":
			defaultDrv = CUDA()
		default:
			defaultErr = fmt.Errorf("devmem: %s=%q: want \"cuda\" or \"sim\"", EnvDevice, v)
		}
	})
	return defaultDrv, defaultErr
}
