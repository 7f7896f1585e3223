package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/internal/oneline"
)

// Option configures an [Agent], given to [New].
type Option interface{ apply(*options) error }

type optionFunc func(*options) error

func (f optionFunc) apply(o *options) error { return f(o) }

type options struct {
	id         uuid.UUID
	backends   []Backend
	logger     *slog.Logger
	device     devmem.Driver
	stageChunk int
	stagePool  int
}

// WithID sets the agent's identity. Default: a random UUID.
func WithID(id uuid.UUID) Option {
	return optionFunc(func(o *options) error {
		if id == uuid.Nil {
			return fmt.Errorf("%w: nil agent ID", ErrInvalid)
		}
		o.id = id
		return nil
	})
}

// WithBackends sets the agent's backends in order of preference: for each
// transfer the agent picks the first one that reaches the peer and supports
// the memory involved. The agent owns them from New on and closes them.
// Default: none, so New fails without this option.
func WithBackends(bs ...Backend) Option {
	return optionFunc(func(o *options) error {
		o.backends = append(o.backends, bs...)
		return nil
	})
}

// WithLogger sets where the agent and its backends log ([Host.Logger]).
// Default: [slog.Default]().
func WithLogger(l *slog.Logger) Option {
	return optionFunc(func(o *options) error {
		o.logger = l
		return nil
	})
}

// Stats are an agent's counters since it started.
type Stats struct {
	Refused              uint64 // remote accesses refused
	DroppedNotifications uint64 // notifications for no known key, or to a full queue
	// LostNotifications counts finished transfers whose notification the
	// backend failed to send ([Work.FinishNotify]): the transfer had
	// succeeded, and the passive side learns of the loss only as of a lost
	// peer.
	LostNotifications uint64
	// Registered, Exposed and InFlight are gauges, not counters: regions
	// registered now, exposures not yet revoked, transfers posted and not
	// finished. A steady climb means operations are not being closed.
	Registered, Exposed, InFlight int
	// StagingBuffers is how many pinned staging buffers are in use now (by
	// transfers and by peers' leases on device memory), StagingBytes how
	// much pinned host memory the agent holds for staging, in use or kept
	// for reuse (at most the pool size of [WithStaging]).
	StagingBuffers int
	StagingBytes   int64
	// Backends holds, per backend name, the counters of backends that keep
	// them (see [Counting]), for example how many connections the tcp
	// backend dropped and why. Nil when no backend counts.
	Backends map[string]BackendStats
}

// Agent registers memory, exposes it, and posts transfers to remote agents
// over its backends (see the package doc). It is safe for concurrent use.
// Close stops it.
type Agent struct {
	id       uuid.UUID
	backends []Backend
	stops    []context.CancelCauseFunc // per backend: ends its Host.Context
	conns    []ConnInfo
	log      *slog.Logger

	regMu    sync.Mutex
	regs     map[regKey]regEntry // per region, when some backend is a Registrar
	regsPeak int                 // most entries regs held since it was last rebuilt
	// held are the live registrations when no backend is a Registrar:
	// there is then nothing to register, only references to count, and
	// one entry per Register call replaces a map entry per region.
	held       map[*Registration]struct{}
	registrars bool // some backend implements Registrar

	expMu sync.RWMutex
	exps  map[Key]*Exposure

	xferMu sync.Mutex
	xfers  map[*transfer]struct{}
	xferWG sync.WaitGroup
	// calls counts the calls that may reach a backend outside a transfer
	// (Post choosing one, Notify, PeerDeparted); Close waits for them
	// before closing the backends. Added to under xferMu, while open.
	calls sync.WaitGroup

	closed   atomic.Bool
	closeMu  sync.Mutex
	closeErr error

	refused atomic.Uint64
	dropped atomic.Uint64
	lost    atomic.Uint64 // LostNotifications

	fallbacks sync.Map // "peer/backend" already logged

	dev        devState // device driver and staging, made at first use
	stageMu    sync.Mutex
	stageChunk int
	stagePool  int
}

// New starts an agent with the given backends ([WithBackends]), calling
// each one's [Backend.Start] in order. It fails for an invalid option, no
// backend or one given twice by name ([ErrInvalid]), or a backend whose
// Start fails (naming it). On error nothing is left running and the
// backends have been closed.
func New(opts ...Option) (*Agent, error) {
	o := options{id: uuid.New(), logger: slog.Default(), stageChunk: defaultStageChunk, stagePool: defaultStagePool}
	var optErr error
	for _, opt := range opts {
		// After an invalid option the rest are still applied, ignoring
		// their errors, so that every backend given is closed.
		if err := opt.apply(&o); err != nil && optErr == nil {
			optErr = err
		}
	}
	if optErr != nil {
		closeAll(o.backends)
		return nil, optErr
	}
	if len(o.backends) == 0 {
		return nil, fmt.Errorf("%w: an agent needs at least one backend", ErrInvalid)
	}
	a := &Agent{
		id:       o.id,
		backends: o.backends,
		log:      o.logger.With("agent", o.id.String()[:8]),
		regs:     make(map[regKey]regEntry),
		held:     make(map[*Registration]struct{}),
		exps:     make(map[Key]*Exposure),
		xfers:    make(map[*transfer]struct{}),

		dev:        devState{given: o.device},
		stageChunk: o.stageChunk,
		stagePool:  o.stagePool,
	}
	seen := map[string]bool{}
	for _, b := range a.backends {
		if _, ok := b.(Registrar); ok {
			a.registrars = true
		}
		if seen[b.Name()] {
			a.stopBackends()
			return nil, fmt.Errorf("%w: backend %q given twice", ErrInvalid, b.Name())
		}
		seen[b.Name()] = true
		ctx, stop := context.WithCancelCause(context.Background())
		a.stops = append(a.stops, stop)
		h := &host{a: a, log: a.log.With("backend", b.Name()), ctx: ctx, stages: stagesDevice(b)}
		ci, err := b.Start(h)
		if err != nil {
			a.stopBackends()
			return nil, fmt.Errorf("start backend %s: %w", b.Name(), err)
		}
		a.conns = append(a.conns, ConnInfo{Backend: b.Name(), Data: ci})
	}
	return a, nil
}

// closeAll closes each backend once, even one given twice.
func closeAll(bs []Backend) []error {
	var errs []error
	for i, b := range bs {
		if slices.ContainsFunc(bs[:i], func(c Backend) bool { return same(b, c) }) {
			continue
		}
		if err := b.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close backend %s: %w", b.Name(), err))
		}
	}
	return errs
}

// same reports whether a and b are the same backend value; values of
// types that cannot be compared are never the same.
func same(a, b Backend) (eq bool) {
	defer func() {
		if recover() != nil {
			eq = false
		}
	}()
	return a == b
}

// stopBackends ends every backend's lifetime context, waits for the calls
// that may still be inside a backend (they end with it), then closes each
// backend once.
func (a *Agent) stopBackends() []error {
	for _, stop := range a.stops {
		stop(ErrClosed)
	}
	a.calls.Wait()
	return closeAll(a.backends)
}

// enter counts a call that may reach a backend outside a transfer; it
// reports false once the agent is closed. The caller then owes calls one
// Done.
func (a *Agent) enter() bool {
	a.xferMu.Lock()
	defer a.xferMu.Unlock()
	if a.closed.Load() {
		return false
	}
	a.calls.Add(1)
	return true
}

// ID returns the agent's identity.
func (a *Agent) ID() uuid.UUID { return a.id }

// Logger returns the agent's logger ([WithLogger]), with the agent's
// identity attached.
func (a *Agent) Logger() *slog.Logger { return a.log }

// Info returns the agent's public metadata, for peers to put in their
// [Request.Peer]. The result is a fresh copy.
func (a *Agent) Info() Info {
	return Info{ID: a.id, Conns: slices.Clone(a.conns)}
}

// Backends returns the names of the agent's backends in preference order.
func (a *Agent) Backends() []string {
	names := make([]string, len(a.backends))
	for i, b := range a.backends {
		names[i] = b.Name()
	}
	return names
}

// Stats returns the agent's counters. Safe for concurrent use, also after
// Close.
func (a *Agent) Stats() Stats {
	st := Stats{Refused: a.refused.Load(), DroppedNotifications: a.dropped.Load(), LostNotifications: a.lost.Load()}
	st.Registered, _ = a.Registered()
	a.expMu.RLock()
	st.Exposed = len(a.exps)
	a.expMu.RUnlock()
	a.xferMu.Lock()
	st.InFlight = len(a.xfers)
	a.xferMu.Unlock()
	a.stageMu.Lock()
	if p := a.dev.pool; p != nil {
		st.StagingBytes, st.StagingBuffers = p.stats()
		lb, ln := a.dev.leasePool.stats()
		st.StagingBytes += lb
		st.StagingBuffers += ln
	}
	a.stageMu.Unlock()
	for _, b := range a.backends {
		if c, ok := b.(Counting); ok {
			if st.Backends == nil {
				st.Backends = make(map[string]BackendStats)
			}
			st.Backends[b.Name()] = c.Stats()
		}
	}
	return st
}

func (a *Agent) isClosed() bool { return a.closed.Load() }

// choose picks the backend for a transfer to peer moving memory of the
// given kinds: forced by name, or the first reachable one supporting them.
// A transfer names the remote exposure's key and the access it needs, which
// backends that implement KeyedReacher are told; a notification names none.
func (a *Agent) choose(ctx context.Context, peer Info, key Key, acc Access, force string, remoteVRAM bool) (Backend, error) {
	var why []error
	notable := false // a backend passed over should have worked
	for _, b := range a.backends {
		if force != "" && b.Name() != force {
			continue
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: choosing a backend for peer %s: %w", ErrCancelled, peer.ID, ctxErr(ctx))
		}
		if err := reachable(ctx, b, peer, key, acc); err != nil {
			if ctx.Err() != nil { // cut short: a cancellation, not a verdict
				return nil, fmt.Errorf("%w: choosing a backend for peer %s: %s: %w", ErrCancelled, peer.ID, b.Name(), ctxErr(ctx))
			}
			why = append(why, named(b.Name(), err))
			if _, published := peer.Conn(b.Name()); published && !errors.Is(err, ErrOutOfReach) {
				notable = true
			}
			continue
		}
		ok := b.Supports(KindDRAM)
		if !ok {
			why = append(why, fmt.Errorf("%s: does not support %v memory", b.Name(), KindDRAM))
		} else if remoteVRAM && !b.Supports(KindVRAM) && !stagesDevice(b) {
			why = append(why, fmt.Errorf("%s: cannot reach the peer's GPU memory (%v)", b.Name(), KindVRAM))
			ok = false
		}
		if ok {
			if len(why) > 0 {
				a.noteFallback(peer.ID, b.Name(), why, notable)
			}
			return b, nil
		}
		notable = true
	}
	if force != "" && len(why) == 0 {
		return nil, fmt.Errorf("%w: backend %q is not configured (have %v)", ErrNoBackend, force, a.Backends())
	}
	return nil, fmt.Errorf("%w for peer %s: %w", ErrNoBackend, peer.ID, oneline.Join(why...))
}

// ctxErr is why ctx ended: ctx.Err(), joined with its cause when the
// context was cancelled with one, so that both match.
func ctxErr(ctx context.Context) error {
	err, cause := ctx.Err(), context.Cause(ctx)
	if cause == nil || cause == err {
		return err
	}
	return fmt.Errorf("%w: %w", err, cause)
}

func reachable(ctx context.Context, b Backend, peer Info, key Key, acc Access) error {
	if kr, ok := b.(KeyedReacher); ok && key != (Key{}) {
		return kr.ReachableWithKey(ctx, peer, key, acc)
	}
	return b.Reachable(ctx, peer)
}

// noteFallback logs, once per peer and chosen backend, that preferred
// backends were passed over and why: a fast path that is unavailable falls
// back silently for the caller but visibly for the operator. Notable
// fallbacks (a backend the peer publishes refused for a reason other than
// [ErrOutOfReach]: cma denied on the same host, say) are logged at Info
// level; the normal path (mem passed over for a peer in another process,
// cma for one on another host) only at Debug level.
func (a *Agent) noteFallback(peer uuid.UUID, chosen string, why []error, notable bool) {
	level := slog.LevelDebug
	if notable {
		level = slog.LevelInfo
	}
	if _, seen := a.fallbacks.LoadOrStore(peer.String()+"/"+chosen+"/"+level.String(), true); seen {
		return
	}
	a.log.Log(context.Background(), level, "goxfer: preferred backends unavailable for peer", "peer", peer, "using", chosen, "reasons", oneline.Join(why...).Error())
}

// Post validates r, picks a backend and starts the transfer without waiting
// for it. ctx bounds only the start: choosing a backend may connect to the
// peer (cma probes whether it may read the peer's memory); once Post
// returns, cancel the transfer with [Xfer.Cancel]. The backend is the
// first, in preference order, that reaches r.Peer and supports the memory
// kinds involved, or the one r.Backend names; none is [ErrNoBackend],
// with each backend's reason. The segments' local memory must stay alive
// and untouched until the returned transfer is Done; r.Segments must not
// be changed until then either. A closed agent answers [ErrClosed],
// malformed requests [ErrInvalid]. Safe for concurrent use.
func (a *Agent) Post(ctx context.Context, r Request) (*Xfer, error) {
	if !a.enter() {
		return nil, ErrClosed
	}
	defer a.calls.Done()
	if r.Op != OpRead && r.Op != OpWrite {
		return nil, fmt.Errorf("%w: op %v", ErrInvalid, r.Op)
	}
	peer := r.Peer
	if peer.ID == uuid.Nil {
		return nil, fmt.Errorf("%w: request names no peer", ErrInvalid)
	}
	if len(r.Segments) == 0 {
		return nil, fmt.Errorf("%w: request has no segments", ErrInvalid)
	}
	var total uint64
	var localVRAM, remoteVRAM bool
	for i, s := range r.Segments {
		if err := s.Local.check(); err != nil {
			return nil, fmt.Errorf("segment %d: %w", i, err)
		}
		if s.Local.Len != s.Remote.Len {
			return nil, fmt.Errorf("%w: segment %d: local length %d != remote length %d", ErrInvalid, i, s.Local.Len, s.Remote.Len)
		}
		if s.Local.Kind > KindVRAM || s.Remote.Kind > KindVRAM {
			return nil, fmt.Errorf("%w: segment %d: memory kinds %v and %v", ErrInvalid, i, s.Local.Kind, s.Remote.Kind)
		}
		localVRAM = localVRAM || s.Local.Kind == KindVRAM
		remoteVRAM = remoteVRAM || s.Remote.Kind == KindVRAM
		total += s.Local.Len
	}
	if localVRAM {
		locals := make([]Local, len(r.Segments))
		for i := range r.Segments {
			locals[i] = r.Segments[i].Local
		}
		if err := a.checkDevice(locals); err != nil {
			return nil, err
		}
	}
	acc := AccessRead
	if r.Op == OpWrite {
		acc = AccessWrite
	}
	b, err := a.choose(ctx, peer, r.Key, acc, r.Backend, remoteVRAM)
	if err != nil {
		return nil, err
	}
	stage := needsStaging(b, r.Segments)
	t := &transfer{
		a: a, backend: b.Name(), path: b.Name(), bytes: total, onDone: r.OnDone,
		cancel: make(chan struct{}), done: make(chan struct{}),
	}
	direct := ""
	if dd, ok := b.(DeviceDirect); ok && (localVRAM || remoteVRAM) {
		if how, ok := dd.DirectDevice(peer, r.Segments); ok {
			direct, stage = how, false
		}
	}
	switch {
	case direct != "":
		t.path += "+" + direct
	case stage || (remoteVRAM && !b.Supports(KindVRAM)):
		t.path += "+staging"
	}
	t.x.t = t
	t.w = Work{Op: r.Op, Peer: peer, Key: r.Key, Segments: r.Segments, Notify: r.Notify, t: t}
	a.xferMu.Lock()
	if a.isClosed() {
		a.xferMu.Unlock()
		return nil, ErrClosed
	}
	a.xfers[t] = struct{}{}
	a.xferWG.Add(1)
	a.xferMu.Unlock()
	post := b.Post
	if stage {
		post = func(*Work) error { return a.postStaged(b, t) }
	}
	if err := post(&t.w); err != nil {
		if a.untrack(t) {
			a.xferWG.Done()
		}
		return nil, err
	}
	return &t.x, nil
}

// untrack removes t from the transfers in flight and reports whether it
// was there; the caller then owes xferWG one Done.
func (a *Agent) untrack(t *transfer) bool {
	a.xferMu.Lock()
	defer a.xferMu.Unlock()
	_, ok := a.xfers[t]
	delete(a.xfers, t)
	return ok
}

// lostNotify counts and logs a finished transfer's notification that its
// backend failed to send.
func (a *Agent) lostNotify(w *Work, err error) {
	a.lost.Add(1)
	a.log.Debug("goxfer: a finished transfer's notification was not sent", "peer", w.Peer.ID, "backend", w.t.backend, "err", err)
}

// Notify sends a standalone notification to peer under key, best effort,
// over the first backend that reaches peer. It may block while a backend
// checks it can reach the peer or connects to it: ctx bounds that, and the
// error then wraps context.Cause(ctx). msg stays the caller's. Safe for
// concurrent use.
func (a *Agent) Notify(ctx context.Context, peer Info, key Key, msg []byte) error {
	if !a.enter() {
		return ErrClosed
	}
	defer a.calls.Done()
	if peer.ID == uuid.Nil {
		return fmt.Errorf("%w: notification names no peer", ErrInvalid)
	}
	b, err := a.choose(ctx, peer, Key{}, 0, "", false)
	if err != nil {
		return err
	}
	return b.Notify(ctx, peer, key, msg)
}

// deliver is the agent's notification dispatcher ([Host.Deliver]): a lookup
// by key and a non-blocking send to the exposure's small queue, on the
// caller's goroutine, with no hand-off. Notifications for no known key, or
// that find the queue full, are counted dropped.
func (a *Agent) deliver(l Link, key Key, msg []byte) bool {
	if a.isClosed() {
		return false
	}
	a.expMu.RLock()
	e := a.exps[key]
	a.expMu.RUnlock()
	if e == nil {
		a.dropped.Add(1)
		return true
	}
	// Queued under the exposure's lock, as losses are: a loss reported
	// after this notification began to be delivered is queued after it.
	e.mu.Lock()
	e.bind(l)
	a.send(e, Event{Kind: EventNotify, From: l.Peer, Msg: msg, Err: e.stageErr})
	e.mu.Unlock()
	return true
}

// linkLost is Host.LinkLost: every exposure l presented the key of hears
// that its peer is lost. Exposures l never reached hear nothing, whatever
// agent l claimed to be: only what a peer really used can report its loss.
func (a *Agent) linkLost(l Link, cause error) {
	if l.Peer == uuid.Nil || l.id == 0 {
		return
	}
	if cause == nil {
		cause = ErrRemoteLost
	}
	a.expMu.RLock()
	defer a.expMu.RUnlock()
	for _, e := range a.exps {
		e.mu.Lock()
		if e.unbind(l) {
			a.send(e, Event{Kind: EventPeerLost, From: l.Peer, Err: cause})
		}
		e.mu.Unlock()
	}
}

// peerLost tells every exposure bound to peer, over any link, that it is
// lost. Only PeerDeparted, on word from outside the backends, uses it.
func (a *Agent) peerLost(peer uuid.UUID, cause error) {
	a.expMu.RLock()
	defer a.expMu.RUnlock()
	for _, e := range a.exps {
		e.mu.Lock()
		if e.boundTo(peer) {
			a.send(e, Event{Kind: EventPeerLost, From: peer, Err: cause})
		}
		e.mu.Unlock()
	}
}

// PeerDeparted declares peer gone on word from outside the backends, such
// as a presence registry that stopped hearing its heartbeats: every transfer
// in flight with peer is aborted with cause, backends that keep state per
// peer drop it ([Departer]), and every exposure bound to peer hears
// [EventPeerLost], as when a backend loses the peer. A nil cause means
// [ErrRemoteLost]; a cause that does not match ErrRemoteLost is joined to
// it. Transfers posted afterwards are not refused: if the peer is in fact
// alive they proceed. It does not wait for the aborted transfers to end.
// Safe for concurrent use.
func (a *Agent) PeerDeparted(peer uuid.UUID, cause error) {
	if peer == uuid.Nil || !a.enter() {
		return
	}
	defer a.calls.Done()
	switch {
	case cause == nil:
		cause = ErrRemoteLost
	case !errors.Is(cause, ErrRemoteLost):
		cause = fmt.Errorf("%w: %w", ErrRemoteLost, cause)
	}
	a.xferMu.Lock()
	var ts []*transfer
	for t := range a.xfers {
		if t.w.Peer.ID == peer {
			ts = append(ts, t)
		}
	}
	a.xferMu.Unlock()
	for _, t := range ts {
		t.abort(cause)
	}
	for _, b := range a.backends {
		if d, ok := b.(Departer); ok {
			d.PeerDeparted(peer, cause)
		}
	}
	a.peerLost(peer, cause)
}

func (a *Agent) send(e *Exposure, ev Event) {
	select {
	case e.events <- ev:
	default:
		a.dropped.Add(1)
	}
}

// Close stops the agent. From its start, Post, Notify, Expose and Register
// fail with [ErrClosed]. It cancels the transfers in flight (cause
// ErrClosed) and waits until their backends have finished them and until
// the notifications of transfers that finished are sent
// ([Work.FinishNotify]; bounded by each backend's own limits), revokes
// the exposures still open, cancels every backend's [Host.Context], waits
// for the Notify, PeerDeparted and Post calls still inside a backend, then
// calls each backend's [Backend.Close] once; their errors are joined. A
// Notify with a context that never ends can hold Close up for as long as
// its backend lets it block once Host.Context is done (tcp: at most its
// keepalive timeout). It is idempotent and safe to call concurrently with any other
// method; the first call's error is returned by all.
func (a *Agent) Close() error {
	a.closeMu.Lock()
	defer a.closeMu.Unlock()
	if a.closed.Load() {
		return a.closeErr
	}
	a.xferMu.Lock()
	a.closed.Store(true)
	ts := make([]*transfer, 0, len(a.xfers))
	for t := range a.xfers {
		ts = append(ts, t)
	}
	a.xferMu.Unlock()
	for _, t := range ts {
		t.x.Cancel(ErrClosed)
	}
	a.stopStaging() // waits for a staging buffer end
	a.xferWG.Wait()

	a.expMu.Lock()
	exps := make([]*Exposure, 0, len(a.exps))
	for _, e := range a.exps {
		exps = append(exps, e)
	}
	a.expMu.Unlock()
	for _, e := range exps {
		e.Revoke()
	}

	errs := a.stopBackends()
	if err := a.closeStaging(); err != nil {
		errs = append(errs, err)
	}
	a.closeErr = oneline.Join(errs...)
	return a.closeErr
}

// named prefixes err with a backend's name, unless the backend's message
// begins with it already (backends name themselves: "tcp: ...").
func named(name string, err error) error {
	if strings.HasPrefix(err.Error(), name+": ") {
		return err
	}
	return fmt.Errorf("%s: %w", name, err)
}
