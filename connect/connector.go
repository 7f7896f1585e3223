package connect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/shm"
	"github.com/goxfer/goxfer/internal/oneline"
)

// Connector creates the four kinds of operation over one shared transfer
// agent ([agent.Agent]) and its backends. Create one per process (or per
// set of memory that is managed together) with [NewConnector], and Close it
// when done.
//
// A Connector is safe for concurrent use by any number of goroutines.
type Connector struct {
	a     *agent.Agent
	info  agent.Info // the agent's public metadata; immutable, shared by tokens
	log   *slog.Logger
	force string

	resolver Resolver      // for compact tokens; nil if none
	expiry   time.Duration // of passive operations, from WithExpiry; 0: none

	observe func(OpReport) // from WithObserver; nil: none

	mu        sync.Mutex
	closing   bool
	calls     sync.WaitGroup // Create and Begin calls in progress
	passive   map[*passiveOp]struct{}
	exposures map[*Exposure]struct{}
	active    map[*activeOp]struct{}

	watchers sync.WaitGroup // one per active operation until it finishes, and its notice to the peer

	closeOnce sync.Once
	closeErr  error
}

// NewConnector starts a Connector and its agent. Each [Option] states its
// default; with none, the Connector has the default backends (mem, cma,
// tcp, with tcp listening on loopback only). Invalid or conflicting options
// fail with an error wrapping [ErrInvalidOption]. On error nothing is left
// running.
func NewConnector(opts ...Option) (*Connector, error) {
	o := options{logger: slog.Default()}
	for _, opt := range opts {
		if err := opt.apply(&o); err != nil {
			closeBackends(o.backends)
			return nil, err
		}
	}
	if err := o.conflicts(); err != nil {
		closeBackends(o.backends)
		return nil, err
	}
	backends := o.backends
	if backends == nil {
		backends = defaultBackends(&o)
	}
	aopts := []agent.Option{agent.WithBackends(backends...), agent.WithLogger(o.logger)}
	if o.id != uuid.Nil {
		aopts = append(aopts, agent.WithID(o.id))
	}
	if o.device != nil {
		aopts = append(aopts, agent.WithDevice(o.device))
	}
	if o.staging != [2]int{} {
		aopts = append(aopts, agent.WithStaging(o.staging[0], o.staging[1]))
	}
	a, err := agent.New(aopts...)
	if errors.Is(err, ErrInvalidOption) {
		return nil, err
	}
	if err != nil {
		return nil, fmt.Errorf("connect: start agent: %w", err)
	}
	if o.force != "" && !slices.Contains(a.Backends(), o.force) {
		_ = a.Close()
		return nil, fmt.Errorf("%w: WithBackend(%q): the backends are %q", ErrInvalidOption, o.force, a.Backends())
	}
	return &Connector{
		a:         a,
		info:      a.Info(),
		log:       a.Logger(),
		force:     o.force,
		resolver:  o.resolver,
		expiry:    o.expiry,
		observe:   o.observe,
		passive:   make(map[*passiveOp]struct{}),
		exposures: make(map[*Exposure]struct{}),
		active:    make(map[*activeOp]struct{}),
	}, nil
}

func closeBackends(bs []agent.Backend) {
	for _, b := range bs {
		_ = b.Close()
	}
}

// Close ends every operation and stops the Connector. It first refuses new
// Create and Begin calls and waits for those in progress. Then active
// operations are cancelled (their Wait returns an error matching [ErrClosed]
// and [ErrCancelled], unless the transfer had already ended), and Close
// waits for their transfers to end and for the notices telling their peers
// (each bounded by 10 s). Then passive operations and exposures are closed
// (their Wait returns [ErrClosed] unless the operation already had an
// outcome; an [Exposure]'s Events channel is closed), and the
// agent and its backends stop ([agent.Agent.Close]), after the completion
// notifications of transfers that already succeeded have gone out (a
// READ's Wait returns before its notification is written), so closing
// right after a Wait does not lose one. It returns once no
// backend touches any operation's memory and every goroutine the Connector
// started has ended. Errors from releasing memory and stopping backends are
// joined. Close is idempotent and safe to call concurrently; every call
// returns the first call's result.
func (c *Connector) Close() error {
	c.closeOnce.Do(func() {
		c.mu.Lock()
		c.closing = true
		c.mu.Unlock()
		c.calls.Wait()

		c.mu.Lock()
		active := make([]*activeOp, 0, len(c.active))
		for o := range c.active {
			active = append(active, o)
		}
		passive := make([]*passiveOp, 0, len(c.passive))
		for o := range c.passive {
			passive = append(passive, o)
		}
		exposures := make([]*Exposure, 0, len(c.exposures))
		for e := range c.exposures {
			exposures = append(exposures, e)
		}
		c.mu.Unlock()

		for _, o := range active {
			o.x.Cancel(ErrClosed)
		}
		c.watchers.Wait()
		var errs []error
		for _, o := range passive {
			errs = append(errs, o.Close())
		}
		for _, e := range exposures {
			errs = append(errs, e.Close())
		}
		errs = append(errs, c.a.Close())
		c.closeErr = oneline.Join(errs...)
	})
	return c.closeErr
}

// enter admits a Create or Begin call unless ctx is done or the Connector
// is closing, and takes a reference to every region of ls, in one call. On
// success the call ends with c.calls.Done.
func (c *Connector) enter(ctx context.Context, ls []agent.Local) (*agent.Registration, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	c.mu.Lock()
	if c.closing {
		c.mu.Unlock()
		return nil, ErrClosed
	}
	c.calls.Add(1)
	c.mu.Unlock()
	r, err := c.a.Register(ls...)
	if err != nil {
		c.calls.Done()
		return nil, fmt.Errorf("connect: register descriptors: %w", err)
	}
	return r, nil
}

func (c *Connector) isClosing() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closing
}

// CUDAAvailable reports whether the Connector can use GPU memory: its
// device driver ([WithDevice]) loaded and sees at least one GPU. It loads
// the CUDA driver if nothing did yet. With the simulator it reports true:
// simulated GPUs are GPUs to the SDK. Safe for concurrent use.
func (c *Connector) CUDAAvailable() bool {
	d, err := c.a.Device()
	if err != nil {
		return false
	}
	n, err := d.Devices()
	return err == nil && n > 0
}

// AllocHost returns size bytes of zeroed host memory that same-host peers
// can map ([shm.Alloc]): where a token's memory lies in such memory, a
// peer on the same host copies it with plain loads and stores in its own
// process, without a round trip per transfer (the cma backend's
// shared-memory path, docs/shm.md). Use the buffer's Bytes as any []byte:
// in [NewDescriptor], exposed, read or written. The caller owns the
// buffer and frees it with Free once no operation uses it (Free refuses
// while an exposure of it is open); closing the Connector does not free
// it. Allocate pools, not single small blocks: each allocation is one
// segment, mapped by each peer once. It fails on a closed Connector
// ([ErrClosed]) and where the system has no shared memory
// ([shm.ErrUnsupported]: not Linux). Safe for concurrent use.
func (c *Connector) AllocHost(size int) (*shm.Buffer, error) {
	if c.isClosing() {
		return nil, fmt.Errorf("connect: alloc host: %w", ErrClosed)
	}
	b, err := shm.Alloc(size)
	if err != nil {
		return nil, fmt.Errorf("connect: alloc host: %w", err)
	}
	return b, nil
}
