package serve

import (
	"errors"
	"fmt"
	"net"
	"sync/atomic"

	"github.com/goxfer/goxfer/agent"
)

// Kind is why a connection was dropped on its peer's account: one of the
// kinds of agent.BackendStats.
type Kind uint8

// The kinds of dropped connections, named after the agent.BackendStats
// fields that count them.
const (
	// HandshakeFailure: a handshake that was malformed, named another
	// agent or none, or ended before it was complete.
	HandshakeFailure Kind = iota + 1
	// ProtocolError: a malformed or out-of-place frame.
	ProtocolError
	// LimitRejected: over a limit (connections per key, handshakes in
	// progress, a frame's size).
	LimitRejected
	// TimedOut: a peer silent or too slow (agent.BackendStats.Timeouts).
	TimedOut
)

func (k Kind) String() string {
	switch k {
	case HandshakeFailure:
		return "handshake failure"
	case ProtocolError:
		return "protocol error"
	case LimitRejected:
		return "limit rejected"
	case TimedOut:
		return "timeout"
	default:
		return fmt.Sprintf("Kind(%d)", uint8(k))
	}
}

// Classes names a backend's error sentinels, so that Counters.Dropped can
// tell which kind of drop an error marks.
type Classes struct {
	// Limit marks an error as LimitRejected. It is checked before Protocol,
	// so it may wrap Protocol (both backends' errLimit does).
	Limit error
	// Protocol marks an error as ProtocolError, or HandshakeFailure when it
	// broke off a handshake.
	Protocol error
	// Timeouts mark errors as TimedOut besides those that are a net.Error
	// whose Timeout() is true (deadlines): tcp's errStalled, a peer that
	// keeps a request unanswered.
	Timeouts []error
}

// Kind returns the kind of drop that err marks, and whether it marks one:
// in this order, err matching Limit is LimitRejected; matching Timeouts or
// a net.Error timeout, TimedOut; any other error that broke off a
// handshake (inHandshake; a short read included), HandshakeFailure;
// matching Protocol, ProtocolError. Anything else, nil included, is not
// the peer's fault (an end of stream, a reset, the backend's own close) and
// marks none.
func (cl *Classes) Kind(err error, inHandshake bool) (Kind, bool) {
	if err == nil {
		return 0, false
	}
	if cl.Limit != nil && errors.Is(err, cl.Limit) {
		return LimitRejected, true
	}
	if isTimeout(err) {
		return TimedOut, true
	}
	for _, t := range cl.Timeouts {
		if t != nil && errors.Is(err, t) {
			return TimedOut, true
		}
	}
	if inHandshake {
		return HandshakeFailure, true
	}
	if cl.Protocol != nil && errors.Is(err, cl.Protocol) {
		return ProtocolError, true
	}
	return 0, false
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// Counters are a backend's counts of what its peers did wrong, behind
// agent.BackendStats. A dropped connection is counted once, by Drop or
// Dropped, in exactly one kind; Disconnected is not a counter of its own
// but the sum of the four kinds, so it can never disagree with them, even
// in a snapshot taken while drops are counted. Deny counts a refused
// request whose connection is kept.
//
// The zero Counters count nothing yet and classify only timeouts and
// handshakes: set Classes before first use (in the backend's constructor)
// for Dropped to recognise the backend's own sentinels. A Counters must not
// be copied after first use. Safe for concurrent use; counting is a single
// atomic add.
type Counters struct {
	// Classes are the backend's sentinels, for Dropped. Set once, before
	// the Counters are shared.
	Classes Classes

	kinds  [TimedOut + 1]atomic.Uint64 // by Kind; [0] unused
	denied atomic.Uint64
}

// Drop counts one connection dropped for kind. It panics if kind is not one
// of the four.
func (c *Counters) Drop(kind Kind) {
	if kind < HandshakeFailure || kind > TimedOut {
		panic(fmt.Sprintf("serve: Counters.Drop of %v", kind))
	}
	c.kinds[kind].Add(1)
}

// Dropped counts a connection that ended with err, which broke off its
// handshake if inHandshake, under the kind Classes.Kind finds, and returns
// that kind; it counts nothing and reports false if err was not the peer's
// fault. The caller decides whether the drop is also a refusal the agent
// counts (agent.Host.Refused); both backends count those of handshakes and
// of protocol errors and limits, and not of timeouts after the handshake.
// A connection that ends because the backend is closing (Set.Stopping)
// should not reach Dropped.
func (c *Counters) Dropped(err error, inHandshake bool) (Kind, bool) {
	k, ok := c.Classes.Kind(err, inHandshake)
	if ok {
		c.kinds[k].Add(1)
	}
	return k, ok
}

// Deny counts a request answered "access denied", the connection kept.
func (c *Counters) Deny() { c.denied.Add(1) }

// Stats returns the counts so far, Disconnected being the sum of the four
// kinds read.
func (c *Counters) Stats() agent.BackendStats {
	s := agent.BackendStats{
		HandshakeFailures: c.kinds[HandshakeFailure].Load(),
		ProtocolErrors:    c.kinds[ProtocolError].Load(),
		LimitRejected:     c.kinds[LimitRejected].Load(),
		Timeouts:          c.kinds[TimedOut].Load(),
		Denied:            c.denied.Load(),
	}
	s.Disconnected = s.HandshakeFailures + s.ProtocolErrors + s.LimitRejected + s.Timeouts
	return s
}

// Delta returns what each counter moved by from before to after, two
// snapshots of the same Counters (after the later): what tests compare.
func Delta(after, before agent.BackendStats) agent.BackendStats {
	return agent.BackendStats{
		Disconnected:      after.Disconnected - before.Disconnected,
		HandshakeFailures: after.HandshakeFailures - before.HandshakeFailures,
		ProtocolErrors:    after.ProtocolErrors - before.ProtocolErrors,
		LimitRejected:     after.LimitRejected - before.LimitRejected,
		Timeouts:          after.Timeouts - before.Timeouts,
		Denied:            after.Denied - before.Denied,
	}
}
