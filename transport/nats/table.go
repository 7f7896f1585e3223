package nats

import (
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/goxfer/goxfer/connect"
)

// apply records one update of the bucket.
func (r *Registry) apply(e jetstream.KeyValueEntry) {
	id, err := uuid.Parse(e.Key())
	if err != nil {
		r.log.Warn("goxfer/nats: registry entry with a key that is no agent ID; ignored", "bucket", r.bucket, "key", e.Key())
		return
	}
	if e.Operation() != jetstream.KeyValuePut {
		r.depart(id, "left", e.Revision())
		return
	}
	ent, err := decodeEntry(e.Value())
	if err == nil && ent.info.ID() != id {
		err = fmt.Errorf("entry under key %s describes agent %s", id, ent.info.ID())
	}
	if err != nil {
		r.log.Warn("goxfer/nats: undecodable registry entry; ignored", "bucket", r.bucket, "key", e.Key(), "err", err)
		return
	}
	if !r.hear(id, ent, e.Revision()) {
		return
	}
	r.echo(id, ent.seq)
}

// hear records that agent id put e at revision rev, so is present now;
// it returns false, ignoring e, when e is the last put of an agent already
// declared departed, delivered again by a re-watch.
func (r *Registry) hear(id uuid.UUID, e entry, rev uint64) bool {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	p, known := r.live[id]
	if !known {
		if d, ok := r.departed[id]; ok && d.rev != 0 && d.rev == rev && d.seq == e.seq &&
			(r.ttl == 0 || now.Sub(d.at) < r.ttl) {
			return false
		}
		p = &peer{heard: now}
		r.live[id] = p
		delete(r.departed, id)
	}
	p.info, p.hb, p.suspect = e.info, e.hb, false
	if rev != 0 {
		p.rev, p.seq = rev, e.seq
	}
	if now.After(p.heard) {
		p.heard = now
	}
	if !known {
		r.notifyLocked(Presence{ID: id, Info: e.info})
	}
	return true
}

// depart declares id gone: it leaves the table, joined Connectors are told,
// and watchers hear of it.
//
// A delete marker (why "left", at revision rev) forgets the agent's last
// put: a re-watch delivers the marker, not the put.
func (r *Registry) depart(id uuid.UUID, why string, rev uint64) {
	r.mu.Lock()
	p, known := r.live[id]
	if d, already := r.departed[id]; already && !known {
		// Its delete marker again (a re-watch delivers it anew): it was
		// declared departed once, and has not come back since.
		if rev != 0 {
			d.rev, d.seq = 0, 0
			r.departed[id] = d
		}
		r.mu.Unlock()
		return
	}
	delete(r.live, id)
	if len(r.departed) >= maxDeparted {
		var oldest uuid.UUID
		var at time.Time
		for k, d := range r.departed {
			if at.IsZero() || d.at.Before(at) {
				oldest, at = k, d.at
			}
		}
		delete(r.departed, oldest)
	}
	d := departure{at: time.Now()}
	if known && rev == 0 {
		d.rev, d.seq = p.rev, p.seq
	}
	r.departed[id] = d
	var info connect.AgentInfo
	if known {
		info = p.info
	}
	r.notifyLocked(Presence{ID: id, Info: info, Departed: true})
	// An agent heard alive that deleted its entry is told after a grace
	// (departLater); the marker of one never heard alive (a re-watch, a
	// Registry opened after it left) races nothing, and a silent agent
	// is declared: told at once.
	later := why == "left" && known
	var conns []*connect.Connector
	if !later {
		conns = r.othersLocked(id)
	}
	r.mu.Unlock()
	switch {
	case known && why == "silent":
		r.log.Info("goxfer/nats: agent departed: no heartbeat for two intervals", "bucket", r.bucket, "agent", id, "heartbeat", p.hb)
	case known:
		r.log.Debug("goxfer/nats: agent left", "bucket", r.bucket, "agent", id)
	}
	if later {
		r.departLater(id, d.at)
		return
	}
	for _, c := range conns {
		c.PeerDeparted(id)
	}
}

// departLater tells the joined Connectors that id left (its departure
// recorded at at), one heartbeat after its entry was deleted, unless it is
// back by then, or left again since (that departure's own grace tells), or
// the Registry closes. An agent deletes its entry (Member.Leave) before it
// closes its Connector, which then sends the notifications it owes and
// says goodbye over every backend connection: the grace lets those arrive
// first, so that an exposure the agent read or wrote just before it left
// completes instead of failing with ErrRemoteLost. (The deletion travels
// over NATS, the notification over the backend: nothing orders the two
// here.) A process that dies between Leave and Close drops its
// connections, which the backends notice at once, or is declared after
// the grace.
func (r *Registry) departLater(id uuid.UUID, at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		t := time.NewTimer(r.hb)
		defer t.Stop()
		select {
		case <-t.C:
		case <-r.ctx.Done():
			return
		}
		r.mu.Lock()
		_, back := r.live[id]
		d, gone := r.departed[id]
		conns := r.othersLocked(id)
		r.mu.Unlock()
		if back || gone && !d.at.Equal(at) {
			return
		}
		for _, c := range conns {
			c.PeerDeparted(id)
		}
	}()
}

// othersLocked returns the Connectors of the joined Members other than id.
// r.mu is held.
func (r *Registry) othersLocked(id uuid.UUID) []*connect.Connector {
	conns := make([]*connect.Connector, 0, len(r.members))
	for m := range r.members {
		if m.id != id {
			conns = append(conns, m.c)
		}
	}
	return conns
}
