package agent

import (
	"context"

	"github.com/google/uuid"
)

// Backend moves bytes between agents: the contract every transport
// implements (in-process copy, TCP, cross-memory attach, UCX). The agent
// calls it; users of the agent never do. This is the implementer's guide;
// the package doc is the user's.
//
// # Implementing a backend
//
// Required: the methods below. Implementations must be safe for concurrent
// use. A Backend serves one agent. Start is called once, before any other
// method, and Close once, last; between the two every other method may be
// called from any goroutine. Close is also called when the agent fails to
// start (an invalid option, a backend given twice, this or another
// backend's Start failing): then Start may have failed, or never have been
// called, and Close must cope.
//
// The backend sees the agent only through the [Host] given to Start: the
// local agent's identity, its logger (where the backend logs dropped
// connections and back-offs), a lifetime context, and the four calls
// through which remote accesses reach local memory ([Host.Open] for a
// lease, [Host.Deliver] for a notification, [Host.LinkLost] for a broken
// channel, [Host.Refused] for a malformed request). The backend sees a
// transfer only through its [*Work]: what to move, where, and the calls
// that end it ([Work.Finish], or [Parts] for a transfer moved in parts).
// A span of a transfer (a frame, a lease, a chunk) is cut with [Span] and
// walked piece by piece with [Work.Pieces].
//
// Closing, in order: [Agent.Close] cancels every transfer in flight and
// waits until the backends have finished each one; it revokes every
// exposure (waiting for the leases backends hold); it cancels every
// backend's [Host.Context] with cause [ErrClosed] and waits for the calls
// still inside a backend (a Reachable or Notify that began before
// Agent.Close: they must end once Host.Context is done); then it calls each
// backend's Close, once, in preference order. No other method is called
// after Close. From the start of Agent.Close, Host.Deliver returns false
// and Host.Open refuses with [ErrRemoteLost].
//
// Optional interfaces, each checked with a type assertion when the agent
// needs it; a backend that lacks one is not asked and loses nothing else:
//
//   - [Registrar]: memory must be prepared (pinned, registered with a NIC)
//     before use. Without it, [Agent.Register] records the region only.
//   - [KeyedReacher]: whether the peer is reachable depends on the key the
//     transfer presents (cma under Yama ptrace_scope 1). Without it, the
//     agent calls Reachable and the key is not shown to the backend.
//   - [Departer]: the backend keeps state per peer (connections) that
//     [Agent.PeerDeparted] should drop at once. Without it, the transfers
//     are aborted by the agent and the backend notices the peer's loss by
//     its own means (timeouts, a closed socket).
//   - [Counting]: the backend counts what its peers did wrong. Without it,
//     [Agent.Stats] has no entry for the backend.
//   - [DeviceStager]: the backend reaches a peer's memory only through the
//     peer's leases, so the peer's agent can stage its device memory.
//     Without it, transfers whose remote memory is VRAM go to another
//     backend, unless this one Supports VRAM itself.
//   - [DeviceDirect]: for some peers and transfers, the backend moves
//     device memory on both sides itself (cma: CUDA IPC on one host).
//     Without it, the agent stages local device memory for a backend that
//     does not Support VRAM.
//
// Device memory: a backend that does not support VRAM never sees it on the
// local side: the agent stages local device memory through pinned host
// buffers and posts the backend plain DRAM transfers, chunk by chunk.
//
// Options a backend takes are validated when they are applied; an invalid
// one yields an error wrapping [ErrInvalidOption], prefixed with the
// backend's name ("tcp: ...").
type Backend interface {
	// Name is the backend's short, stable name ("mem", "tcp"); it names the
	// backend in connection metadata, errors and operation reports. The
	// connect package's tokens carry it: 1 to 32 bytes of [a-z0-9._-].
	Name() string
	// Start binds the backend to its agent and returns the connection
	// information remote agents need to reach it (for example a listen
	// address; connect's tokens carry at most 4096 bytes). It may start
	// goroutines, which Close stops; h.Context is cancelled just before
	// Close. The backend keeps h for its lifetime.
	Start(h Host) (connInfo []byte, err error)
	// Supports reports whether the backend can move memory of kind k. It
	// must not block.
	Supports(k MemKind) bool
	// Reachable reports whether the backend can reach the remote agent
	// described by info: a nil error means yes; otherwise the error says
	// why not, and the agent tries the next backend. The agent asks before
	// every transfer and notification. A backend may do I/O to know (cma
	// connects and makes a trial read): it must then return once ctx is
	// done, with an error wrapping context.Cause(ctx), and should cache its
	// verdict. info comes from a peer: quote its text (%q) in errors.
	Reachable(ctx context.Context, info Info) error
	// Post starts w and returns without waiting for it. The backend must
	// call w.Finish exactly once (directly or through Parts), possibly
	// before Post returns, after which it no longer touches w's local
	// memory. It finishes a cancelled transfer ([Work.Cancelled],
	// [Work.AfterCancel]) promptly, with [Work.CancelErr]. If w.Notify is
	// non-nil the backend delivers it (reading it only: callers share it)
	// to the remote agent under w.Key after every byte of w is in place:
	// by finishing with [Work.FinishNotify] (or through Parts, which does),
	// or with the data, for the peer to deliver once it landed and before
	// it acknowledges (tcp's one-frame WRITE). An error from Post means w
	// was not started and Finish must not be called.
	Post(w *Work) error
	// Notify sends msg to the remote agent under key, best effort, without
	// waiting for the remote to process it. msg stays the caller's: the
	// backend neither changes it nor keeps it once Notify returns (one that
	// queues it copies it). Where it may block (connecting to the peer,
	// waiting for a writer or for queue room) it returns once ctx is done,
	// with an error wrapping context.Cause(ctx).
	Notify(ctx context.Context, peer Info, key Key, msg []byte) error
	// Close stops the backend and waits for its goroutines. When the
	// agent calls it, every transfer posted has finished, every exposure is
	// revoked and the Host's Context is cancelled (see above).
	Close() error
}

// Counting is an optional [Backend] interface for backends that count what
// their peers did wrong, by kind. [Agent.Stats] collects the counters under
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

// KeyedReacher is an optional [Backend] interface for backends whose reach
// of a peer can depend on holding one of the peer's keys: cma, whose peer,
// on a host where Yama restricts ptrace (ptrace_scope 1), lets a process
// read its memory only after that process presented a key of one of its
// exposures. When the agent chooses a backend for a transfer it calls
// ReachableWithKey, instead of Reachable, with the request's key and the
// access the transfer needs of the remote exposure ([AccessRead] for
// [OpRead]); for notifications, which name no exposure, it calls
// Reachable. It has Reachable's contract otherwise; a backend passes the
// key only to the agent its info names.
type KeyedReacher interface {
	ReachableWithKey(ctx context.Context, info Info, key Key, acc Access) error
}

// Departer is an optional [Backend] interface for backends that keep state
// per remote agent, such as connections. [Agent.PeerDeparted] calls it
// after aborting the peer's transfers: the backend drops what it holds for peer
// at once, failing whatever still waits on it with cause, instead of
// waiting for its own timeouts to notice a peer that may have gone silent
// rather than closed its connections. Transfers posted later reconnect.
type Departer interface {
	PeerDeparted(peer uuid.UUID, cause error)
}

// Info is an agent's public metadata ([Agent.Info]): its identity and, per
// backend, the information a remote agent needs to connect. It travels
// inside tokens; one received from a peer is untrusted input.
type Info struct {
	ID    uuid.UUID
	Conns []ConnInfo
}

// ConnInfo is one backend's connection information, as its
// [Backend.Start] returned it.
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

// DeviceStager is an optional [Backend] interface for backends that touch
// a peer's memory only through the leases the peer's agent grants
// ([Host.Open], [Lease.Slice]): tcp, cma, mem. For such a backend the
// exposing agent stages device memory itself: [Lease.Slice] on a VRAM
// region returns a pinned host buffer, filled from the device for a READ
// lease; for a WRITE lease the backend fills it and calls [Lease.Flush]
// once the whole payload is in, before acknowledging it (what is not
// flushed never reaches the device). The active side's agent then lets the
// backend move transfers whose remote memory is VRAM. A backend that
// implements it must read or write the bytes Slice returns only, never the
// region's address; it calls [Lease.Prepare] with a frame's size before
// its Slices when it knows it (one staging buffer, one wait in
// [Lease.Ready] for a READ), and should keep the spans of one lease small
// (a frame, a chunk): each is staged whole.
type DeviceStager interface {
	// StagesDevice reports whether the backend reaches device memory
	// through staged leases. It must not block.
	StagesDevice() bool
}

// DeviceDirect is an optional [Backend] interface for backends that, for
// some peers, move device memory on both sides themselves: cma maps a
// same-host peer's GPU allocations (CUDA IPC) and copies between them and
// local memory, device or host, on the GPU. For a transfer that involves
// device memory on either side, the agent asks the chosen backend, after
// Reachable, whether it moves this one directly; if so the backend gets
// the local device memory as it is (a [Piece]'s LocalAddr, no bytes), no
// staging, and the transfer's [Xfer.Path] is the backend's name, "+", and
// the path named. Otherwise the agent stages local device memory as for
// any backend that does not Support VRAM.
type DeviceDirect interface {
	// DirectDevice reports whether the backend moves a transfer of segs
	// with peer (reached already) without the agent's staging, and names
	// how ("ipc"). It must not block.
	DirectDevice(peer Info, segs []Segment) (path string, ok bool)
}

// Publisher is an optional [Backend] interface for backends that hand
// peers a way to reach exposed memory without asking the agent for each
// access: cma publishes the exposures that lie in shared host memory
// (package shm) to its same-host peers, which map the segments and check a
// revocation word before each copy, and those of other host memory, which
// they copy with cross-memory attach after checking the same word. The
// agent calls Publish for every new exposure of memory in shared segments
// and every new exposure of a single region (the backend ignores those it
// cannot serve), before [Agent.Expose] returns (so before any peer can
// hold its key), and Unpublish once when
// it is revoked, after no new lease can be granted and before
// [Exposure.Revoke] waits for the leases: Unpublish returns only once no
// peer can touch the memory through what Publish handed out, bounded by
// the backend's own timeouts. closing says the agent is closing (peers
// should hear "lost", not "revoked"). Neither may block on a peer beyond
// that bound, nor call back into Expose or Revoke. Without it, every
// access goes through [Host.Open].
type Publisher interface {
	Publish(x Published)
	Unpublish(x Published, closing bool)
}

// Published is an exposure as a [Publisher] sees it.
type Published struct{ e *Exposure }

// Key returns the exposure's key.
func (x Published) Key() Key { return x.e.key }

// Access returns the access the exposure grants.
func (x Published) Access() Access { return x.e.access }

// Regions returns the exposure's regions, sorted by address.
func (x Published) Regions() []Region { return x.e.regions() }

// Bind records that the peer on l used the exposure, having proved it
// holds its key, as a lease would: the peer becomes the exposure's peer if
// it has none, and the loss of l reaches it ([Host.LinkLost]). It works
// also once the exposure is revoked (from Unpublish).
func (x Published) Bind(l Link) {
	x.e.mu.Lock()
	x.e.bind(l)
	x.e.mu.Unlock()
}

func stagesDevice(b Backend) bool {
	s, ok := b.(DeviceStager)
	return ok && s.StagesDevice()
}
