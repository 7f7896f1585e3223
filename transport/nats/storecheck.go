package nats

import (
	"context"
	"errors"
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
