package nats

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"
)

// A store check asks the server, rather than the watch, about the bucket
// and the suspects' keys: a suspect whose key still holds the put last
// heard from it (or none, expired) departed; a key holding another put,
// or a bucket gone or created anew, means the watch no longer hears the
// store, and is re-created. It decides departures that no echo of this
// process's heartbeats can: the Registry has no Members, or their puts
// fail (refused for size, permissions, a full account), or the bucket was
// replaced under the watch.
//
// The check is sound for the same reason the echo is: it is sent after the
// suspect's deadline, so a put the suspect stored before it is in the
// answer. Behind a lag longer than its timeout it answers nothing, and
// leaves the suspect to the echoes.

// checkWithin bounds a store check: one heartbeat, from 250 ms to 2 s.
func checkWithin(hb time.Duration) time.Duration {
	return min(max(hb, 250*time.Millisecond), 2*time.Second)
}

// recheckEvery rate-limits the bucket checks that failing heartbeats ask
// for.
const recheckEvery = time.Second

// storeCheck is the answer to one store check.
type storeCheck struct {
	at      time.Time // when it was sent
	err     error     // the bucket's status could not be had
	created time.Time // the bucket's creation, when err is nil
	keys    map[uuid.UUID]keyCheck
}

// keyCheck is what the store holds under one suspect's key.
type keyCheck struct {
	rev uint64 // of the put it holds; 0 with err
	err error  // jetstream.ErrKeyNotFound: none (deleted, purged or expired)
}

// bucketGoneErr says whether err means the bucket does not exist.
func bucketGoneErr(err error) bool {
	return errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, jetstream.ErrBucketNotFound)
}

// bucketCreated returns when the bucket's stream was created; it tells a
// bucket created anew under the same name from the one watched.
func (r *Registry) bucketCreated(ctx context.Context) (time.Time, error) {
	st, err := r.kv.Status(ctx)
	if err != nil {
		return time.Time{}, err
	}
	if s, ok := st.(interface{ StreamInfo() *jetstream.StreamInfo }); ok && s.StreamInfo() != nil {
		return s.StreamInfo().Created, nil
	}
	return time.Time{}, nil
}

// checkStore runs one store check of the bucket and of ids' keys, and
// hands the answer to the watcher. It is a goroutine of r.wg.
func (r *Registry) checkStore(ids []uuid.UUID, within time.Duration) {
	defer r.wg.Done()
	res := storeCheck{at: time.Now(), keys: make(map[uuid.UUID]keyCheck, len(ids))}
	ctx, cancel := context.WithTimeout(r.ctx, within)
	defer cancel()
	res.created, res.err = r.bucketCreated(ctx)
	if res.err == nil {
		for _, id := range ids {
			var kc keyCheck
			e, err := r.kv.Get(ctx, id.String())
			if err == nil {
				kc.rev = e.Revision()
			}
			kc.err = err
			res.keys[id] = kc
		}
	}
	select {
	case r.checked <- res:
	case <-r.ctx.Done():
	}
}

// judgeByStore declares departed every suspect whose key, in res, holds
// the put last heard from it, or none. It returns the first suspect whose
// key holds another put (the watch missed it), if any.
func (r *Registry) judgeByStore(res storeCheck) (missed uuid.UUID, found bool) {
	r.mu.Lock()
	var gone []uuid.UUID
	for id, kc := range res.keys {
		p, ok := r.live[id]
		// Heard since, or silent only since the check was sent.
		if !ok || !p.suspect || p.heard.Add(2*p.hb).After(res.at) {
			continue
		}
		switch {
		case errors.Is(kc.err, jetstream.ErrKeyNotFound):
			gone = append(gone, id)
		case kc.err != nil:
		case kc.rev == p.rev:
			gone = append(gone, id)
		case !found:
			missed, found = id, true
		}
	}
	r.mu.Unlock()
	for _, id := range gone {
		r.depart(id, "silent", 0)
	}
	return missed, found
}

// setStuck records that a suspect has waited for a verdict for long (nil:
// none has).
func (r *Registry) setStuck(err error) {
	r.mu.Lock()
	r.stuckErr = err
	r.mu.Unlock()
}

// stuckAfter is how many of its heartbeats past its deadline a suspect
// may wait for a verdict before Err says presence lags.
const stuckAfter = 8

func stuckError(id uuid.UUID, waited time.Duration, lastErr error) error {
	if lastErr != nil {
		return fmt.Errorf("agent %s is silent, and for %v neither an echo of this process's heartbeats nor the store (last: %w) has confirmed it departed", id, waited.Round(time.Millisecond), lastErr)
	}
	return fmt.Errorf("agent %s is silent, and for %v neither an echo of this process's heartbeats nor the store has confirmed it departed", id, waited.Round(time.Millisecond))
}
