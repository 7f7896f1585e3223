package agent

import (
	"context"
	"github.com/google/uuid"
)

// Backend moves bytes between agents. It is the contract every transport
// implements (in-process copy, TCP, cross-memory attach, UCX); later
// capabilities arrive as optional interfaces such as Registrar.
//
// Implementations must be safe for concurrent use. A Backend serves one
// agent: Start is called once, before any other method, and Close once, last.
type Backend interface {
	// Name is the backend's short, stable name ("mem", "tcp"); it names the
	// backend in connection metadata, errors and operation reports.
	Name() string
	// Start binds the backend to its agent and returns the connection
	// information remote agents need to reach it (for example a listen
	// address). It may start goroutines, which Close stops.
	Start(h Host) (connInfo []byte, err error)
	// Supports reports whether the backend can move memory of kind k.
	Supports(k MemKind) bool
	// Reachable reports whether the backend can reach the remote agent
	// described by info. A nil error means yes; otherwise the error says
	// why not, and the agent tries the next backend. Most backends judge
	// from info alone; one that must do I/O to know (cma's trial read)
	// returns when ctx is done, with an error wrapping context.Cause(ctx).
	Reachable(ctx context.Context, info Info) error
	// Post starts x and returns without waiting for it. The backend must call
	// x.Finish exactly once, after which it no longer touches x's local
	// memory. If x.Notify is non-nil the backend delivers it to the remote
	// agent under x.Key after every byte of x is in place and before calling
	// x.Finish(nil). An error from Post means x was not started and Finish
	// must not be called.
	Post(x *Xfer) error
	// Notify sends msg to the remote agent under key, best effort, without
	// waiting for the remote to process it.
	Notify(peer Info, key Key, msg []byte) error
	// Close stops the backend and its goroutines. Transfers still in flight
	// finish with an error.
	Close() error
}

// Counting is an optional Backend interface for backends that count what
// their peers did wrong, by kind. Agent.Stats collects the counters under
// the backend's name.
type Counting interface {
	// Stats returns the backend's counters since it started. It is safe
	// for concurrent use, also after Close.
	Stats() BackendStats
}

// BackendStats are a backend's counters of what its peers did wrong: the
// connections it dropped on a peer's account, by kind, and the requests it
// refused without dropping the connection. Each dropped connection counts
// in Disconnected and in exactly one kind. A connection the peer closed, or
// that the agent's own Close ended, counts nowhere. Each backend's Stats
// type documents what falls under each kind for its protocol.
type BackendStats struct {
	// Disconnected counts the connections dropped on a peer's account:
	// the sum of the four kinds below, as far as they cost a connection.
	Disconnected uint64
	// HandshakeFailures counts connections whose handshake was malformed,
	// named another agent or none, or was abandoned halfway.
	HandshakeFailures uint64
	// ProtocolErrors counts malformed or out-of-place frames, in either
	// direction.
	ProtocolErrors uint64
	// LimitRejected counts connections closed, or requests dropped, for
	// going over a limit: connections per peer or address, handshakes in
	// progress, a request's size or pieces, a notification's size.
	LimitRejected uint64
	// Timeouts counts connections cut because a peer was silent, too
	// slow, or left a request unanswered.
	Timeouts uint64
	// Denied counts requests answered "access denied", the connection
	// kept: unknown, revoked or forged keys, the wrong access kind,
	// addresses outside the exposed regions.
	Denied uint64
}

// KeyedReacher is an optional Backend interface for backends whose reach
// of a peer can depend on holding one of the peer's keys: cma, whose peer,
// on a host where Yama restricts ptrace (ptrace_scope 1), lets a process
// read its memory only after that process presented a key of one of its
// exposures. When the agent chooses a backend for a transfer it calls
// ReachableWithKey, instead of Reachable, with the request's key and the
// access the transfer needs of the remote exposure (AccessRead for OpRead).
// It has Reachable's contract otherwise; a backend passes the key only to
// the agent its info names.
type KeyedReacher interface {
	ReachableWithKey(ctx context.Context, info Info, key Key, acc Access) error
}

// Departer is an optional Backend interface for backends that keep state
// per remote agent, such as connections. Agent.PeerDeparted calls it after
// aborting the peer's transfers: the backend drops what it holds for peer
// at once, failing whatever still waits on it with cause, instead of
// waiting for its own timeouts to notice a peer that may have gone silent
// rather than closed its connections. Transfers posted later reconnect.
type Departer interface {
	PeerDeparted(peer uuid.UUID, cause error)
}

// Host is the agent as its backends see it: the only way a backend reaches
// back into the agent. Its methods are safe for concurrent use.
type Host interface {
	// ID is the local agent's identity.
	ID() uuid.UUID
	// Open grants the peer on link l a lease on the exposure named by key
	// for access acc.
	// Every byte the backend touches on a remote agent's behalf must be
	// reached through Lease.Slice while the lease is held, and the lease
	// released promptly: revocation waits for outstanding leases. Refused
	// accesses return an error wrapping ErrAccessDenied and are counted.
	Open(l Link, key Key, acc Access) (Lease, error)
	// Deliver hands a notification that arrived on link l to the exposure
	// owning key. It never blocks, and returns false once the agent is
	// closed.
	Deliver(l Link, key Key, msg []byte) bool
	// LinkLost reports that link l broke or ended: the exposures whose key
	// was presented on l hear that their peer is lost. Report every link
	// that ends for a reason other than this agent's own choice (a reaped
	// idle connection is no loss); links that never presented a key are
	// ignored, so reporting them is harmless.
	LinkLost(l Link, cause error)
	// Refused counts an access the backend refused before it could name an
	// exposure (malformed requests, frames from unidentified peers).
	Refused()
}

// Info is an agent's public metadata: its identity and, per backend, the
// information a remote agent needs to connect. It travels inside tokens.
type Info struct {
	ID    uuid.UUID
	Conns []ConnInfo
}

// ConnInfo is one backend's connection information.
type ConnInfo struct {
	Backend string
	Data    []byte
}

// Conn returns the connection information published for backend name.
func (i Info) Conn(name string) ([]byte, bool) {
	for _, c := range i.Conns {
		if c.Backend == name {
			return c.Data, true
		}
	}
	return nil, false
}
