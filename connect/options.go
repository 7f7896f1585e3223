package connect

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backend/ucx"
	"github.com/goxfer/goxfer/agent/devmem"
)

// Option configures a Connector. Options are applied in order by
// [NewConnector], which reports invalid or conflicting ones with an error
// wrapping [ErrInvalidOption]. docs/concepts.md (Connector options) says
// when to use which.
type Option interface{ apply(*options) error }

type optionFunc func(*options) error

func (f optionFunc) apply(o *options) error { return f(o) }

type options struct {
	backends []agent.Backend // explicit, from WithBackends
	tcp      []tcp.Option
	cma      []cma.Option
	noCMA    bool
	ucx      []ucx.Option // non-nil: WithUCX was given
	force    string
	logger   *slog.Logger
	resolver Resolver
	id       uuid.UUID
	device   devmem.Driver
	staging  [2]int // chunk, pool; zero: the agent's defaults
	expiry   time.Duration
	observe  func(OpReport) // from WithObserver; nil: none
}

// WithDevice sets the device-memory driver that checks GPU descriptors and
// stages GPU memory ([agent.WithDevice]). Default: the CUDA driver, loaded
// at the first use of GPU memory, unless the environment variable
// GOXFER_DEVICE=sim selects the simulator ([devmem.Default]). Tests and
// machines without a GPU pass a [devmem.Sim].
func WithDevice(d devmem.Driver) Option {
	return optionFunc(func(o *options) error {
		if d == nil {
			return fmt.Errorf("%w: WithDevice(nil)", ErrInvalidOption)
		}
		o.device = d
		return nil
	})
}

// WithStaging sets the chunk size and the pinned pool size used to stage
// GPU memory through host memory for backends that cannot reach it
// ([agent.WithStaging]; defaults 4 MiB and 64 MiB).
func WithStaging(chunk, pool int) Option {
	return optionFunc(func(o *options) error {
		o.staging = [2]int{chunk, pool}
		return nil
	})
}

// WithBackends replaces the default backends with bs, in order of
// preference; the Connector owns and closes them. Backends accumulate over
// repeated options.
//
// Default: mem, cma, ucx (with [WithUCX] only), tcp.
func WithBackends(bs ...agent.Backend) Option {
	return optionFunc(func(o *options) error {
		if len(bs) == 0 {
			return fmt.Errorf("%w: WithBackends needs at least one backend", ErrInvalidOption)
		}
		for i, b := range bs {
			if b == nil {
				return fmt.Errorf("%w: WithBackends: backend %d is nil", ErrInvalidOption, i)
			}
		}
		o.backends = append(o.backends, bs...)
		return nil
	})
}

// WithBackend makes every transfer the Connector begins use the backend
// named name, one of its own; a peer it cannot reach fails with
// [ErrNoBackend] instead of falling back. Passive operations serve any.
//
// Default: per transfer, the first backend that reaches the peer and
// supports the memory.
func WithBackend(name string) Option {
	return optionFunc(func(o *options) error {
		if name == "" {
			return fmt.Errorf("%w: WithBackend needs a backend name", ErrInvalidOption)
		}
		if name == ucx.Name && !ucx.BuiltIn() {
			return fmt.Errorf("%w: WithBackend(%q): %w", ErrInvalidOption, name, ucx.ErrNotBuiltIn)
		}
		o.force = name
		return nil
	})
}

// WithLogger sets where the Connector, its agent and its backends log.
//
// Default: [slog.Default]().
func WithLogger(l *slog.Logger) Option {
	return optionFunc(func(o *options) error {
		if l == nil {
			return fmt.Errorf("%w: WithLogger needs a logger", ErrInvalidOption)
		}
		o.logger = l
		return nil
	})
}

// WithResolver sets how the Connector finds the agent a compact token names
// ([Metadata.Compact]); BeginRead and BeginWrite call r.Resolve with their
// context. Full tokens never consult it.
//
// Default: none; compact tokens fail with [ErrNoBackend].
func WithResolver(r Resolver) Option {
	return optionFunc(func(o *options) error {
		if r == nil {
			return fmt.Errorf("%w: WithResolver needs a Resolver", ErrInvalidOption)
		}
		o.resolver = r
		return nil
	})
}

// WithAgentID gives the Connector's agent a chosen ID, the one tokens and
// registries name it by; two live Connectors must never share one.
//
// Default: a random (version 4) UUID per Connector.
func WithAgentID(id uuid.UUID) Option {
	return optionFunc(func(o *options) error {
		if id == uuid.Nil {
			return fmt.Errorf("%w: WithAgentID needs a non-nil UUID", ErrInvalidOption)
		}
		o.id = id
		return nil
	})
}

// WithTCPOptions configures the default tcp backend, for example
// [tcp.WithListenAddr] to accept peers on other hosts. Options accumulate;
// it conflicts with [WithBackends].
//
// Default: tcp's defaults: loopback only (127.0.0.1:0), 4 streams, a peer
// lost after 4 silent seconds.
func WithTCPOptions(opts ...tcp.Option) Option {
	return optionFunc(func(o *options) error {
		o.tcp = append(o.tcp, opts...)
		return nil
	})
}

// WithCMAOptions configures the default same-host backend, for example
// [cma.WithWorkers]. Options accumulate; it conflicts with [WithBackends]
// and [WithoutCMA].
//
// Default: cma's defaults: GOMAXPROCS copy workers up to 8, 16 MiB leases,
// a 4 s timeout.
func WithCMAOptions(opts ...cma.Option) Option {
	return optionFunc(func(o *options) error {
		o.cma = append(o.cma, opts...)
		return nil
	})
}

// WithoutCMA leaves the same-host backend (cma) out of the defaults: peers
// in other processes on this host are then reached over tcp. It conflicts
// with [WithBackends] and [WithCMAOptions].
//
// Default: cma serves same-host peers the kernel lets this process read
// and write.
func WithoutCMA() Option {
	return optionFunc(func(o *options) error {
		o.noCMA = true
		return nil
	})
}

// defaultBackends returns fresh default backends, in order of preference.
func defaultBackends(o *options) []agent.Backend {
	bs := []agent.Backend{mem.New()}
	if !o.noCMA {
		bs = append(bs, cma.New(o.cma...))
	}
	if o.ucx != nil {
		bs = append(bs, ucx.New(o.ucx...))
	}
	return append(bs, tcp.New(o.tcp...))
}

// conflicts reports options that contradict each other.
func (o *options) conflicts() error {
	switch {
	case o.backends != nil && o.tcp != nil:
		return fmt.Errorf("%w: WithTCPOptions configures a default backend, which WithBackends replaces", ErrInvalidOption)
	case o.backends != nil && (o.cma != nil || o.noCMA):
		return fmt.Errorf("%w: WithCMAOptions and WithoutCMA configure a default backend, which WithBackends replaces", ErrInvalidOption)
	case o.backends != nil && o.ucx != nil:
		return fmt.Errorf("%w: WithUCX adds a default backend, which WithBackends replaces", ErrInvalidOption)
	case o.noCMA && o.cma != nil:
		return fmt.Errorf("%w: WithCMAOptions configures the cma backend, which WithoutCMA leaves out", ErrInvalidOption)
	}
	return nil
}
