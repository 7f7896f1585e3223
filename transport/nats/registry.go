package nats

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/goxfer/goxfer/connect"
)

// maxDeparted bounds how many departed agents a Registry remembers, to
// answer Resolve with ErrRemoteLost rather than ErrUnknownAgent.
const maxDeparted = 4096

// createWithin bounds the creation of a missing bucket (a variable for
// tests).
var createWithin = 5 * time.Second

// Registry is an agent presence registry kept in a JetStream key-value
// bucket: Connectors that Join publish their connect.AgentInfo under their
// agent ID and heartbeat it, and every Registry watches the bucket, so it
// knows who is present, resolves compact tokens (it is a connect.Resolver)
// and tells joined Connectors when a peer departs (connect.Connector.
// PeerDeparted), so that their operations with it fail with
// connect.ErrRemoteLost within about two heartbeats, long before transport
// keepalives would notice a frozen peer.
//
// An agent departs when its entry is deleted (Member.Leave: at once) or
// when it has not been heard for two of its heartbeats, timed on this
// machine's clock (no clock sync needed). While the Registry's connection
// is down it cannot hear anyone, so it declares no departures; once it is
// back it re-creates its watch and counts silence from then, plus its own
// reconnect wait (nats.ReconnectWait + jitter) to let peers reconnect too.
// It needs nothing beyond nats-server 2.9.
//
// A Registry is safe for concurrent use. It owns one watcher goroutine, one
// goroutine per Member (heartbeats) and one per Watch, all stopped by
// Close.
type Registry struct {
	nc     *nats.Conn
	js     jetstream.JetStream
	kv     jetstream.KeyValue
	o      options // to re-create the bucket should it vanish
	bucket string
	hb     time.Duration
	ttl    time.Duration // the bucket's MaxAge; 0: none
	log    *slog.Logger
	grace  time.Duration // extra silence allowed after reconnecting

	// recheck asks the watcher to check that the bucket still exists (a
	// heartbeat failed).
	recheck chan struct{}
	// checked hands the watcher the answer to a store check.
	checked chan storeCheck
	// echoed tells the watcher that a Member's heartbeat came back through
	// the watch: suspects may be judged now.
	echoed chan struct{}

	ctx    context.Context // cancelled by Close: ends watch creation and forwarders
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu       sync.Mutex
	closed   bool
	live     map[uuid.UUID]*peer
	departed map[uuid.UUID]departure
	members  map[*Member]struct{}
	watches  map[*presenceQueue]struct{}
	deafErr  error // why the watcher cannot hear the bucket now; nil: it can
	stuckErr error // a suspect waits long for a verdict; nil: none does
	// echoAt is when the latest of this process's heartbeats that came back
	// through the watch was sent: everybody's puts stored before it have
	// been heard.
	echoAt time.Time

	closeOnce sync.Once
	closeErr  error
}

// peer is what a Registry knows of a live agent.
type peer struct {
	info    connect.AgentInfo
	hb      time.Duration
	heard   time.Time // last heard, or the time silence is counted from
	rev     uint64    // the revision of its entry last heard
	seq     uint64    // and that entry's sequence (0: version 1)
	suspect bool      // silent long enough; judged by an echo or a store check
}

// departure is what a Registry remembers of a departed agent: when, and
// its last put, which a re-watch may deliver again until the bucket's max
// age removes it.
type departure struct {
	at       time.Time
	rev, seq uint64 // rev 0: no put to ignore
}

// Presence is an arrival (Departed false) or departure of an agent, as
// Registry.Watch reports it. Info is the zero AgentInfo for a departure of
// an agent the Registry never saw arrive.
type Presence struct {
	ID       uuid.UUID
	Info     connect.AgentInfo
	Departed bool
}

// OpenRegistry binds the registry's bucket (WithBucket, default
// "goxfer_agents") over nc, which stays the caller's, and starts watching
// it. A missing bucket is created (History 1, TTL 3 heartbeats,
// WithReplicas) unless WithCreateBucket(false); when it is missing and
// cannot be created (not allowed, or JetStream unavailable) the error
// matches ErrRegistry and names the bucket and the cause. Options honoured:
// WithBucket, WithHeartbeat, WithCreateBucket, WithReplicas, WithLogger.
func OpenRegistry(ctx context.Context, nc *nats.Conn, opts ...Option) (*Registry, error) {
	o, err := newOptions(opts)
	if err != nil {
		return nil, err
	}
	if nc == nil {
		return nil, fmt.Errorf("%w: OpenRegistry needs a connection", ErrInvalidOption)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("%w: bucket %q: %w", ErrRegistry, o.bucket, err)
	}
	kv, err := bindBucket(ctx, nc, js, o)
	if err != nil {
		return nil, err
	}
	var ttl time.Duration
	var created time.Time
	if st, err := kv.Status(ctx); err == nil {
		ttl = st.TTL()
		if s, ok := st.(interface{ StreamInfo() *jetstream.StreamInfo }); ok && s.StreamInfo() != nil {
			created = s.StreamInfo().Created
		}
	}
	r := &Registry{
		nc: nc, js: js, kv: kv, o: o, bucket: o.bucket, hb: o.heartbeat, ttl: ttl, log: o.logger,
		grace:    nc.Opts.ReconnectWait + nc.Opts.ReconnectJitter,
		recheck:  make(chan struct{}, 1),
		checked:  make(chan storeCheck),
		echoed:   make(chan struct{}, 1),
		live:     make(map[uuid.UUID]*peer),
		departed: make(map[uuid.UUID]departure),
		members:  make(map[*Member]struct{}),
		watches:  make(map[*presenceQueue]struct{}),
	}
	r.ctx, r.cancel = context.WithCancel(context.Background())
	status := nc.StatusChanged(nats.CONNECTED, nats.DISCONNECTED, nats.RECONNECTING, nats.CLOSED)
	// The watch outlives ctx, which bounds only the opening: it lives
	// until Close.
	w, err := kv.WatchAll(r.ctx)
	if err != nil {
		nc.RemoveStatusListener(status)
		r.cancel()
		return nil, fmt.Errorf("%w: watch bucket %q: %w", ErrRegistry, o.bucket, err)
	}
	// Return with the table complete: the present agents, and the recent
	// departures still in the bucket as delete markers.
	for initial := true; initial; {
		select {
		case e, ok := <-w.Updates():
			switch {
			case !ok:
				err = errors.New("the watch ended")
			case e == nil:
				initial = false
			default:
				r.apply(e)
			}
		case <-ctx.Done():
			err = ctx.Err()
		}
		if err != nil {
			_ = w.Stop()
			nc.RemoveStatusListener(status)
			r.cancel()
			return nil, fmt.Errorf("%w: read bucket %q: %w", ErrRegistry, o.bucket, err)
		}
	}
	r.wg.Add(1)
	go r.run(w, created, status)
	return r, nil
}

func bindBucket(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, o options) (jetstream.KeyValue, error) {
	kv, err := js.KeyValue(ctx, o.bucket)
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("%w: bind bucket %q: %w", ErrRegistry, o.bucket, err)
	}
	if !o.createBucket {
		return nil, fmt.Errorf("%w: bucket %q does not exist, and WithCreateBucket(false) forbids creating it", ErrRegistry, o.bucket)
	}
	return createBucket(ctx, nc, js, o)
}

// createBucket creates the missing bucket, or binds it if a racing peer
// created it first.
func createBucket(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, o options) (jetstream.KeyValue, error) {
	// A server that refuses the request for lack of permission does not
	// answer it; do not wait for the caller's whole ctx.
	cctx, cancel := context.WithTimeout(ctx, createWithin)
	defer cancel()
	kv, err := js.CreateKeyValue(cctx, jetstream.KeyValueConfig{
		Bucket:      o.bucket,
		Description: "goxfer agent presence registry",
		History:     1,
		TTL:         3 * o.heartbeat,
		Replicas:    o.replicas,
		Storage:     jetstream.FileStorage,
	})
	if errors.Is(err, jetstream.ErrBucketExists) {
		kv, err = js.KeyValue(ctx, o.bucket) // created by a racing peer
	}
	if err != nil {
		if le := nc.LastError(); errors.Is(le, nats.ErrPermissionViolation) {
			return nil, fmt.Errorf("%w: bucket %q does not exist and creating it failed: %w (the server reports: %v)", ErrRegistry, o.bucket, err, le)
		}
		return nil, fmt.Errorf("%w: bucket %q does not exist and creating it failed: %w", ErrRegistry, o.bucket, err)
	}
	return kv, nil
}

// Bucket returns the name of the registry's bucket.
func (r *Registry) Bucket() string { return r.bucket }

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

// Resolve returns the AgentInfo agent id published, from the local table
// or else from the bucket. An agent that has departed returns an error
// matching connect.ErrRemoteLost; one never registered, ErrUnknownAgent.
// It implements connect.Resolver (pass the Registry to
// connect.WithResolver to use compact tokens). Safe for concurrent use.
func (r *Registry) Resolve(ctx context.Context, id uuid.UUID) (connect.AgentInfo, error) {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return connect.AgentInfo{}, fmt.Errorf("%w: registry on bucket %q", ErrClosed, r.bucket)
	}
	if p, ok := r.live[id]; ok {
		info := p.info // apply rewrites it under r.mu
		r.mu.Unlock()
		return info, nil
	}
	_, gone := r.departed[id]
	r.mu.Unlock()
	if gone {
		return connect.AgentInfo{}, fmt.Errorf("%w: agent %s departed (registry %q)", connect.ErrRemoteLost, id, r.bucket)
	}
	e, err := r.kv.Get(ctx, id.String())
	switch {
	case errors.Is(err, jetstream.ErrKeyDeleted):
		return connect.AgentInfo{}, fmt.Errorf("%w: agent %s left (registry %q)", connect.ErrRemoteLost, id, r.bucket)
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return connect.AgentInfo{}, fmt.Errorf("%w: agent %s is not in registry %q", ErrUnknownAgent, id, r.bucket)
	case err != nil:
		return connect.AgentInfo{}, fmt.Errorf("goxfer/nats: resolve agent %s in registry %q: %w", id, r.bucket, err)
	}
	ent, err := decodeEntry(e.Value())
	if err != nil {
		return connect.AgentInfo{}, fmt.Errorf("goxfer/nats: resolve agent %s in registry %q: %w", id, r.bucket, err)
	}
	info := ent.info
	if info.ID() != id {
		return connect.AgentInfo{}, fmt.Errorf("%w: registry %q: entry of agent %s describes agent %s", connect.ErrInvalidMetadata, r.bucket, id, info.ID())
	}
	return info, nil
}

// Agents returns the IDs of the agents present now, sorted, in a fresh
// slice.
func (r *Registry) Agents() []uuid.UUID {
	r.mu.Lock()
	ids := make([]uuid.UUID, 0, len(r.live))
	for id := range r.live {
		ids = append(ids, id)
	}
	r.mu.Unlock()
	slices.SortFunc(ids, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	return ids
}

// Watch reports arrivals and departures on the returned channel, starting
// with an arrival for every agent present now, until ctx is done or the
// Registry closes; then the channel is closed. Events are queued for a slow
// reader, never dropped, so keep reading until the channel closes or ctx is
// done.
func (r *Registry) Watch(ctx context.Context) <-chan Presence {
	q := &presenceQueue{ch: make(chan Presence), wake: make(chan struct{}, 1)}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		close(q.ch)
		return q.ch
	}
	ids := make([]uuid.UUID, 0, len(r.live))
	for id := range r.live {
		ids = append(ids, id)
	}
	slices.SortFunc(ids, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	for _, id := range ids {
		q.push(Presence{ID: id, Info: r.live[id].info})
	}
	r.watches[q] = struct{}{}
	r.wg.Add(1)
	r.mu.Unlock()
	go r.forward(ctx, q)
	return q.ch
}

// notifyLocked queues p for every Watch; r.mu is held.
func (r *Registry) notifyLocked(p Presence) {
	for q := range r.watches {
		q.push(p)
	}
}

// forward is a Watch's goroutine: it hands queued events to the reader.
func (r *Registry) forward(ctx context.Context, q *presenceQueue) {
	defer r.wg.Done()
	defer close(q.ch)
	defer func() {
		r.mu.Lock()
		delete(r.watches, q)
		r.mu.Unlock()
	}()
	for {
		for {
			p, ok := q.pop()
			if !ok {
				break
			}
			select {
			case q.ch <- p:
			case <-ctx.Done():
				return
			case <-r.ctx.Done():
				return
			}
		}
		select {
		case <-q.wake:
		case <-ctx.Done():
			return
		case <-r.ctx.Done():
			return
		}
	}
}

// presenceQueue is an unbounded queue of events for one Watch.
type presenceQueue struct {
	ch   chan Presence
	wake chan struct{}

	mu sync.Mutex
	q  []Presence
}

func (q *presenceQueue) push(p Presence) {
	q.mu.Lock()
	q.q = append(q.q, p)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *presenceQueue) pop() (Presence, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.q) == 0 {
		return Presence{}, false
	}
	p := q.q[0]
	q.q[0] = Presence{}
	q.q = q.q[1:]
	return p, true
}

// Err says whether presence works now: nil while the Registry hears its
// bucket and every Member's last heartbeat succeeded, and otherwise an
// error matching ErrRegistry that says what fails: the Registry cannot
// watch its bucket, or its Members' heartbeats do not come back through the
// watch (it then hears no arrivals and declares nobody departed), or a
// Member's heartbeat failed (peers may soon declare that
// agent departed). It is not nil for a moment around every reconnection;
// a failure that stays (the bucket vanished and WithCreateBucket(false)
// forbids re-creating it, permissions, JetStream down) is also logged at
// Error level (a heartbeat failing on a live connection, at Warn level).
// After Close it matches ErrClosed. Safe for concurrent use.
func (r *Registry) Err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return fmt.Errorf("%w: registry on bucket %q", ErrClosed, r.bucket)
	}
	var errs []error
	if r.deafErr != nil {
		errs = append(errs, fmt.Errorf("%w: bucket %q: cannot watch it: %w", ErrRegistry, r.bucket, r.deafErr))
	}
	if r.stuckErr != nil {
		errs = append(errs, fmt.Errorf("%w: bucket %q: %w", ErrRegistry, r.bucket, r.stuckErr))
	}
	for m := range r.members {
		if m.err != nil {
			errs = append(errs, fmt.Errorf("%w: bucket %q: heartbeat of agent %s: %w", ErrRegistry, r.bucket, m.id, m.err))
		}
	}
	return errors.Join(errs...)
}

// Close leaves every Member still joined (each with a short timeout, all
// at once), stops the watcher and every Watch (their channels close) and
// waits for all the Registry's goroutines. The connection stays open: it is
// the caller's. Close is idempotent; every call returns the first call's
// result.
func (r *Registry) Close() error {
	r.closeOnce.Do(func() {
		r.mu.Lock()
		r.closed = true
		members := make([]*Member, 0, len(r.members))
		for m := range r.members {
			members = append(members, m)
		}
		r.mu.Unlock()
		errs := make([]error, len(members))
		var left sync.WaitGroup
		for i, m := range members {
			left.Go(func() { errs[i] = m.Close() })
		}
		left.Wait()
		r.cancel()
		r.wg.Wait()
		r.closeErr = errors.Join(errs...)
	})
	return r.closeErr
}

// Member is a Connector's presence in a Registry; see Registry.Join. It is
// safe for concurrent use.
type Member struct {
	r    *Registry
	c    *connect.Connector
	id   uuid.UUID
	info []byte // its AgentInfo's binary form
	hb   time.Duration

	ctx    context.Context // cancelled by Leave: stops the heartbeats
	cancel context.CancelFunc
	poke   chan struct{} // put now
	done   chan struct{} // closed when the heartbeats stopped, or never started
	joined atomic.Bool   // the first put succeeded; final once done is closed
	unsure atomic.Bool   // Close cut the first put short; final once done is closed
	err    error         // the last heartbeat's failure; under r.mu
	// Under r.mu: the puts not yet echoed, oldest first.
	sends []*sentPut

	leaveOnce sync.Once
	leaveErr  error
}

// Join publishes c's AgentInfo in the registry under its agent ID, then
// re-puts it every heartbeat (WithHeartbeat; default: the Registry's) from
// one goroutine, until Leave, and at once whenever the Registry re-creates
// its watch (after a reconnection, or after re-creating a bucket that
// vanished). A heartbeat that fails (while the connection is down, say) is
// retried at the next tick; one that fails on a live connection is logged
// at Warn level and reported by Registry.Err until one succeeds. Until
// Leave, every departure the Registry sees is forwarded to c.PeerDeparted,
// so c's operations in flight with a departed peer fail with
// connect.ErrRemoteLost within about two heartbeats. The Member must Leave
// before c closes (Registry.Close leaves it otherwise). Join fails if the
// first put does. Options honoured: WithHeartbeat.
func (r *Registry) Join(ctx context.Context, c *connect.Connector, opts ...Option) (*Member, error) {
	o, err := newOptions(append([]Option{WithHeartbeat(r.hb)}, opts...))
	if err != nil {
		return nil, err
	}
	if c == nil {
		return nil, fmt.Errorf("%w: Join needs a Connector", ErrInvalidOption)
	}
	info := c.AgentInfo()
	ib, err := info.MarshalBinary()
	if err != nil {
		return nil, fmt.Errorf("goxfer/nats: join registry %q: %w", r.bucket, err)
	}
	if r.ttl > 0 && 2*o.heartbeat >= r.ttl {
		r.log.Warn("goxfer/nats: heartbeat too long for the bucket's TTL; the entry may expire between heartbeats", "bucket", r.bucket, "heartbeat", o.heartbeat, "ttl", r.ttl)
	}
	m := &Member{r: r, c: c, id: info.ID(), info: ib, hb: o.heartbeat, poke: make(chan struct{}, 1), done: make(chan struct{})}
	m.ctx, m.cancel = context.WithCancel(context.Background())
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		m.cancel()
		return nil, fmt.Errorf("%w: registry on bucket %q", ErrClosed, r.bucket)
	}
	// Registered before the put, so that a departure seen meanwhile
	// reaches c, and Close leaves it.
	r.members[m] = struct{}{}
	r.wg.Add(1)
	r.mu.Unlock()
	// Close (through Leave) cancels the first put too: it must not wait
	// for the caller's context while the server does not answer.
	pctx, pcancel := context.WithCancel(ctx)
	stop := context.AfterFunc(m.ctx, pcancel)
	err = m.put(pctx)
	stop()
	pcancel()
	if err != nil {
		r.mu.Lock()
		delete(r.members, m)
		r.mu.Unlock()
		left := m.ctx.Err() != nil
		// Cut short by Close, the put may still be stored (it was sent, or
		// waits in the reconnect buffer): Leave deletes the entry.
		m.unsure.Store(left)
		m.cancel()
		close(m.done) // a Leave racing this (Close) must not wait for heartbeats that never start
		r.wg.Done()
		if left {
			return nil, fmt.Errorf("%w: registry on bucket %q closed while agent %s joined: %w", ErrClosed, r.bucket, m.id, err)
		}
		return nil, fmt.Errorf("goxfer/nats: join registry %q as agent %s: %w", r.bucket, m.id, err)
	}
	m.joined.Store(true)
	// Present here at once, without waiting for the watch to echo it.
	r.heard(m.id, entry{hb: m.hb, info: info}, 0)
	go m.heartbeat()
	return m, nil
}

// ID returns the agent ID the Member publishes.
func (m *Member) ID() uuid.UUID { return m.id }

// put puts m's entry once, numbered so that its echo is known.
func (m *Member) put(ctx context.Context) error {
	sp := m.r.sending(m)
	rev, err := m.r.kv.Put(ctx, m.id.String(), appendEntry(nil, m.hb, sp.seq, m.info))
	if err == nil {
		m.r.acked(sp, rev)
	}
	return err
}

func (m *Member) heartbeat() {
	defer m.r.wg.Done()
	defer close(m.done)
	// Back from an outage, put at once: others count our silence from
	// their own reconnection.
	back := m.r.nc.StatusChanged(nats.CONNECTED)
	defer m.r.nc.RemoveStatusListener(back)
	t := time.NewTicker(m.hb)
	defer t.Stop()
	failing := 0
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-t.C:
		case <-back:
			t.Reset(m.hb)
		case <-m.poke:
			t.Reset(m.hb)
		}
		ctx, cancel := context.WithTimeout(m.ctx, m.hb)
		err := m.put(ctx)
		cancel()
		if m.ctx.Err() != nil {
			return
		}
		m.r.mu.Lock()
		m.err = err
		m.r.mu.Unlock()
		if err == nil {
			if failing > 0 && m.r.nc.Status() == nats.CONNECTED {
				m.r.log.Info("goxfer/nats: heartbeat works again", "bucket", m.r.bucket, "agent", m.id, "failed", failing)
			}
			failing = 0
			continue
		}
		failing++
		if m.r.nc.Status() == nats.CONNECTED {
			// The bucket may have vanished under a watch that cannot tell.
			// Not only ErrNoStreamResponse says so: at short heartbeats the
			// client's retries outlast the put's timeout.
			select {
			case m.r.recheck <- struct{}{}:
			default:
			}
		}
		// Failures while the connection is down are expected; on a live
		// connection, peers will soon declare this agent departed.
		level := slog.LevelDebug
		if failing == 1 && m.r.nc.Status() == nats.CONNECTED {
			level = slog.LevelWarn
		}
		m.r.log.Log(m.ctx, level, "goxfer/nats: heartbeat failed; peers declare this agent departed after two; retrying at the next one",
			"bucket", m.r.bucket, "agent", m.id, "err", err)
	}
}

// Leave stops the heartbeats and deletes the entry, so that every Registry
// sees the departure at once. It honours ctx: if ctx ends first, the entry
// is left to expire (peers then declare this agent departed after two
// heartbeats) and the error matches ctx.Err(). It is idempotent; every
// call returns the first call's result.
func (m *Member) Leave(ctx context.Context) error {
	m.leaveOnce.Do(func() {
		m.cancel()
		m.r.mu.Lock()
		delete(m.r.members, m)
		m.r.mu.Unlock()
		// The heartbeat goroutine stops at once: its put's context is
		// cancelled. It may not have started: a Join whose put failed.
		select {
		case <-m.done:
		case <-ctx.Done():
			m.leaveErr = fmt.Errorf("goxfer/nats: leave registry %q as agent %s: %w", m.r.bucket, m.id, ctx.Err())
			return
		}
		if !m.joined.Load() {
			if m.unsure.Load() {
				// Best effort: the Join failed, so its caller holds
				// nothing to leave, and the entry expires anyway.
				_ = m.r.kv.Delete(ctx, m.id.String())
			}
			return
		}
		if err := m.r.kv.Delete(ctx, m.id.String()); err != nil {
			m.leaveErr = fmt.Errorf("goxfer/nats: leave registry %q as agent %s: %w", m.r.bucket, m.id, err)
		}
	})
	return m.leaveErr
}

// Close is Leave with a short internal timeout (2 s).
func (m *Member) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return m.Leave(ctx)
}
