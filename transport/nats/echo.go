package nats

import (
	"slices"
	"time"

	"github.com/google/uuid"
)

// sentPut is one of a Member's puts whose echo has not come back yet.
type sentPut struct {
	at  time.Time
	seq uint64 // in the entry: the echo names its put
	rev uint64 // 0 until acknowledged (and for ever if the ack was lost)
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

// acked records that sp was stored at revision rev.
func (r *Registry) acked(sp *sentPut, rev uint64) {
	r.mu.Lock()
	sp.rev = rev
	r.mu.Unlock()
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
	if at := m.sends[i].at; at.After(r.echoAt) {
		r.echoAt = at
		r.wakeEchoedLocked()
	}
	m.sends = m.sends[i+1:]
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
