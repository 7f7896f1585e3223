package connect

import (
	"fmt"
	"log/slog"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backend/ucx"
)

// Option configures a Connector. Options are applied in order by
// NewConnector, which reports invalid or conflicting ones with an error
// wrapping ErrInvalidOption.
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
}

// WithBackends replaces the default backends with bs, in order of
// preference: for each transfer the Connector uses the first one that
// reaches the peer and supports the memory involved. The Connector owns the
// backends from NewConnector on, even when it fails, and closes them. The
// option may be given more than once; backends accumulate.
//
// Default: the in-process backend (agent/backend/mem), then same-host
// cross-memory attach (agent/backend/cma, see WithCMAOptions and
// WithoutCMA), then UCX if WithUCX asks for it, then TCP
// (agent/backend/tcp, see WithTCPOptions).
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
// named name ("mem", "tcp", ...), which must be one of its backends; a peer
// that backend cannot reach fails with ErrNoBackend instead of falling back.
// It affects only the active side: passive operations serve any backend.
//
// Default: for each transfer, the first backend in preference order that
// both sides share and that supports the memory involved.
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
// Default: slog.Default().
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
// (Metadata.Compact), for example a transport/nats presence registry. Full
// tokens never consult it. The Connector calls r.Resolve from BeginRead and
// BeginWrite, with their context.
//
// Default: none; compact tokens fail with ErrNoBackend.
func WithResolver(r Resolver) Option {
	return optionFunc(func(o *options) error {
		if r == nil {
			return fmt.Errorf("%w: WithResolver needs a Resolver", ErrInvalidOption)
		}
		o.resolver = r
		return nil
	})
}

// WithAgentID gives the Connector's agent a chosen ID instead of a random
// one. Tokens and presence registries name the agent by this ID, so a
// deployment can tie each service's NATS credentials to the registry entry
// under its own ID (see docs/security.md). Two live Connectors must never
// share an ID: peers would take one for the other.
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

// WithTCPOptions configures the default TCP backend, for example
// tcp.WithListenAddr(":0") to accept peers on other hosts: by default it
// listens on loopback only. It conflicts with WithBackends, which replaces
// the defaults. The option may be given more than once; options accumulate.
// Invalid TCP options fail NewConnector with an error matching
// ErrInvalidOption.
//
// Default: the tcp package's defaults (listen on 127.0.0.1:0, 4 streams,
// keepalive every second, peer lost after 4 silent seconds).
func WithTCPOptions(opts ...tcp.Option) Option {
	return optionFunc(func(o *options) error {
		o.tcp = append(o.tcp, opts...)
		return nil
	})
}

// WithCMAOptions configures the default same-host backend, for example
// cma.WithWorkers(4). It conflicts with WithBackends, which replaces the
// defaults, and with WithoutCMA. The option may be given more than once;
// options accumulate. Invalid cma options fail NewConnector with an error
// matching ErrInvalidOption.
//
// Default: the cma package's defaults (GOMAXPROCS copy workers up to 8,
// 16 MiB leases, a 4 s timeout, PR_SET_PTRACER where Yama needs it).
func WithCMAOptions(opts ...cma.Option) Option {
	return optionFunc(func(o *options) error {
		o.cma = append(o.cma, opts...)
		return nil
	})
}

// WithoutCMA leaves the same-host cross-memory-attach backend out of the
// defaults: peers in other processes on this host are then reached over
// TCP. Use it where reading another process's memory is not wanted, or to
// compare the two. It conflicts with WithBackends and WithCMAOptions.
//
// Default: cma is used with peers on the same host that the kernel lets
// this process read and write (see docs/cma.md).
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
