package cma

import (
	"errors"
	"fmt"
	"net"
	"sync/atomic"

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
//     ([WithTimeout]), or a lease request of ours unanswered that long.
//   - Denied: lease requests answered "access denied", the connection kept.
//
// On systems other than Linux every counter stays 0.
type Stats = agent.BackendStats

type stats struct {
	disconnected, handshake, protocol, limit, timeouts, denied atomic.Uint64
}

func (s *stats) snapshot() Stats {
	return Stats{
		Disconnected:      s.disconnected.Load(),
		HandshakeFailures: s.handshake.Load(),
		ProtocolErrors:    s.protocol.Load(),
		LimitRejected:     s.limit.Load(),
		Timeouts:          s.timeouts.Load(),
		Denied:            s.denied.Load(),
	}
}

// errLimit marks a peer that went over one of this agent's limits; it wraps
// errProtocol, and is counted apart.
var errLimit = fmt.Errorf("%w: over a limit", errProtocol)

// dropped counts a connection ended by err, which broke off a handshake if
// inHandshake. It reports whether err was the peer's fault.
func (s *stats) dropped(err error, inHandshake bool) bool {
	var ne net.Error
	switch {
	case err == nil:
		return false
	case errors.Is(err, errLimit):
		s.limit.Add(1)
	case errors.As(err, &ne) && ne.Timeout():
		s.timeouts.Add(1)
	case inHandshake:
		s.handshake.Add(1)
	case errors.Is(err, errProtocol):
		s.protocol.Add(1)
	default:
		return false
	}
	s.disconnected.Add(1)
	return true
}

// limited counts a connection closed for going over a limit before it got a
// goroutine of its own.
func (s *stats) limited() {
	s.limit.Add(1)
	s.disconnected.Add(1)
}
