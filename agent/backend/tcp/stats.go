package tcp

import (
	"errors"
	"net"
	"sync/atomic"

	"github.com/goxfer/goxfer/agent"
)

// Stats are the backend's counters since it started (agent.BackendStats),
// for the tcp protocol:
//
//   - HandshakeFailures: accepted connections whose handshake was malformed
//     (magic, version), named no agent or another agent than this one, or
//     ended before it was complete.
//   - ProtocolErrors: connections dropped for a malformed frame: unknown
//     types, lengths that disagree, a WRITE acknowledged with data, an
//     answer to no request or with the wrong id; frames from active peers
//     and answers from passive ones.
//   - LimitRejected: connections closed for going over a limit:
//     connections per address (WithMaxConnsPerIP) or per peer
//     (WithMaxConnsPerPeer), handshakes in progress (WithMaxHandshakes, the
//     oldest closed), a request's bytes (WithMaxFrameSize) or pieces
//     (WithMaxPieces), or a notification's size (64 KiB).
//   - Timeouts: connections cut because a peer was silent or too slow: a
//     handshake not complete within the keepalive timeout, a frame or an
//     answer moving less than 64 KiB in a timeout, a keepalive it took no
//     byte of in a timeout, or a request of ours left unanswered that long
//     while the peer kept pinging.
//   - Denied: requests answered "access denied", the connection kept: an
//     unknown, revoked or forged key, the wrong access kind, a piece outside
//     the exposed regions or across two of them.
//
// The agent's own count of refusals (agent.Stats.Refused) sees most of
// these too; Stats says which kind each was.
type Stats = agent.BackendStats

type stats struct {
	disconnected, handshake, protocol, limit, timeouts, denied atomic.Uint64
}

// Stats returns the backend's counters. Safe for concurrent use.
func (b *Backend) Stats() Stats {
	s := &b.stats
	return Stats{
		Disconnected:      s.disconnected.Load(),
		HandshakeFailures: s.handshake.Load(),
		ProtocolErrors:    s.protocol.Load(),
		LimitRejected:     s.limit.Load(),
		Timeouts:          s.timeouts.Load(),
		Denied:            s.denied.Load(),
	}
}

// errStalled marks a peer that kept a request of ours unanswered.
var errStalled = errors.New("tcp: request unanswered")

// dropped counts a connection ended by err, which broke off a handshake if
// inHandshake, and logs it at level Debug with args. It reports whether err
// was the peer's fault.
func (b *Backend) dropped(err error, inHandshake bool, args ...any) bool {
	if !b.count(err, inHandshake) {
		return false
	}
	b.log.Debug("dropped a connection", append(args, "err", err)...)
	return true
}

// count counts a connection ended by err (dropped), and reports whether
// err was the peer's fault.
func (b *Backend) count(err error, inHandshake bool) bool {
	s := &b.stats
	var ne net.Error
	switch {
	case err == nil:
		return false
	case errors.Is(err, errLimit):
		s.limit.Add(1)
	case errors.Is(err, errStalled), errors.As(err, &ne) && ne.Timeout():
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
func (b *Backend) limited() {
	b.stats.limit.Add(1)
	b.stats.disconnected.Add(1)
}
