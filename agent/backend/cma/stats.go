package cma

import (
	"fmt"

	"github.com/goxfer/goxfer/agent"
)

// Stats are the backend's counters since it started ([agent.BackendStats]),
// for the control connections of the cma protocol:
//
//   - HandshakeFailures: accepted connections whose handshake was malformed,
//     named another agent or none, claimed another process than the
//     socket's (SO_PEERCRED), or ended before it was complete.
//   - ProtocolErrors: connections dropped for a malformed frame, in either
//     direction.
//   - LimitRejected: connections closed for going over a limit: connections
//     per process ([WithMaxConnsPerProcess]), handshakes in progress
//     ([WithMaxHandshakes], the oldest closed), ranges in a lease request, a
//     notification's size, or leases held at once.
//   - Timeouts: connections cut because a peer was too slow: a handshake,
//     or a frame once begun, not complete within the timeout
//     ([WithTimeout]), or a lease request of ours, or the end of a staged
//     WRITE of ours (its copy into the peer's GPU memory), unanswered that
//     long, or a grant the peer would not read for that long.
//   - Denied: lease requests answered "access denied", the connection kept.
//
// On systems other than Linux every counter stays 0.
type Stats = agent.BackendStats

// errLimit marks a peer that went over one of this agent's limits; it wraps
// errProtocol, and is counted apart.
var errLimit = fmt.Errorf("%w: over a limit", errProtocol)
