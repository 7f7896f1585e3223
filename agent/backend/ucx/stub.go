//go:build !ucx

package ucx

import (
	"context"
	"fmt"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
)

// Backend is the UCX backend. This binary was built without the ucx build
// tag, so it is a placeholder: Start fails with an error wrapping
// [ErrNotBuiltIn] (or [agent.ErrInvalidOption] for invalid options), and an
// agent given it fails to start. Safe for concurrent use.
type Backend struct{ optErr error }

// New returns a placeholder backend whose Start fails: UCX is not built in.
// opts are checked all the same.
func New(opts ...Option) *Backend {
	_, err := newConfig(opts)
	return &Backend{optErr: err}
}

// Name implements [agent.Backend]: [Name].
func (b *Backend) Name() string { return Name }

// Supports implements [agent.Backend]: nothing, without UCX.
func (b *Backend) Supports(agent.MemKind) bool { return false }

// Start implements [agent.Backend]: it fails, saying how to build the backend.
func (b *Backend) Start(agent.Host) ([]byte, error) {
	if b.optErr != nil {
		return nil, b.optErr
	}
	return nil, fmt.Errorf("%w (this binary was built without the ucx tag)", ErrNotBuiltIn)
}

// Reachable implements [agent.Backend]: never ([ErrNotBuiltIn]).
func (b *Backend) Reachable(context.Context, agent.Info) error { return ErrNotBuiltIn }

// Post implements [agent.Backend]: it fails with [ErrNotBuiltIn].
func (b *Backend) Post(*agent.Work) error { return ErrNotBuiltIn }

// Notify implements [agent.Backend]: it fails with [ErrNotBuiltIn].
func (b *Backend) Notify(context.Context, agent.Info, agent.Key, []byte) error {
	return ErrNotBuiltIn
}

// Close implements [agent.Backend]: there is nothing to close.
func (b *Backend) Close() error { return nil }

// Alloc fails with [ErrNotBuiltIn]: without UCX there is nothing to
// allocate memory from.
func (b *Backend) Alloc(int) ([]byte, error) { return nil, ErrNotBuiltIn }

// Free fails with [ErrNotAllocated]: Alloc never succeeds here.
func (b *Backend) Free([]byte) error { return ErrNotAllocated }

// BuiltIn reports whether this binary was built with the ucx tag: false
// here.
func BuiltIn() bool { return false }

// Stats returns the backend's counters ([agent.Counting]): all 0 without
// UCX.
func (b *Backend) Stats() Stats { return Stats{} }

// PeerDeparted implements [agent.Departer]: there is nothing to drop.
func (b *Backend) PeerDeparted(uuid.UUID, error) {}
