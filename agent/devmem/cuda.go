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
func CUDA() Driver { return cudaOnce() }

var cudaOnce = sync.OnceValue(func() Driver { return &cudaDriver{} })

// cudaDriver is the CUDA driver; load binds libcuda at first use.
type cudaDriver struct {
	once sync.Once
	err  error
	api  *cudaAPI // nil until loaded

	mu   sync.Mutex
	ctxs map[int]uintptr // primary contexts retained, by ordinal
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
