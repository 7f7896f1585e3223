package ucx

import (
	"sync/atomic"

	"github.com/goxfer/goxfer/agent"
)

// Both builds count ([agent.Counting]) and drop departed peers
// ([agent.Departer]); without the ucx tag there is nothing to count or drop.
var (
	_ agent.Counting = (*Backend)(nil)
	_ agent.Departer = (*Backend)(nil)
)

// Stats are the backend's counters since it started ([agent.BackendStats]),
// for the ucx protocol. Unlike tcp's, the kinds also count messages refused
// on their own: a malformed message, or one naming no connection, cannot
// cost a connection, so a kind may exceed its share of Disconnected. A
// connection whose peer closed it or died (a goodbye, a UCX endpoint
// error), one dropped by [Backend.PeerDeparted], and one this agent's own
// Close ends count nowhere.
//
//   - HandshakeFailures: connection requests (hellos) refused for naming
//     another agent than this one or none, or a worker address UCX cannot
//     connect to, and connections dropped because the peer's worker
//     answered as another agent than the token named.
//   - ProtocolErrors: messages dropped as malformed or out of place, in
//     either direction: undecodable, of an unknown type, sent as
//     rendezvous, naming no connection of this backend, a grant for no
//     lease request (the late answer to a request of a cancelled transfer
//     is none) or a malformed one. A lease requested twice on one
//     connection, or a malformed READ request, also drops the connection.
//   - LimitRejected: connection requests beyond 4096 connections and
//     connections holding more than 1024 leases (both dropped); lease
//     requests of more ranges than allowed and notifications over 64 KiB
//     (dropped messages).
//   - Timeouts: connections cut because a peer was silent: a connection or
//     lease request of this side unanswered within [WithTimeout], or no
//     message (heartbeats included) from a connected peer for that long.
//   - Denied: lease requests refused by this (exposing) side, the
//     connection kept: an unknown, revoked or forged key, the wrong access
//     kind, a range outside the exposed regions, or memory this side could
//     not map or hand a key for.
//
// Without the ucx build tag every counter stays 0.
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

// drop counts a connection dropped or refused on its peer's account, in
// the kind c.
func (s *stats) drop(c *atomic.Uint64) {
	c.Add(1)
	s.disconnected.Add(1)
}
