package nats

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/oneline"
)

// maxDeparted bounds how many departed agents a Registry remembers, to
// answer Resolve with connect.ErrRemoteLost rather than ErrUnknownAgent.
const maxDeparted = 4096

// Registry is an agent presence registry kept in a JetStream key-value
// bucket: Connectors that join ([Registry.Join]) publish their
// [connect.AgentInfo] under their agent ID and heartbeat it, and every
// Registry watches the bucket, so it knows who is present, resolves
// compact tokens (it is a [connect.Resolver]) and tells joined Connectors
// when a peer departs ([connect.Connector.PeerDeparted]), so that their
// operations with it fail with [connect.ErrRemoteLost] within about two
// heartbeats, long before transport keepalives would notice a frozen peer.
//
// An agent departs when its entry is deleted ([Member.Leave]: at once for
// watchers and Resolve; joined Connectors are told one heartbeat later,
// unless it is back by then, so that the notifications and goodbyes its
// Connector sends as it closes arrive over the backends first) or
// when it has not been heard for two of its heartbeats, timed on this
// machine's clock (no clock sync needed), and then either one of this
// process's own heartbeats sent after that comes back through the watch,
// or the store, read from the stream's leader once it is known to hold
// every put stored since then, still holds the agent's last put heard (or
// none): about a round trip more. While the Registry's connection is
// down it cannot hear anyone, so it declares no departures; once it is
// back it re-creates its watch and counts silence from then, plus its own
// reconnect wait ([nats.ReconnectWait] + jitter) to let peers reconnect
// too. Likewise, when one of its Members' heartbeats went unstored (the
// stream's leader lost, an election, no quorum), it counts everybody's
// silence from when the store takes them again. A Registry never declares
// its own joined Members departed. It needs
// nothing beyond nats-server 2.9, and permission to read the bucket's keys
// (as [Registry.Resolve] does). docs/nats.md gives the rules in full.
//
// A Registry is safe for concurrent use. It owns one watcher goroutine,
// one goroutine per joined [Member] (its heartbeats), one per
// [Registry.Watch] and at most one store check at a time, all stopped by
// [Registry.Close]; the connection stays the caller's.
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
	// ackedSent is when the latest of this process's heartbeats that the
	// store acknowledged was sent, and ackedRev its revision: a read of
	// the stream's leader after the acknowledgement, from a leader that
	// holds that revision, holds every put stored before then.
	ackedSent time.Time
	ackedRev  uint64

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

// OpenRegistry binds the registry's bucket ([WithBucket], default
// "goxfer_agents") over nc, which stays the caller's, and starts watching
// it; it returns once the Registry knows every agent present. ctx bounds
// only the opening: the Registry watches until [Registry.Close]. A missing
// bucket is created (History 1, TTL 3 heartbeats, [WithReplicas]: 3 on a
// cluster, 1 on a lone server) unless
// [WithCreateBucket](false); when it is missing and cannot be created (not
// allowed, or JetStream unavailable) the error matches [ErrRegistry] and
// names the bucket and the cause. A JetStream that does not answer is
// asked up to three times, within ctx. Options honoured: WithBucket,
// WithHeartbeat, WithCreateBucket, WithReplicas, WithLogger.
func OpenRegistry(ctx context.Context, nc *nats.Conn, opts ...RegistryOption) (*Registry, error) {
	o, err := connOptions("OpenRegistry", nc, opts, RegistryOption.applyRegistry)
	if err != nil {
		return nil, err
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
		ttl, created = st.TTL(), streamCreated(st)
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
	fail := func(what string, err error) (*Registry, error) {
		nc.RemoveStatusListener(status)
		r.cancel()
		return nil, fmt.Errorf("%w: %s bucket %q: %w", ErrRegistry, what, o.bucket, err)
	}
	// The watch outlives ctx, which bounds only the opening: it lives
	// until Close.
	w, err := kv.WatchAll(r.ctx)
	if err != nil {
		return fail("watch", err)
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
			return fail("read", err)
		}
	}
	r.wg.Add(1)
	go r.run(w, created, status)
	return r, nil
}

// Bucket returns the name of the registry's bucket. Safe for concurrent
// use.
func (r *Registry) Bucket() string { return r.bucket }

// Resolve returns the [connect.AgentInfo] agent id published, from the
// local table or else from the bucket (a round trip, bounded by ctx). An
// agent that has departed returns an error matching
// [connect.ErrRemoteLost]; one never registered, [ErrUnknownAgent]; after
// Close, [ErrClosed]. It implements [connect.Resolver] (pass the Registry
// to [connect.WithResolver] to use compact tokens). Safe for concurrent
// use.
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
// slice that the caller owns. Safe for concurrent use.
func (r *Registry) Agents() []uuid.UUID {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.liveIDsLocked()
}

// liveIDsLocked returns the IDs of the live agents, sorted, in a fresh
// slice; r.mu is held.
func (r *Registry) liveIDsLocked() []uuid.UUID {
	ids := make([]uuid.UUID, 0, len(r.live))
	for id := range r.live {
		ids = append(ids, id)
	}
	slices.SortFunc(ids, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	return ids
}

// Err says whether presence works now: nil while the Registry hears its
// bucket, every Member's last heartbeat succeeded and no silent agent has
// waited eight of its heartbeats for a verdict, and otherwise an error
// matching [ErrRegistry] that says what fails: the Registry cannot watch
// its bucket (the connection is down, the bucket is gone or was created
// anew, the watch missed puts the store holds, or its Members' heartbeats
// do not come back through it: it then hears no arrivals and declares
// nobody departed), or a Member's heartbeat failed (peers may soon declare
// that agent departed), or a silent agent can be judged neither by an echo
// nor by the store (a lag: its departure waits). It is not nil for a
// moment around every reconnection; a failure that stays (the bucket
// vanished and [WithCreateBucket](false) forbids re-creating it,
// permissions, JetStream down) is also logged at Error level (a heartbeat
// failing on a live connection, at Warn level). After Close it matches
// [ErrClosed]. Safe for concurrent use.
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
	return oneline.Join(errs...)
}

// Close leaves every Member still joined ([Member.Close]: a 2 s timeout
// each, all at once), cuts short a [Registry.Join] waiting for its first
// put, stops the watcher and every Watch (their channels close) and waits
// for all the Registry's goroutines. The connection stays open: it is the
// caller's. Close is idempotent and safe for concurrent use; every call
// returns the first call's result.
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
		r.closeErr = oneline.Join(errs...)
	})
	return r.closeErr
}
