package cma

import (
	"errors"
	"fmt"
	"net"
	"sync/atomic"
)

// Stats are a backend's counters since it started: the control connections
// it dropped because of what a peer did, by kind, and the lease requests it
// refused without dropping the connection. Each dropped connection counts in
// Disconnected and in exactly one kind. A connection that a peer closes, or
// that this agent's own Close ends, counts nowhere.
type Stats struct {
	// Disconnected counts the connections this backend dropped on a peer's
	// account: the sum of the four kinds below.
	Disconnected uint64
	// HandshakeFailures counts accepted connections whose handshake was
	// malformed, named another agent or none, claimed another process than
	// the socket's (SO_PEERCRED), or ended before it was complete.
	HandshakeFailures uint64
	// ProtocolErrors counts connections dropped for a malformed frame, in
	// either direction.
	ProtocolErrors uint64
	// LimitRejected counts connections closed for going over a limit:
	// connections per process (WithMaxConnsPerProcess), handshakes in
	// progress (WithMaxHandshakes, the oldest closed), ranges in a lease
	// request, a notification's size, or leases held at once.
	LimitRejected uint64
	// Timeouts counts connections cut because a peer was too slow: a
	// handshake, or a frame once begun, not complete within the timeout
	// (WithTimeout), or a lease request of ours unanswered that long.
	Timeouts uint64
	// Denied counts lease requests answered "access denied", the
	// connection kept.
	Denied uint64
}

// Counters returns the same counters as Stats, keyed by snake_case name,
// for agent.Stats (the agent.Counting interface). Safe for concurrent use.
func (b *Backend) Counters() map[string]uint64 {
	s := b.Stats()
	return map[string]uint64{
		"disconnected":       s.Disconnected,
		"handshake_failures": s.HandshakeFailures,
		"protocol_errors":    s.ProtocolErrors,
		"limit_rejected":     s.LimitRejected,
		"timeouts":           s.Timeouts,
		"denied":             s.Denied,
	}
}

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
