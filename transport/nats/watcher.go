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
	// A watch is opened off the loop (it may wait long for JetStream: a
	// consumer needs a stream leader), one at a time; one asked for
	// meanwhile (again) starts when it ends, its result discarded.
	opened := make(chan openedWatch, 1)
	opening, again := false, false
	defer func() {
		if opening {
			if o := <-opened; o.w != nil {
				_ = o.w.Stop()
			}
		}
	}()
	resume := func(why error) {
		if w != nil {
			r.stopWatch(w)
			w = nil
		}
		r.setDeaf(why)
		deaf = true
		if opening {
			again = true
		} else {
			rewatch.Reset(0)
		}
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
					r.stopWatch(w)
					w = nil
				}
				deaf = true
				again = again || opening
				r.setDeaf(nats.ErrConnectionClosed)
			default:
				deaf = true
				again = again || opening // a watch opened now may be on a lost server
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
			if opening || r.nc.Status() != nats.CONNECTED {
				continue // it ends, or CONNECTED comes
			}
			opening = true
			r.wg.Add(1)
			go func() {
				defer r.wg.Done()
				var o openedWatch
				o.w, o.created, o.gone, o.err = r.openWatch()
				opened <- o
			}()
		case o := <-opened:
			opening = false
			if again {
				// Asked for before a later reconnection, or a watch that
				// ended meanwhile: open another.
				if o.w != nil {
					r.stopWatch(o.w)
				}
				again = false
				rewatch.Reset(0)
				continue
			}
			if o.err != nil {
				if r.ctx.Err() != nil {
					return
				}
				failing++
				r.setDeaf(fmt.Errorf("re-watch attempt %d failed: %w", failing, o.err))
				// Reconnecting, a watch may fail once or twice; more, or a
				// bucket that is gone for good, and presence is not
				// working: say so, once.
				level := slog.LevelDebug
				if !shouted && (failing >= 3 || o.gone) {
					level, shouted = slog.LevelError, true
				}
				r.log.Log(r.ctx, level, "goxfer/nats: registry cannot watch its bucket; it hears no arrivals or departures until it can; retrying",
					"bucket", r.bucket, "err", o.err, "attempts", failing, "retry_in", backoff)
				rewatch.Reset(backoff)
				backoff = min(2*backoff, 2*time.Second)
				continue
			}
			if shouted {
				r.log.Warn("goxfer/nats: registry watches its bucket again", "bucket", r.bucket, "attempts", failing)
			}
			w, created, deaf, backoff, failing, shouted = o.w, o.created, false, 50*time.Millisecond, 0, false
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
			due = time.Time{} // not listening for silence: no time to credit
		}
	}
}

// stopWatch stops w off the watcher's loop: stopping deletes its consumer,
// a JetStream call that waits up to its timeout (5 s) when the consumer's
// server is cut off or gone, and the loop must not wait with it.
func (r *Registry) stopWatch(w jetstream.KeyWatcher) {
	r.wg.Go(func() { _ = w.Stop() })
}

// openedWatch is what an openWatch off the watcher's loop found.
type openedWatch struct {
	w       jetstream.KeyWatcher
	created time.Time
	gone    bool
	err     error
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

// openWatch creates a watch of the bucket, re-creating the bucket first if it
// vanished and the registry may; it returns the watch and when the bucket
// it watches was created (zero if unknown), and whether the bucket was
// found gone.
func (r *Registry) openWatch() (w jetstream.KeyWatcher, created time.Time, gone bool, err error) {
	createdNow := func() (time.Time, error) {
		ctx, cancel := context.WithTimeout(r.ctx, createWithin)
		defer cancel()
		return r.bucketCreated(ctx)
	}
	// recreate re-creates the bucket found gone, if the registry may, and
	// asks when anew.
	recreate := func() error {
		gone = true
		if err := r.recreateBucket(); err != nil {
			return err
		}
		created, _ = createdNow()
		return nil
	}
	// Asked before the watch starts: a bucket created anew in between has
	// a later time than this one, and a later check tells.
	created, err = createdNow()
	if bucketGoneErr(err) {
		if err = recreate(); err != nil {
			return nil, time.Time{}, gone, err
		}
	}
	w, err = r.kv.WatchAll(r.ctx)
	if err != nil && r.ctx.Err() == nil && !gone && r.bucketGone() {
		if err = recreate(); err == nil {
			w, err = r.kv.WatchAll(r.ctx)
		}
	}
	return w, created, gone, err
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
