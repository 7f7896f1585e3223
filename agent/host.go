package agent

import (
	"context"
	"log/slog"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent/devmem"
)

// Host is the agent as one of its backends sees it, and the only way a
// backend reaches back into the agent: the agent gives each backend its own
// Host in [Backend.Start]. Users of the agent never hold one. It is an
// interface so that a backend's tests can stand in for the agent (a host
// that never answers, say); backends never implement it. Its methods are
// safe for concurrent use.
type Host interface {
	// ID is the local agent's identity.
	ID() uuid.UUID
	// Logger is where the backend logs: the agent's logger ([WithLogger]),
	// with the agent and the backend's name attached.
	Logger() *slog.Logger
	// Context is the backend's lifetime: it is cancelled, with cause
	// [ErrClosed], just before [Backend.Close], when the agent closes the
	// backend ([Agent.Close], or a [New] that fails). Goroutines and blocking
	// calls that should end with the backend watch it ([context.AfterFunc],
	// or a select) instead of a stop channel of their own.
	Context() context.Context
	// Open grants the peer on link l a lease on the exposure named by key
	// for access acc. Every byte the backend touches on a remote agent's
	// behalf must be reached through [Lease.Slice] while the lease is held,
	// and the lease released promptly: revocation waits for outstanding
	// leases. Refused accesses return an error wrapping [ErrAccessDenied]
	// and are counted; an agent that is closing answers [ErrRemoteLost]
	// instead, uncounted.
	Open(l Link, key Key, acc Access) (Lease, error)
	// Deliver hands a notification that arrived on link l to the exposure
	// owning key. It never blocks, and returns false once the agent has
	// begun closing. msg becomes the receiver's: the backend must not reuse
	// it.
	Deliver(l Link, key Key, msg []byte) bool
	// LinkLost reports that link l broke or ended: the exposures whose key
	// was presented on l hear that their peer is lost (cause, or
	// [ErrRemoteLost] if nil). Report every link that ends for a reason other
	// than this agent's own choice (a reaped idle connection is no loss);
	// links that never presented a key are ignored, so reporting them is
	// harmless.
	LinkLost(l Link, cause error)
	// Refused counts an access the backend refused before it could name an
	// exposure (malformed requests, frames from unidentified peers).
	Refused()
	// Device returns the agent's device-memory driver ([Agent.Device]),
	// for backends that copy device memory themselves ([DeviceDirect]):
	// an error wrapping [devmem.ErrUnavailable] where there is none. The
	// first call may load the CUDA driver.
	Device() (devmem.Driver, error)
}

// host is the agent's Host for one backend.
type host struct {
	a      *Agent
	log    *slog.Logger
	ctx    context.Context
	stages bool // the backend reaches device memory through staged leases
}

func (h *host) ID() uuid.UUID            { return h.a.id }
func (h *host) Logger() *slog.Logger     { return h.log }
func (h *host) Context() context.Context { return h.ctx }
func (h *host) Open(l Link, key Key, acc Access) (Lease, error) {
	return h.a.open(l, key, acc, h.stages)
}
func (h *host) Deliver(l Link, key Key, msg []byte) bool { return h.a.deliver(l, key, msg) }
func (h *host) LinkLost(l Link, cause error)             { h.a.linkLost(l, cause) }
func (h *host) Refused()                                 { h.a.refused.Add(1) }
func (h *host) Device() (devmem.Driver, error)           { return h.a.Device() }
