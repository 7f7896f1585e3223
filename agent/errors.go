package agent

import "errors"

// Sentinel errors shared by the agent, its backends and the connect package,
// which re-exports them. Match them with [errors.Is].
var (
	// ErrClosed reports use of a closed agent or backend; joined to
	// ErrCancelled, it ends the transfers [Agent.Close] cancels.
	ErrClosed = errors.New("goxfer: closed")
	// ErrCancelled reports a transfer cancelled before it completed.
	ErrCancelled = errors.New("goxfer: operation cancelled")
	// ErrRemoteLost reports a remote agent that died, became unreachable or
	// stopped answering keepalives.
	ErrRemoteLost = errors.New("goxfer: remote agent lost")
	// ErrAccessDenied reports a remote access refused by the exposing agent:
	// unknown or revoked key, wrong access kind, or an address outside the
	// exposed regions.
	ErrAccessDenied = errors.New("goxfer: access denied")
	// ErrNoBackend reports that no backend both agents share can move the
	// memory kinds involved.
	ErrNoBackend = errors.New("goxfer: no usable backend")
	// ErrInvalid reports malformed arguments: an empty region, DRAM whose
	// bytes do not match its region, mismatched segment lengths, a request
	// with no segments or naming no peer, an unknown op or access.
	ErrInvalid = errors.New("goxfer: invalid argument")
	// ErrInvalidOption reports an option value a backend cannot use. Every
	// backend's option errors wrap it, prefixed with the backend's name
	// ("tcp: streams must be in [1, 64], got 0"); connect wraps it in its
	// own ErrInvalidOption.
	ErrInvalidOption = errors.New("goxfer: invalid option")
	// ErrStaging reports device memory that could not be staged through
	// host memory: no device driver, a copy that failed, or no staging
	// buffer free in time (see WithStaging).
	ErrStaging = errors.New("goxfer: device staging failed")
	// ErrOutOfReach reports a peer that a backend cannot reach by design,
	// not by fault: mem's peer in another process, cma's peer on another
	// host. Backends return it from Reachable through [OutOfReach]. When
	// the agent passes over such backends for the next one, it logs so at
	// Debug level only: that is the normal path; any other refusal (cma
	// denied on the same host, say) is logged at Info level.
	ErrOutOfReach = errors.New("goxfer: peer out of the backend's reach")
)

// OutOfReach returns an error with the text reason that matches
// [ErrOutOfReach]: for a backend's Reachable to say, in its own words, that
// the peer is where the backend never reaches ("peer is in another
// process").
func OutOfReach(reason string) error { return &outOfReach{reason} }

type outOfReach struct{ reason string }

func (e *outOfReach) Error() string        { return e.reason }
func (e *outOfReach) Is(target error) bool { return target == ErrOutOfReach }
