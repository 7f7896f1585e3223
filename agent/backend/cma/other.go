//go:build !linux

package cma

import (
	"context"
	"fmt"
	"runtime"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/oneline"
)

var errUnsupported = fmt.Errorf("cma: cross-memory attach needs Linux, this is %s", runtime.GOOS)

// Backend is the cross-memory-attach backend. On this system it starts,
// publishes nothing a peer could use, and reaches no peer, so agents fall
// back to their other backends. Safe for concurrent use.
type Backend struct{ optErr error }

// New returns a backend that reaches no peer on this system. Invalid
// options are reported by Start, with an error wrapping
// [agent.ErrInvalidOption].
func New(opts ...Option) *Backend {
	cfg := defaults()
	var errs []error
	for _, o := range opts {
		if o == nil {
			errs = append(errs, fmt.Errorf("%w: cma: nil option", agent.ErrInvalidOption))
			continue
		}
		if err := o.apply(&cfg); err != nil {
			errs = append(errs, err)
		}
	}
	return &Backend{optErr: oneline.Join(errs...)}
}

// Name implements [agent.Backend].
func (b *Backend) Name() string { return Name }

// Supports implements [agent.Backend]: host memory only.
func (b *Backend) Supports(k agent.MemKind) bool { return k == agent.KindDRAM }

// Start implements [agent.Backend].
func (b *Backend) Start(agent.Host) ([]byte, error) { return nil, b.optErr }

// Reachable implements [agent.Backend]: never, on this system.
func (b *Backend) Reachable(context.Context, agent.Info) error { return errUnsupported }

// Post implements [agent.Backend].
func (b *Backend) Post(*agent.Work) error { return errUnsupported }

// Notify implements [agent.Backend].
func (b *Backend) Notify(context.Context, agent.Info, agent.Key, []byte) error {
	return errUnsupported
}

// Close implements [agent.Backend].
func (b *Backend) Close() error { return nil }

// Stats implements [agent.Counting]: all zero on this system.
func (b *Backend) Stats() Stats { return Stats{} }

// StagesDevice implements [agent.DeviceStager]: false, on this system.
func (b *Backend) StagesDevice() bool { return false }
