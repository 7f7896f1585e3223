package connect

import (
	"fmt"
	"time"
)

// Role says which side of an operation a Connector played.
type Role uint8

const (
	// RoleActive: the side that moved the bytes ([Connector.BeginRead],
	// [Connector.BeginWrite]).
	RoleActive Role = iota + 1
	// RolePassive: the side that exposed its memory to a peer
	// ([Connector.CreateReadable], [Connector.CreateWritable]).
	RolePassive
)

// String returns "active" or "passive".
func (r Role) String() string {
	switch r {
	case RoleActive:
		return "active"
	case RolePassive:
		return "passive"
	}
	return fmt.Sprintf("Role(%d)", uint8(r))
}

// OpReport describes one finished operation, for the observer given to
// [WithObserver]. It is a value the observer owns.
type OpReport struct {
	// Kind is the operation's access: [KindRead] for CreateReadable and
	// BeginRead, [KindWrite] for CreateWritable and BeginWrite.
	Kind OperationKind
	// Role is the side this Connector played.
	Role Role
	// Backend names the backend that moved the bytes ("mem", "cma",
	// "tcp", "ucx"), and Path how ([ReadOperation.Path]). Both are empty
	// for a transfer the agent could not start, and on the passive side,
	// which the peer does not tell.
	Backend, Path string
	// Bytes is the operation's length: the sum of its descriptors' sizes.
	Bytes uint64
	// Duration runs, on the active side, from the Begin call to the end of
	// the transfer; on the passive side, from the Create call to the
	// outcome's being recorded (see [WithObserver]), so it includes the
	// wait for a peer: how long the memory stayed exposed.
	Duration time.Duration
	// Status is the outcome: [StatusComplete], [StatusCancelled] or
	// [StatusErrored].
	Status Status
	// Err is nil for a completed operation, else the error its Wait
	// returns (or, for a transfer that could not start, Begin returned).
	Err error
}

// WithObserver makes the Connector call observe once for every operation
// that finishes, with what it was and how it ended; metrics exporters
// (metrics/promconnect) count and time operations with it.
//
// Reported are: every operation BeginRead or BeginWrite returned, when its
// transfer ends; every transfer the agent could not start (Begin returned a
// [*TransferError] with an empty Backend); and every passive operation, when
// its outcome is recorded: by the Wait, Status or Close that takes the
// peer's report, or by Close or the expiry ([WithExpiry]) when no peer
// reported. Calls Begin and Create refuse outright (invalid arguments, a
// closed Connector, a token that does not resolve) are not reported, nor
// are a [Connector.Expose]'s events.
//
// observe runs on the goroutine that finishes the operation: a backend's,
// the caller of Begin (a small transfer may finish inside it), or the one
// calling Wait, Status or Close. It is called concurrently for different
// operations, and before the operation's Wait returns. It must not block
// nor call into the Connector: it holds up the transfer's completion and,
// on the passive side, the operation's other calls.
//
// Default: none. Given twice, the last one counts; nil is invalid.
func WithObserver(observe func(OpReport)) Option {
	return optionFunc(func(o *options) error {
		if observe == nil {
			return fmt.Errorf("%w: WithObserver(nil)", ErrInvalidOption)
		}
		o.observe = observe
		return nil
	})
}
