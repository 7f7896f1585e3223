package tcp

import (
	"errors"

	"github.com/goxfer/goxfer/agent"
)

// Stats are the backend's counters since it started ([agent.BackendStats]),
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
//     connections per address ([WithMaxConnsPerIP]) or per peer
//     ([WithMaxConnsPerPeer]), handshakes in progress ([WithMaxHandshakes],
//     the oldest closed), a request's bytes ([WithMaxFrameSize]) or pieces
//     ([WithMaxPieces]), or a notification's size (64 KiB).
//   - Timeouts: connections cut because a peer was silent or too slow: a
//     handshake not complete within the keepalive timeout, a frame or an
//     answer moving less than 64 KiB in a timeout, a keepalive it took no
//     byte of in a timeout, or a request of ours left unanswered that long
//     while the peer kept pinging.
//   - Denied: requests answered "access denied", the connection kept: an
//     unknown, revoked or forged key, the wrong access kind, a piece outside
//     the exposed regions or across two of them.
//
// The agent's own count of refusals ([agent.Stats].Refused) sees most of
// these too; Stats says which kind each was.
type Stats = agent.BackendStats

// Stats returns the backend's counters. Safe for concurrent use, also
// after Close.
func (b *Backend) Stats() Stats { return b.stats.Stats() }

// errStalled marks a peer that kept a request of ours unanswered.
var errStalled = errors.New("tcp: request unanswered")

// dropped counts a connection ended by err, which broke off a handshake if
// inHandshake, and logs it at level Debug with args. It reports whether err
// was the peer's fault.
func (b *Backend) dropped(err error, inHandshake bool, args ...any) bool {
	if _, ok := b.stats.Dropped(err, inHandshake); !ok {
		return false
	}
	b.log.Debug("dropped a connection", append(args, "err", err)...)
	return true
}
