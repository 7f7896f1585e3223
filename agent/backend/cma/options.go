package cma

import (
	"fmt"
	"runtime"
	"time"

	"github.com/goxfer/goxfer/agent"
)

// Option configures a Backend.
type Option interface{ apply(*config) error }

type optionFunc func(*config) error

func (f optionFunc) apply(c *config) error { return f(c) }

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
}

func defaults() config {
	return config{
		workers:    min(runtime.GOMAXPROCS(0), 8),
		chunk:      1 << 20,
		lease:      16 << 20,
		timeout:    4 * time.Second,
		ptracer:    true,
		maxNotify:  64 << 10,
		maxRanges:  4096,
		leaseDepth: 2,

		maxConnsPerProc: 1024,
		maxHandshakes:   64,
	}
}

// WithWorkers sets how many goroutines per backend copy in parallel: a large
// transfer is cut into chunks that they share. Default: GOMAXPROCS at New,
// at most 8.
func WithWorkers(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 || n > 64 {
			return fmt.Errorf("%w: cma: workers must be in [1, 64], got %d", agent.ErrInvalidOption, n)
		}
		c.workers = n
		return nil
	})
}

// WithChunkSize sets the most bytes one system call copies: larger
// descriptors are split, smaller ones batched into one call of up to
// IOV_MAX (1024) pieces. Chunks are what the workers share. Default: 1 MiB.
func WithChunkSize(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 4<<10 || n > 256<<20 {
			return fmt.Errorf("%w: cma: chunk size must be in [4 KiB, 256 MiB], got %d", agent.ErrInvalidOption, n)
		}
		c.chunk = n
		return nil
	})
}

// WithLeaseSize sets the most bytes one lease covers. The exposing agent
// grants a lease over its connection before each span of a transfer is
// copied and the copying agent ends it right after, so revoking an exposure
// (or closing its operation) waits for at most about two leases' worth of
// copying per transfer in flight. Default: 16 MiB.
func WithLeaseSize(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 64<<10 || n > 1<<30 {
			return fmt.Errorf("%w: cma: lease size must be in [64 KiB, 1 GiB], got %d", agent.ErrInvalidOption, n)
		}
		c.lease = n
		return nil
	})
}

// WithTimeout sets how long the backend waits for a peer to answer a
// handshake or a lease request before it declares the peer lost
// (agent.ErrRemoteLost). A peer that dies is noticed at once, when its
// socket closes; the timeout is for a peer that hangs. It also bounds how
// long a write waits for the peer to read, how long Notify waits for room
// in the queue of unsent notifications (4 MiB per peer), how long a lease
// may be held on an exposure being revoked before the exposing side drops
// the connection, and how long it then waits for the copier to close its
// end: Exposure.Revoke waits at most about twice the timeout, whatever a
// peer does. Default: 4 s.
func WithTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d < 10*time.Millisecond {
			return fmt.Errorf("%w: cma: timeout must be at least 10ms, got %v", agent.ErrInvalidOption, d)
		}
		c.timeout = d
		return nil
	})
}

// WithPtracer says whether the exposing agent may declare its same-host
// peers as ptracers (prctl PR_SET_PTRACER) when the kernel's Yama module
// runs in mode 1 (kernel.yama.ptrace_scope = 1), where otherwise only an
// ancestor process may read this one's memory. The agent names a peer's
// process ID, verified with SO_PEERCRED, only once the peer's handshake
// presented a key of one of its live exposures, and only while no other
// process holds the exception: Yama keeps one per process, and the agent
// never names any process (PR_SET_PTRACER_ANY). Peers not named fall back
// to another backend. With false, every peer on such a host falls back
// unless it is an ancestor. In modes 0, 2 and 3 the option has no effect.
// Default: true.
func WithPtracer(on bool) Option {
	return optionFunc(func(c *config) error {
		c.ptracer = on
		return nil
	})
}

// WithMaxConnsPerProcess sets how many control connections one process (as
// the kernel names it, SO_PEERCRED) may hold to this agent at once. The
// socket lives in the abstract namespace, where any local process can
// connect; the limit bounds the goroutines and leases one of them can
// occupy. A connection over it is closed as soon as it is accepted and
// counted in Stats.LimitRejected. Default: 1024; an agent holds one
// connection to each peer, so this is a thousand agents in one process.
func WithMaxConnsPerProcess(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 || n > 1<<20 {
			return fmt.Errorf("%w: cma: connections per process must be in [1, 1048576], got %d", agent.ErrInvalidOption, n)
		}
		c.maxConnsPerProc = n
		return nil
	})
}

// WithMaxHandshakes sets how many accepted connections may be in the
// handshake at once. A handshake must complete within the timeout
// (WithTimeout); when a new connection finds the limit reached, the oldest
// unfinished handshake is closed to make room and counted in
// Stats.LimitRejected, so a flood of connections that never handshake holds
// a bounded number of goroutines and cannot lock out honest peers, whose
// handshakes take one round trip. Default: 64.
func WithMaxHandshakes(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 || n > 1<<20 {
			return fmt.Errorf("%w: cma: handshakes in progress must be in [1, 1048576], got %d", agent.ErrInvalidOption, n)
		}
		c.maxHandshakes = n
		return nil
	})
}
