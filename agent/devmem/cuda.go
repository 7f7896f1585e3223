package devmem

import (
	"fmt"
	"sync"
)

// CUDA returns the process's CUDA driver: the NVIDIA driver API
// (libcuda.so.1), bound without cgo and loaded at its first use. On a
// machine without the driver, or where it fails to initialise, every
// method returns an error wrapping [ErrUnavailable] that says what is
// missing. Safe for concurrent use.
//
// It works in each GPU's primary context, the one PyTorch, the CUDA
// runtime and UCX share in a mixed process, retained once per GPU for the
// life of the process. The current context is a property of the OS thread:
// each call that needs one locks its goroutine to its thread, makes the
// GPU's primary context current, makes the call and restores the context
// the thread had, so goxfer never changes what other code on that thread
// sees.
//
// The driver is a [Sharer]: cuMemAlloc memory shares by legacy IPC handle,
// VMM memory created shareable by POSIX file descriptor by descriptor.
// Its entry points are bound where the driver has them; without them
// (drivers older than CUDA 11) sharing fails with [ErrNotShareable] and
// everything else works.
func CUDA() Driver { return cudaOnce() }

var cudaOnce = sync.OnceValue(func() Driver { return &cudaDriver{} })

var _ Sharer = (*cudaDriver)(nil)

// cudaDriver is the CUDA driver; load binds libcuda at first use.
type cudaDriver struct {
	once sync.Once
	err  error
	api  *cudaAPI // nil until loaded

	mu      sync.Mutex
	ctxs    map[int]uintptr          // primary contexts retained, by ordinal
	uuids   [][16]byte               // the GPUs' UUIDs, by ordinal, read at first use
	vmm     map[uintptr]cudaVMM      // AllocShareable's allocations, by address
	imports map[uintptr]*cudaMapping // Import's open mappings, by address
}

// Name returns "cuda".
func (d *cudaDriver) Name() string { return "cuda" }

func (d *cudaDriver) load() (*cudaAPI, error) {
	d.once.Do(func() {
		d.api, d.err = loadCUDA()
		if d.err != nil {
			d.err = fmt.Errorf("%w: %w (tests and benchmarks without a GPU can set %s=sim)", ErrUnavailable, d.err, EnvDevice)
		}
	})
	return d.api, d.err
}
