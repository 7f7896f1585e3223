package nats

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
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
// The check is sound only if its read cannot be stale: a replica that
// lags, or a stream leader cut off from the others that does not know it
// yet (it steps down only after seconds), answers with the puts it has,
// not with those stored since. So the keys are read from the stream's
// leader (a plain get, never a direct get that any replica may answer),
// and the answer counts only for a suspect whose deadline passed before
// the store was known to hold every put stored so far (fresh): before a
// Member's put, which the store acknowledged (a quorum holds it, and every
// put stored before it) before the check was sent, and which the server
// answering the check holds (a stale leader, answering after a partition
// heals until it hears the new one, does not); or, while no Member's
// put waits for its answer or went unanswered (the store may be taking
// nobody's heartbeats, an election under way, unknown to a leader's view
// of its quorum), before the last time the leader, as it answers the
// check, heard a quorum of the stream's replicas (it was still the leader
// then), or when the check was sent, for a stream of one replica. Behind a
// lag longer than its timeout it answers nothing, and leaves the suspect
// to the echoes.

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
	fresh   time.Time // the answer holds every put stored before then; zero: none known
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
	r.mu.Lock()
	acked, ackedRev, unsure := r.ackedSent, r.ackedRev, r.unsureLocked()
	r.mu.Unlock()
	ctx, cancel := context.WithTimeout(r.ctx, within)
	defer cancel()
	st, err := r.kv.Status(ctx)
	res.err = err
	if err == nil {
		res.created = streamCreated(st)
		if !unsure {
			res.fresh = quorumHeard(st, res.at)
		}
		if acked.After(res.fresh) && holds(st, ackedRev) {
			res.fresh = acked
		}
		for _, id := range ids {
			var kc keyCheck
			kc.rev, kc.err = r.lastPut(ctx, id)
			res.keys[id] = kc
		}
	}
	select {
	case r.checked <- res:
	case <-r.ctx.Done():
	}
}

// quorumHeard returns when the leader of the stream whose status st is,
// asked at asked, last heard a quorum of the stream's replicas: a leader
// then, it held every put stored before. A stream of one replica holds
// them as it answers: asked. Zero if there is no leader, or it has not
// heard a quorum.
func quorumHeard(st jetstream.KeyValueStatus, asked time.Time) time.Time {
	s, ok := st.(interface{ StreamInfo() *jetstream.StreamInfo })
	if !ok || s.StreamInfo() == nil {
		return time.Time{}
	}
	info := s.StreamInfo()
	if info.Config.Replicas <= 1 {
		return asked
	}
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return time.Time{}
	}
	// The leader hears itself now; a replica, Active ago. A replica it
	// never heard reports no lag behind and an Active of 0: Current tells.
	heard := []time.Duration{0}
	for _, p := range info.Cluster.Replicas {
		if p != nil && p.Name != info.Cluster.Leader && !p.Offline && p.Current {
			heard = append(heard, p.Active)
		}
	}
	quorum := info.Config.Replicas/2 + 1
	if len(heard) < quorum {
		return time.Time{}
	}
	slices.Sort(heard)
	return asked.Add(-heard[quorum-1])
}

// holds says whether the stream whose status st is, as the server that
// answered sees it, holds revision rev. A stream leader cut off from the
// others, which has not stepped down yet, answers too once the partition
// heals, until it hears the new leader, and it lacks the puts acknowledged
// meanwhile: its answers to the check's reads, local and so first, would
// be stale.
func holds(st jetstream.KeyValueStatus, rev uint64) bool {
	s, ok := st.(interface{ StreamInfo() *jetstream.StreamInfo })
	return ok && s.StreamInfo() != nil && s.StreamInfo().State.LastSeq >= rev
}

// lastPut returns the revision of the put key id holds, read from the
// stream's leader (JetStream's plain message get: a direct get may be
// answered by any replica, however far behind), or an error matching
// jetstream.ErrKeyNotFound if it holds none (deleted, purged or expired).
func (r *Registry) lastPut(ctx context.Context, id uuid.UUID) (uint64, error) {
	req, err := json.Marshal(struct {
		LastFor string `json:"last_by_subj"`
	}{"$KV." + r.bucket + "." + id.String()})
	if err != nil {
		return 0, err
	}
	msg, err := r.nc.RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET.KV_"+r.bucket, req)
	if err != nil {
		return 0, err
	}
	var resp struct {
		Message *struct {
			Seq    uint64 `json:"seq"`
			Header []byte `json:"hdrs,omitempty"`
		} `json:"message"`
		Error *jetstream.APIError `json:"error"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return 0, fmt.Errorf("undecodable answer to a message get: %w", err)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		return 0, jetstream.ErrKeyNotFound
	case resp.Error != nil:
		return 0, resp.Error
	case resp.Message == nil:
		return 0, jetstream.ErrInvalidJetStreamResponse
	}
	if len(resp.Message.Header) > 0 {
		h, err := nats.DecodeHeadersMsg(resp.Message.Header)
		if err != nil {
			return 0, fmt.Errorf("undecodable headers of key %s: %w", id, err)
		}
		if op := h.Get("KV-Operation"); op == "DEL" || op == "PURGE" {
			return 0, jetstream.ErrKeyNotFound
		}
	}
	return resp.Message.Seq, nil
}

// judgeByStore declares departed every suspect whose key, in res, holds
// the put last heard from it, or none. It returns the first suspect whose
// key holds another put (the watch missed it), if any.
func (r *Registry) judgeByStore(res storeCheck) (missed uuid.UUID, found bool) {
	r.mu.Lock()
	var gone []uuid.UUID
	for id, kc := range res.keys {
		p, ok := r.live[id]
		// Heard since, or silent only since after the store was known to
		// hold every put.
		if !ok || !p.suspect || p.heard.Add(2*p.hb).After(res.fresh) {
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
