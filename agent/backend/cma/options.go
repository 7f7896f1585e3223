package cma

import (
	"fmt"
	"runtime"
	"time"

	"github.com/goxfer/goxfer/agent"
)

// Option configures a [Backend]; pass options to [New]. An Option is a
// value: it may be shared and reused. The defaults below are those of a
// Backend made with no options; docs/cma.md gives each option's rationale.
type Option interface{ apply(*config) error }

type optionFunc func(*config) error

func (f optionFunc) apply(c *config) error { return f(c) }

// intOption is an Option that sets an integer to n, which must lie in
// [lo, hi] (bounds: how the error names them).
func intOption(n, lo, hi int, what, bounds string, set func(c *config)) Option {
	return optionFunc(func(c *config) error {
		if n < lo || n > hi {
			return fmt.Errorf("%w: cma: %s must be in %s, got %d", agent.ErrInvalidOption, what, bounds, n)
		}
		set(c)
		return nil
	})
}

type config struct {
	workers    int
	chunk      int
	lease      int
	timeout    time.Duration
	ptracer    bool
	maxNotify  int
	maxRanges  int
	leaseDepth int

	maxConnsPerProc int
	maxHandshakes   int

	ipc bool
	shm bool // WithSharedMemory
	// leaseFree: exposures of ordinary host memory go in the lease
	// table too (WithLeaseFree).
	leaseFree bool
	ipcLease  int // the device path's window (WithDeviceWindow)
}

// ipcLease is the device path's default window (ipc_linux.go): copies run
// on the GPU, so a window is large, a lease round trip costing more than
// the copy of a small one.
const ipcLease = 256 << 20

func defaults() config {
	return config{
		workers:    min(runtime.GOMAXPROCS(0), 8),
		chunk:      1 << 20,
		lease:      16 << 20,
		timeout:    4 * time.Second,
		ptracer:    true,
		shm:        true,
		leaseFree:  true,
		maxNotify:  64 << 10,
		maxRanges:  4096,
		leaseDepth: 2,

		maxConnsPerProc: 1024,
		maxHandshakes:   64,

		ipc:      true,
		ipcLease: ipcLease,
	}
}

// WithWorkers sets how many goroutines per backend copy chunks in
// parallel. Default: GOMAXPROCS at [New], at most 8; n in [1, 64].
func WithWorkers(n int) Option {
	return intOption(n, 1, 64, "workers", "[1, 64]", func(c *config) { c.workers = n })
}

// WithChunkSize sets the most bytes one system call copies: larger
// segments are split, smaller ones batched into one call of up to IOV_MAX
// (1024) pieces. Default: 1 MiB; n in [4 KiB, 256 MiB].
func WithChunkSize(n int) Option {
	return intOption(n, 4<<10, 256<<20, "chunk size", "[4 KiB, 256 MiB]", func(c *config) { c.chunk = n })
}

// WithLeaseSize sets the most bytes one lease covers: revoking an exposure
// waits for at most about two leases' worth of copying per transfer in
// flight. Default: 16 MiB; n in [64 KiB, 1 GiB].
func WithLeaseSize(n int) Option {
	return intOption(n, 64<<10, 1<<30, "lease size", "[64 KiB, 1 GiB]", func(c *config) { c.lease = n })
}

// WithTimeout sets how long a peer may leave a handshake or a lease
// request unanswered before it is lost ([agent.ErrRemoteLost]); it also
// bounds writes, Notify's wait for queue room, and on the exposing side
// Exposure.Revoke (about twice it). Default: 4 s; at least 10 ms.
func WithTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d < 10*time.Millisecond {
			return fmt.Errorf("%w: cma: timeout must be at least 10ms, got %v", agent.ErrInvalidOption, d)
		}
		c.timeout = d
		return nil
	})
}

// WithPtracer says whether, under Yama ptrace_scope 1, the exposing agent
// names as its ptracer (PR_SET_PTRACER) the first peer process whose
// handshake presents a key of a live exposure, so that it may copy; other
// peers fall back. Default: true; no effect in other Yama modes.
func WithPtracer(on bool) Option {
	return optionFunc(func(c *config) error {
		c.ptracer = on
		return nil
	})
}

// WithMaxConnsPerProcess sets how many control connections one local
// process (by SO_PEERCRED) may hold to this agent; more are closed as soon
// as accepted and counted in [Stats] LimitRejected. Default: 1024; n in
// [1, 2^20].
func WithMaxConnsPerProcess(n int) Option {
	return intOption(n, 1, 1<<20, "connections per process", "[1, 1048576]", func(c *config) { c.maxConnsPerProc = n })
}

// WithMaxHandshakes sets how many accepted connections may be in their
// handshake at once; a new one beyond it closes the oldest, counted in
// [Stats] LimitRejected. Default: 64; n in [1, 2^20].
func WithMaxHandshakes(n int) Option {
	return intOption(n, 1, 1<<20, "handshakes in progress", "[1, 1048576]", func(c *config) { c.maxHandshakes = n })
}

// WithDeviceIPC turns the same-host device path on or off. On (the
// default), two agents whose device drivers share memory (CUDA, or both
// simulated) move device memory on either side by mapping the exposing
// process's GPU allocations (CUDA IPC: legacy handles, or VMM file
// descriptors over the connection) and copying on the copying side's GPU:
// device to device, or one copy between device and host memory. Off, the
// agent on each side stages its device memory through pinned host buffers
// instead. A mapping reaches the whole allocation it belongs to: turn it
// off where the processes on the host must not trust each other that far
// (docs/gpu.md). Off on either side turns it off for the pair.
func WithDeviceIPC(on bool) Option {
	return optionFunc(func(c *config) error {
		c.ipc = on
		return nil
	})
}

// WithDeviceWindow sets the most bytes one lease covers on the same-host
// device path (WithDeviceIPC): a window's copies are enqueued on the GPU
// together and waited for once, and the exposing side's Revoke or Close
// waits for the windows in flight (up to four per transfer) to be copied.
// Smaller windows end a cancelled or revoked transfer sooner on a slow
// link; larger ones need fewer lease round trips. Default: 256 MiB; n in
// [64 KiB, 1 GiB].
func WithDeviceWindow(n int) Option {
	return intOption(n, 64<<10, 1<<30, "device window", "[64 KiB, 1 GiB]", func(c *config) { c.ipcLease = n })
}

// WithSharedMemory turns the shared-memory path on or off. On (the
// default), a peer copying memory this agent exposed that lies in a
// shared segment ([github.com/goxfer/goxfer/agent/shm.Alloc], connect's Connector.AllocHost) maps the
// segment once per connection and copies with plain loads and stores,
// without a lease round trip per transfer: revocation goes through a
// lease table both processes map (docs/shm.md). Only peers of the same
// user that pass the handshake's checks are offered segments, and a
// mapping reaches the whole segment, not just the exposed bytes: turn it
// off where the processes on the host must not trust each other that far.
// Off on either side turns it off for the pair; transfers then use leases
// and cross-memory attach, as for memory on the Go heap.
//
// Off, it also turns off WithLeaseFree, whose lease table is the one
// shared memory uses.
func WithSharedMemory(on bool) Option {
	return optionFunc(func(c *config) error {
		c.shm = on
		return nil
	})
}

// WithLeaseFree turns the lease-free path for ordinary host memory on or
// off. On (the default, with WithSharedMemory), an exposure of memory
// outside shared segments (the Go heap, any host allocation) of a single
// region is also published in each connection's lease table,
// and a peer's transfer of it of at most 1 MiB enters the table's slot and
// copies with process_vm_readv/writev at once, on the goroutine that posts
// it, without a lease round trip (path "cma+table"); revocation waits for
// such copies as for copies through shared memory (docs/shm.md). Larger
// transfers, exposures of several regions, and those the table had no
// room for, use leases. Off on either side turns it off for the pair: the exposing side
// publishes no such exposure, the copier uses none.
func WithLeaseFree(on bool) Option {
	return optionFunc(func(c *config) error {
		c.leaseFree = on
		return nil
	})
}
