package ucx

import (
	"sync/atomic"

	"github.com/goxfer/goxfer/agent"
)

// Both builds count (agent.Counting) and drop departed peers
// (agent.Departer); without the ucx tag there is nothing to count or drop.
var (
	_ agent.Counting = (*Backend)(nil)
	_ agent.Departer = (*Backend)(nil)
)

// Stats are a backend's counters since it started: the connections it
// dropped or refused because of what a peer did, by kind, and the requests
// and messages it refused without a connection to drop. Each dropped or
// refused connection counts in Disconnected and in exactly one kind; the
// kinds also count messages refused on their own (a malformed message, or
// one naming no connection, cannot cost a connection). A connection whose
// peer closed it or died (a goodbye, a UCX endpoint error), one dropped by
// Backend.PeerDeparted, and one that this agent's own Close ends count
// nowhere.
//
// The agent's own count of refusals (agent.Stats.Refused) sees most of
// these too; Stats says which kind each was. Without the ucx build tag
// every counter stays 0.
type Stats struct {
	// Disconnected counts the connections this backend dropped, or
	// refused to open, on a peer's account: the sum of the four kinds
	// below, as far as they count connections.
	Disconnected uint64
	// HandshakeFailures counts connection requests (hellos) refused for
	// naming another agent than this one or none, or a worker address UCX
	// cannot connect to, and connections dropped because the peer's worker
	// answered as another agent than the token named.
	HandshakeFailures uint64
	// ProtocolErrors counts messages dropped as malformed or out of place,
	// in either direction: undecodable, of an unknown type, sent as
	// rendezvous, naming no connection of this backend (forged, or late
	// for a connection since dropped), a grant for no lease request or a
	// malformed one. A lease requested twice on one connection, or a
	// malformed READ request, also drops the connection (and counts in
	// Disconnected).
	ProtocolErrors uint64
	// LimitRejected counts what went over a limit: connection requests
	// beyond 4096 connections, and connections holding more than 1024
	// leases (both dropped, counted in Disconnected); lease requests of
	// more ranges than allowed, and notifications over 64 KiB (dropped
	// messages).
	LimitRejected uint64
	// Timeouts counts connections cut because a peer was silent: a
	// connection request or a lease request of this side unanswered within
	// WithTimeout, or no message (heartbeats included) from a connected
	// peer for that long, in either direction.
	Timeouts uint64
	// Denied counts lease requests refused by this (exposing) side, the
	// connection kept: an unknown, revoked or forged key, the wrong access
	// kind, a range outside the exposed regions, or memory this side could
	// not map or hand a key for.
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

// drop counts a connection dropped or refused on its peer's account, in
// the kind c.
func (s *stats) drop(c *atomic.Uint64) {
	c.Add(1)
	s.disconnected.Add(1)
}
