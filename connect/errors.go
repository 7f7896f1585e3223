package connect

import (
	"errors"
	"fmt"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
)

// Sentinel errors, matched with [errors.Is]. The first six are the agent's
// own sentinels ([agent.ErrClosed], ...) re-exported, so an error from any layer (connect, agent, a
// backend) matches the same value.
var (
	// ErrClosed reports use of a closed Connector or operation, and ends the
	// Waits in progress when one is closed (for an active operation, joined
	// to ErrCancelled).
	ErrClosed = agent.ErrClosed
	// ErrCancelled reports an operation cancelled before it completed: by
	// Cancel, by the context given to BeginRead, BeginWrite or an active
	// Wait (the error then matches the context's error too), by
	// [Connector.Close], or by the peer.
	ErrCancelled = agent.ErrCancelled
	// ErrRemoteLost reports a peer that died, became unreachable or stopped
	// answering keepalives.
	ErrRemoteLost = agent.ErrRemoteLost
	// ErrAccessDenied reports an access the exposing side refused: its
	// operation was closed, or the token does not grant it.
	ErrAccessDenied = agent.ErrAccessDenied
	// ErrNoBackend reports that no backend both sides share can move the
	// memory involved, or that the forced backend is not configured.
	ErrNoBackend = agent.ErrNoBackend
	// ErrInvalidOption reports an invalid or conflicting [Option] given to
	// [NewConnector], or to a backend ([WithTCPOptions], [WithCMAOptions],
	// [WithUCX]): every backend's option errors wrap this one value.
	ErrInvalidOption = agent.ErrInvalidOption

	// ErrKindMismatch reports metadata of the wrong kind: a READ token given
	// to [Connector.BeginWrite], or a WRITE token given to
	// [Connector.BeginRead].
	ErrKindMismatch = errors.New("connect: operation kind mismatch")
	// ErrSizeMismatch reports local descriptors that do not match the remote
	// ones in number or, index by index, in size.
	ErrSizeMismatch = errors.New("connect: size mismatch")
	// ErrInvalidMetadata reports a token that cannot be decoded: not
	// base64url, truncated, damaged, of another version, or malformed.
	ErrInvalidMetadata = errors.New("connect: invalid metadata")
	// ErrInvalidDescriptor reports a descriptor that names no memory: an
	// empty buffer, a zero Descriptor, a null pointer or an invalid Device.
	ErrInvalidDescriptor = errors.New("connect: invalid descriptor")
	// ErrExpired reports an exposure the Connector closed because no peer
	// used it for as long as [WithExpiry] allows: a passive operation's
	// Wait, and an [Exposure]'s last event and Err, return it.
	ErrExpired = errors.New("connect: exposure expired unused")
	// ErrReleased reports a peer that gave back a token it will not use
	// ([Connector.Release]): a passive operation's Wait, or an [Exposure]'s
	// event for that peer, returns it in a [*TransferError].
	ErrReleased = errors.New("connect: token released")
	// ErrNotStarted reports, in an [Exposure]'s event, a peer's transfer
	// that could not start (no backend both sides share reached this
	// side, say): no byte moved, and the peer may try again. A one-shot
	// passive operation is not ended by it.
	ErrNotStarted = errors.New("connect: the peer's transfer could not start")
)

// errPeerFailed reports a peer that told us its transfer failed; the peer's
// reason follows it in the message.
var errPeerFailed = errors.New("connect: peer reports the transfer failed")

// TransferError describes a failed or cancelled operation. Err is the cause
// and matches the sentinels above with [errors.Is] (for a transfer a
// context cancelled, also the context's error). Text the peer sent (the
// reason it gave for a failure) appears quoted in Err's message.
type TransferError struct {
	Op string // "read", "write" (active side), "readable", "writable" (passive side)
	// Peer is the peer agent's ID, as [Metadata.Agent] and
	// [ExposureEvent.Peer] give it; uuid.Nil when no peer is known.
	Peer uuid.UUID
	// Backend is the backend the transfer was posted to; "" when no
	// backend moved a byte (the transfer could not start, or its context
	// was done before it did). Passive operations leave it "".
	Backend string
	Err     error
}

// Error returns a message naming the operation, the peer and the backend.
func (e *TransferError) Error() string {
	msg := "connect: " + e.Op
	if e.Peer != uuid.Nil {
		msg += " with agent " + e.Peer.String()
	}
	if e.Backend != "" {
		msg += " over " + e.Backend
	}
	return fmt.Sprintf("%s: %v", msg, e.Err)
}

// Unwrap returns Err.
func (e *TransferError) Unwrap() error { return e.Err }
