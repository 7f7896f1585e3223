package connect

import "github.com/goxfer/goxfer/agent"

// BackendStats are one backend's counters of what its peers did wrong: the
// connections it dropped on a peer's account, by kind (HandshakeFailures,
// ProtocolErrors, LimitRejected, Timeouts; Disconnected is their sum), and
// the requests it refused without dropping the connection (Denied). The
// backends' Stats types ([tcp.Stats], [cma.Stats]) say what falls under
// each kind.
type BackendStats = agent.BackendStats

// Stats are a Connector's counters since it started: what remote peers
// asked for and were refused, and what the backends dropped on a peer's
// account. They are for monitoring: a steady rise in Refused or in a
// backend's LimitRejected or ProtocolErrors means a misconfigured or
// hostile peer is knocking (see docs/security.md).
type Stats struct {
	// Refused counts remote accesses this Connector's agent refused: forged
	// or revoked tokens, out-of-range addresses, the wrong access kind,
	// malformed requests.
	Refused uint64
	// DroppedNotifications counts notifications that arrived for no known
	// operation, or while its queue was full.
	DroppedNotifications uint64
	// LostNotifications counts this side's completion notifications that
	// could not be sent after a transfer succeeded (the connection to the
	// peer broke at that moment): the active operation's success stands,
	// and the passive side sees the broken connection as ErrRemoteLost.
	LostNotifications uint64
	// Registered, Exposed and InFlight are gauges of what is open now:
	// memory regions registered, passive operations whose memory is still
	// exposed, and transfers on their way. An idle Connector whose
	// operations were all closed shows zeros; a steady climb means
	// operations are not being closed.
	Registered, Exposed, InFlight int
	// Backends holds, per backend name ("tcp", "cma", "ucx"), the counters
	// of backends that keep them ([agent.Counting]); mem keeps none.
	Backends map[string]BackendStats
}

// Stats returns the Connector's counters. The result is a fresh copy the
// caller owns. Safe for concurrent use, also after Close.
func (c *Connector) Stats() Stats {
	st := c.a.Stats()
	return Stats{
		Refused:              st.Refused,
		DroppedNotifications: st.DroppedNotifications,
		LostNotifications:    st.LostNotifications,
		Registered:           st.Registered,
		Exposed:              st.Exposed,
		InFlight:             st.InFlight,
		Backends:             st.Backends,
	}
}
