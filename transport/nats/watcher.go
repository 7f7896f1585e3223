package nats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/goxfer/goxfer/connect"
)

// run is the watcher goroutine: it applies the bucket's updates to the
// table, times silences with one timer, and re-creates the watch when the
// connection comes back or the watch ends.
//
// Silence counts only while this process listens. The check timer is due
// at least every half of the shortest heartbeat among the live agents, so a
// wakeup later than it was due means the process did not run (SIGSTOP, a
// VM pause, CPU starvation): that time is nobody's silence, and the
// updates queued meanwhile in the socket must be applied before anyone is
// judged. The time lost is credited to every agent instead.
func (r *Registry) run(w jetstream.KeyWatcher, created time.Time, status chan nats.Status) {
	defer r.wg.Done()
	defer r.nc.RemoveStatusListener(status)
	defer func() {
		if w != nil {
			_ = w.Stop()
		}
	}()

	check := time.NewTimer(time.Hour)
	check.Stop()
	rewatch := time.NewTimer(time.Hour)
	rewatch.Stop()
	defer check.Stop()
	defer rewatch.Stop()
	backoff := 50 * time.Millisecond
	var due time.Time // when check is due; zero: not armed
	// listened credits the time since a missed check to every agent.
	listened := func(now time.Time) {
		if !due.IsZero() && now.After(due) {
			r.credit(now.Sub(due), now)
		}
		due = time.Time{}
	}

	deaf := false    // the connection is down or the watch is being re-created
	failing := 0     // consecutive failed re-watches
	shouted := false // that presence is down, at Error level
	watched := time.Now()
	resume := func(why error) {
		if w != nil {
			_ = w.Stop()
			w = nil
		}
		r.setDeaf(why)
		deaf = true
		rewatch.Reset(0)
	}

	// Store checks: one in flight at a time.
	checking := false
	var suspects []uuid.UUID
	var shortest time.Duration
	var lastCheck time.Time
	var lastCheckErr error
	wantBucket := false // a heartbeat failed: is the bucket still there?
	startCheck := func(now time.Time) {
		if checking || deaf || r.nc.Status() != nats.CONNECTED {
			return
		}
		if len(suspects) == 0 && !(wantBucket && now.Sub(lastCheck) >= recheckEvery) {
			return
		}
		checking, wantBucket, lastCheck = true, false, now
		r.wg.Add(1)
		go r.checkStore(slices.Clone(suspects), checkWithin(shortest))
	}
	judge := func(now time.Time) {
		var longest uuid.UUID
		var waited time.Duration
		suspects, longest, waited = r.expire(now)
		if waited > 0 {
			r.setStuck(stuckError(longest, waited, lastCheckErr))
		} else {
			r.setStuck(nil)
		}
		startCheck(now)
	}

	for {
		var updates <-chan jetstream.KeyValueEntry
		if w != nil {
			updates = w.Updates()
		}
		select {
		case <-r.ctx.Done():
			return
		case e, ok := <-updates:
			switch {
			case !ok && r.ctx.Err() != nil:
				return // Close: the watch ends with r.ctx
			case !ok:
				// A closing or reconnecting connection ends the watch as a
				// matter of course; only a watch that ends on a healthy
				// connection is worth a warning.
				level := slog.LevelDebug
				if r.nc.Status() == nats.CONNECTED {
					level = slog.LevelWarn
				}
				r.log.Log(r.ctx, level, "goxfer/nats: registry watch ended; re-creating it", "bucket", r.bucket)
				w = nil
				resume(errors.New("the watch ended; re-creating it"))
			case e != nil:
				r.apply(e)
			}
		case st := <-status:
			switch st {
			case nats.CONNECTED:
				// The old watch's consumer may be gone with the server.
				resume(errors.New("reconnected; re-creating the watch"))
			case nats.CLOSED:
				if w != nil {
					_ = w.Stop()
					w = nil
				}
				deaf = true
				r.setDeaf(nats.ErrConnectionClosed)
			default:
				deaf = true
				r.setDeaf(fmt.Errorf("the connection is %v", st))
			}
		case <-r.recheck:
			// A heartbeat failed: the server may have lost the bucket
			// while the watch, on a consumer that went with it, stays
			// quiet.
			wantBucket = true
			startCheck(time.Now())
		case res := <-r.checked:
			checking = false
			if deaf || res.at.Before(watched) {
				break // about a watch since replaced
			}
			// Updates the watch has already delivered count first.
			r.drain(w)
			lastCheckErr = res.err
			switch {
			case bucketGoneErr(res.err):
				r.log.Warn("goxfer/nats: registry bucket is gone; re-creating the watch", "bucket", r.bucket)
				resume(errors.New("the bucket vanished"))
			case res.err != nil:
			case !created.IsZero() && !res.created.Equal(created):
				r.log.Warn("goxfer/nats: registry bucket was created anew under its watch; re-creating the watch",
					"bucket", r.bucket, "watched", created, "now", res.created)
				resume(fmt.Errorf("the bucket was created anew at %v", res.created))
			default:
				if id, missed := r.judgeByStore(res); missed {
					r.log.Warn("goxfer/nats: registry's watch missed a put that the store holds; re-creating the watch",
						"bucket", r.bucket, "agent", id)
					resume(fmt.Errorf("the watch missed a put of agent %s that the store holds", id))
				}
			}
		case <-rewatch.C:
			if r.nc.Status() != nats.CONNECTED {
				continue // CONNECTED will come
			}
			nw, ncreated, gone, err := r.watch()
			if err != nil {
				if r.ctx.Err() != nil {
					return
				}
				failing++
				r.setDeaf(fmt.Errorf("re-watch attempt %d failed: %w", failing, err))
				// Reconnecting, a watch may fail once or twice; more, or a
				// bucket that is gone for good, and presence is not
				// working: say so, once.
				level := slog.LevelDebug
				if !shouted && (failing >= 3 || gone) {
					level, shouted = slog.LevelError, true
				}
				r.log.Log(r.ctx, level, "goxfer/nats: registry cannot watch its bucket; it hears no arrivals or departures until it can; retrying",
					"bucket", r.bucket, "err", err, "attempts", failing, "retry_in", backoff)
				rewatch.Reset(backoff)
				backoff = min(2*backoff, 2*time.Second)
				continue
			}
			if shouted {
				r.log.Warn("goxfer/nats: registry watches its bucket again", "bucket", r.bucket, "attempts", failing)
			}
			w, created, deaf, backoff, failing, shouted = nw, ncreated, false, 50*time.Millisecond, 0, false
			watched = time.Now()
			r.setDeaf(nil)
			r.restartSilence(watched.Add(r.grace))
			r.pokeMembers()
		case <-r.echoed:
			now := time.Now()
			listened(now)
			if !deaf && r.nc.Status() == nats.CONNECTED {
				judge(now)
			}
		case <-check.C:
			now := time.Now()
			listened(now)
			if deaf || r.nc.Status() != nats.CONNECTED {
				break
			}
			if late := r.unechoed(now); late > 0 {
				// Stored, acknowledged, and still not delivered: the watch
				// is broken without saying so, and would judge nobody.
				r.log.Warn("goxfer/nats: registry's own heartbeat has not come back through its watch; re-creating the watch",
					"bucket", r.bucket, "late", late)
				resume(fmt.Errorf("a heartbeat of this process acknowledged %v ago has not come back through the watch", late.Round(time.Millisecond)))
				break
			}
			judge(now)
		}
		if deaf {
			r.setStuck(nil) // Err says why it hears nothing
		}
		now := time.Now()
		listened(now)
		var next time.Time
		var ok bool
		if next, shortest, ok = r.nextExpiry(); ok && !deaf {
			due = now.Add(shortest / 2)
			if !next.IsZero() && next.Before(due) {
				due = next
			}
			check.Reset(due.Sub(now))
		} else {
			check.Stop()
		}
	}
}

// drain applies the updates w has already delivered, without waiting.
func (r *Registry) drain(w jetstream.KeyWatcher) {
	if w == nil {
		return
	}
	for {
		select {
		case e, ok := <-w.Updates():
			if !ok {
				return // the main loop sees it closed
			}
			if e != nil {
				r.apply(e)
			}
		default:
			return
		}
	}
}

// watch creates a watch of the bucket, re-creating the bucket first if it
// vanished and the registry may; it returns the watch and when the bucket
// it watches was created (zero if unknown), and whether the bucket was
// found gone.
func (r *Registry) watch() (w jetstream.KeyWatcher, created time.Time, gone bool, err error) {
	// Asked before the watch starts: a bucket created anew in between has
	// a later time than this one, and a later check tells.
	ctx, cancel := context.WithTimeout(r.ctx, createWithin)
	created, err = r.bucketCreated(ctx)
	cancel()
	if bucketGoneErr(err) {
		gone = true
		if err = r.recreateBucket(); err != nil {
			return nil, time.Time{}, gone, err
		}
		ctx, cancel := context.WithTimeout(r.ctx, createWithin)
		created, _ = r.bucketCreated(ctx)
		cancel()
	}
	w, err = r.kv.WatchAll(r.ctx)
	if err != nil && r.ctx.Err() == nil && !gone && r.bucketGone() {
		gone = true
		if err = r.recreateBucket(); err == nil {
			ctx, cancel := context.WithTimeout(r.ctx, createWithin)
			created, _ = r.bucketCreated(ctx)
			cancel()
			w, err = r.kv.WatchAll(r.ctx)
		}
	}
	return w, created, gone, err
}

// bucketGone says whether the bucket is missing from the server.
func (r *Registry) bucketGone() bool {
	ctx, cancel := context.WithTimeout(r.ctx, createWithin)
	defer cancel()
	_, err := r.js.KeyValue(ctx, r.bucket)
	return errors.Is(err, jetstream.ErrBucketNotFound)
}

// recreateBucket creates the bucket again after it vanished (the server
// lost its store), if the registry may create it.
func (r *Registry) recreateBucket() error {
	if !r.o.createBucket {
		return errors.New("the bucket vanished, and WithCreateBucket(false) forbids re-creating it; create it again")
	}
	if _, err := createBucket(r.ctx, r.nc, r.js, r.o); err != nil {
		return err
	}
	r.log.Warn("goxfer/nats: registry bucket vanished (did the server lose its JetStream store?); re-created it and re-joined the members",
		"bucket", r.bucket)
	return nil
}

// setDeaf records why the watcher cannot hear the bucket (nil: it can).
func (r *Registry) setDeaf(err error) {
	r.mu.Lock()
	r.deafErr = err
	r.mu.Unlock()
}

// pokeMembers makes every joined Member put its entry now: after a
// re-watch, the bucket may be a fresh one, and peers count silence from
// their own re-watch.
func (r *Registry) pokeMembers() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for m := range r.members {
		select {
		case m.poke <- struct{}{}:
		default:
		}
	}
}

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
	if !r.heard(id, ent, e.Revision()) {
		return
	}
	r.echo(id, ent.seq)
}

// heard records that agent id put e at revision rev, so is present now;
// it returns false, ignoring e, when e is the last put of an agent already
// declared departed, delivered again by a re-watch.
func (r *Registry) heard(id uuid.UUID, e entry, rev uint64) bool {
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
	conns := make([]*connect.Connector, 0, len(r.members))
	for m := range r.members {
		if m.id != id {
			conns = append(conns, m.c)
		}
	}
	r.mu.Unlock()
	switch {
	case known && why == "silent":
		r.log.Info("goxfer/nats: agent departed: no heartbeat for two intervals", "bucket", r.bucket, "agent", id, "heartbeat", p.hb)
	case known:
		r.log.Debug("goxfer/nats: agent left", "bucket", r.bucket, "agent", id)
	}
	for _, c := range conns {
		c.PeerDeparted(id)
	}
}

// expire declares departed every agent silent for two of its heartbeats,
// and returns those it cannot judge yet (suspects), and the one that has
// waited longest for a verdict, for how long past its deadline.
//
// Silence by this machine's clock is not enough when the path from the
// server to this process lags (the server or this process starved, a
// congested link): the heartbeats are late, not missing; nor when the
// watch went deaf without saying so (the bucket was deleted and created
// anew under it). So a silent agent is a suspect until one of two answers
// comes: one of this process's own heartbeats, sent two heartbeats after
// the agent was last heard, comes back through the watch (the agent's puts
// due before it would have been stored, and heard, first; the Members put
// at once when there are suspects, so the answer comes within a round
// trip), or a store check sent after then finds the agent's key still
// holding its last put heard, or none (see storeCheck). A Registry never
// judges its own joined Members: they are present while joined, and Err
// reports their failing heartbeats.
func (r *Registry) expire(now time.Time) (suspects []uuid.UUID, longest uuid.UUID, waited time.Duration) {
	r.mu.Lock()
	var gone []uuid.UUID
	for id, p := range r.live {
		deadline := p.heard.Add(2 * p.hb)
		switch {
		case now.Before(deadline) || r.ownLocked(id):
		case !r.echoAt.Before(deadline):
			gone = append(gone, id)
		default:
			p.suspect = true
			suspects = append(suspects, id)
			if w := now.Sub(deadline); w > stuckAfter*p.hb && w > waited {
				longest, waited = id, w
			}
		}
	}
	r.mu.Unlock()
	if len(suspects) > 0 {
		r.pokeMembers()
	}
	for _, id := range gone {
		r.depart(id, "silent", 0)
	}
	return suspects, longest, waited
}

// ownLocked says whether id is a joined Member's; r.mu is held.
func (r *Registry) ownLocked(id uuid.UUID) bool {
	for m := range r.members {
		if m.id == id && m.joined.Load() {
			return true
		}
	}
	return false
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

// restartSilence counts every live agent's silence from at, after a
// period in which nobody could be heard.
func (r *Registry) restartSilence(at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	// Judge nobody before a heartbeat sent now comes back.
	r.echoAt = time.Time{}
	for _, p := range r.live {
		if at.After(p.heard) {
			p.heard = at
		}
	}
}

// credit adds lost, a time in which the registry did not run, to every
// live agent's allowance of silence, up to now.
func (r *Registry) credit(lost time.Duration, now time.Time) {
	r.mu.Lock()
	var shortest time.Duration
	for _, p := range r.live {
		if p.heard.Before(now) {
			p.heard = p.heard.Add(lost)
			if p.heard.After(now) {
				p.heard = now
			}
		}
		if shortest == 0 || p.hb < shortest {
			shortest = p.hb
		}
	}
	r.mu.Unlock()
	if shortest > 0 && lost >= shortest {
		r.log.Warn("goxfer/nats: registry did not run for a while (process paused or starved); that time counts as nobody's silence",
			"bucket", r.bucket, "lost", lost)
	}
}

// nextExpiry returns when the first live agent's silence would make it
// departed (zero if all are suspects), and the shortest heartbeat among
// the live agents; ok is false when there are none.
func (r *Registry) nextExpiry() (next time.Time, shortest time.Duration, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, p := range r.live {
		// A suspect is judged when an answer comes, or at the next check.
		if t := p.heard.Add(2 * p.hb); !p.suspect && !r.ownLocked(id) && (next.IsZero() || t.Before(next)) {
			next = t
		}
		if shortest == 0 || p.hb < shortest {
			shortest = p.hb
		}
	}
	return next, shortest, shortest > 0
}
