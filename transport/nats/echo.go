package nats

import (
	"slices"
	"time"

	"github.com/google/uuid"
)

// sentPut is one of a Member's puts whose echo has not come back yet.
type sentPut struct {
	at      time.Time
	seq     uint64 // in the entry: the echo names its put
	rev     uint64 // 0 until acknowledged (and for ever if the ack was lost)
	lost    bool   // unanswered: maybe never stored
	refused bool   // the store refused it
}

// maxSends bounds the puts a Member remembers until their echo comes:
// behind a lag, an echo of a put forgotten gives no answer, never a wrong
// one.
const maxSends = 64

// sending records that Member m puts its entry now.
func (r *Registry) sending(m *Member) *sentPut {
	sp := &sentPut{at: time.Now(), seq: nextSeq()}
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(m.sends) >= maxSends {
		m.sends = slices.Delete(m.sends, 0, len(m.sends)-maxSends+1)
	}
	m.sends = append(m.sends, sp)
	return sp
}

// acked records that m's put sp was stored at revision rev.
func (r *Registry) acked(m *Member, sp *sentPut, rev uint64) {
	r.mu.Lock()
	sp.rev = rev
	if sp.at.After(r.ackedSent) {
		r.ackedSent, r.ackedRev = sp.at, rev
	}
	r.storedLocked(m, slices.Index(m.sends, sp), "acknowledged")
	r.mu.Unlock()
}

// refusedPut records that the store refused put sp: it answered.
func (r *Registry) refusedPut(sp *sentPut) {
	r.mu.Lock()
	sp.refused = true
	r.mu.Unlock()
}

// lostPut records that put sp went unanswered: it may not have been
// stored (no stream leader, no quorum, no route to them), or its
// acknowledgement lags.
func (r *Registry) lostPut(sp *sentPut) {
	r.mu.Lock()
	sp.lost = true
	r.mu.Unlock()
}

// storedLocked takes m's put i as stored (acknowledged, or echoed): a put
// of m's sent before it that went unanswered and has not come back
// through the watch, which would have delivered it first, was never
// stored. The store took none of m's heartbeats then, and likely nobody
// else's (an election of the stream's leader, a quorum lost, the path to
// it cut): that silence is everybody's, and is counted from now, as after
// a reconnection. r.mu is held.
func (r *Registry) storedLocked(m *Member, i int, how string) {
	if i <= 0 {
		return
	}
	var gap time.Duration
	kept := m.sends[:0]
	for j, sp := range m.sends {
		if j < i && sp.lost {
			gap = max(gap, time.Since(sp.at))
			continue
		}
		kept = append(kept, sp)
	}
	clear(m.sends[len(kept):])
	m.sends = kept
	if gap == 0 {
		return
	}
	r.restartSilenceLocked(time.Now())
	r.log.Info("goxfer/nats: the registry's store takes heartbeats again after leaving some unstored; everybody's silence counts from now",
		"bucket", r.bucket, "agent", m.id, "stored", how, "unstored_since", gap.Round(time.Millisecond))
}

// unsureLocked says whether a put of a Member waits for its answer, or
// went unanswered and has not been found stored or lost since: the store
// may be taking nobody's heartbeats now, unknown to its leader's view of
// its quorum. r.mu is held.
func (r *Registry) unsureLocked() bool {
	for m := range r.members {
		for _, sp := range m.sends {
			if sp.rev == 0 && !sp.refused {
				return true
			}
		}
	}
	return false
}

// echo records that the watch delivered agent id's entry numbered seq: if
// id is one of this process's Members, that put came back, and with it
// every put stored before it. The echo names its put exactly: a put
// delivered again by a re-watch, a stranger's copy of an entry, or a put
// forgotten behind a long lag, is no put of those waiting, and proves
// nothing. An echo thus never looks younger than it is.
func (r *Registry) echo(id uuid.UUID, seq uint64) {
	if seq == 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for m := range r.members {
		if m.id != id {
			continue
		}
		r.echoedLocked(m, slices.IndexFunc(m.sends, func(sp *sentPut) bool { return sp.seq == seq }))
	}
}

// echoedLocked takes m's put i, and the older ones, as echoed.
func (r *Registry) echoedLocked(m *Member, i int) {
	if i < 0 {
		return
	}
	sp := m.sends[i]
	r.storedLocked(m, i, "echoed")
	if sp.at.After(r.echoAt) {
		r.echoAt = sp.at
		r.wakeEchoedLocked()
	}
	m.sends = m.sends[slices.Index(m.sends, sp)+1:]
}

func (r *Registry) wakeEchoedLocked() {
	select {
	case r.echoed <- struct{}{}:
	default:
	}
}

// unechoed returns how long ago the oldest put of a Member that the
// server acknowledged, but the watch has not delivered in eight of its
// heartbeats, was sent; 0 if there is none.
func (r *Registry) unechoed(now time.Time) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	var late time.Duration
	for m := range r.members {
		for _, sp := range m.sends {
			if d := now.Sub(sp.at); sp.rev != 0 && d > 8*m.hb {
				late = max(late, d)
			}
		}
	}
	return late
}
