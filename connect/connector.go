package connect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
)

// Connector creates the four kinds of operation over one shared transfer
// agent and its backends. Create one per process (or per set of memory
// that is managed together) with NewConnector, and Close it when done.
//
// A Connector is safe for concurrent use by any number of goroutines.
type Connector struct {
	a     *agent.Agent
	info  agent.Info // the agent's public metadata; immutable, shared by tokens
	log   *slog.Logger
	force string

	resolver Resolver // for compact tokens; nil if none

	mu      sync.Mutex
	closing bool
	calls   sync.WaitGroup // Create and Begin calls in progress
	passive map[*passiveOp]struct{}
	active  map[*activeOp]struct{}

	watchers sync.WaitGroup // one per active operation until it finishes, and its notice to the peer

	closeOnce sync.Once
	closeErr  error
}

// NewConnector starts a Connector and its agent. See the Option functions
// for the defaults. On error nothing is left running.
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
		a:        a,
		info:     a.Info(),
		log:      a.Logger(),
		force:    o.force,
		resolver: o.resolver,
		passive:  make(map[*passiveOp]struct{}),
		active:   make(map[*activeOp]struct{}),
	}, nil
}

func closeBackends(bs []agent.Backend) {
	for _, b := range bs {
		_ = b.Close()
	}
}

// Close ends every operation and stops the Connector: active operations are
// cancelled (their Wait returns an error matching ErrClosed and
// ErrCancelled, unless the transfer had already completed), passive ones are
// closed (their Wait returns ErrClosed unless the peer had already reported
// completion), then the agent and its backends stop. It returns once no
// backend touches any operation's memory and every goroutine the Connector
// started has ended. Errors from releasing memory and stopping backends are
// joined. Close is idempotent; every call returns the first call's result.
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
		c.mu.Unlock()

		for _, o := range active {
			o.x.Cancel(ErrClosed)
		}
		c.watchers.Wait()
		var errs []error
		for _, o := range passive {
			errs = append(errs, o.Close())
		}
		errs = append(errs, c.a.Close())
		c.closeErr = errors.Join(errs...)
	})
	return c.closeErr
}

// enter admits a Create or Begin call unless the Connector is closing; the
// call ends with c.calls.Done.
func (c *Connector) enter(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closing {
		return ErrClosed
	}
	c.calls.Add(1)
	return nil
}

func (c *Connector) isClosing() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closing
}

// register takes a reference to every local region, in one call.
func (c *Connector) register(ls []agent.Local) (*agent.Registration, error) {
	r, err := c.a.Register(ls...)
	if err != nil {
		return nil, fmt.Errorf("connect: register descriptors: %w", err)
	}
	return r, nil
}
