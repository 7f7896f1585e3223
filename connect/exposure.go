package connect

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
)

// Exposure is memory exposed once and used by any number of peers, any
// number of times, until Close: a KV pool or a host-memory cache tier,
// as NIXL registers memory once and builds transfers over any part of it.
// Every holder of its [Metadata] may read (or write, for a WRITE
// exposure) the whole of it or any part ([Metadata.Select]), concurrently
// with the others; each transfer's outcome arrives on Events. Create one
// with [Connector.Expose]. The memory it names must stay alive until Close
// returns; for a WRITE exposure the caller must not touch it while peers
// may write it, and peers writing at once should write disjoint parts (as
// two goroutines writing the same bytes would, they race). It is safe for
// concurrent use.
type Exposure struct {
	c    *Connector
	name string // "readable" or "writable", as in TransferError.Op
	md   Metadata
	exp  *agent.Exposure
	regs *agent.Registration
	life *expiry // nil without one

	events  chan ExposureEvent
	dropped atomic.Uint64 // events that found events full
	stop    chan struct{} // closed when the exposure ends: stops forward
	fwd     sync.WaitGroup

	closeOnce sync.Once
	closeErr  error

	mu  sync.Mutex
	err error // why it ended: ErrClosed or ErrExpired; nil while open
}

// ExposureEvent is what an [Exposure] reports: one peer's transfer
// completed or failed, the peer released the token or was lost, or the
// exposure expired.
type ExposureEvent struct {
	// Peer is the agent that reported the outcome; the zero UUID for the
	// exposure's expiry.
	Peer uuid.UUID
	// Err is nil when the peer's transfer completed. Otherwise it is a
	// [*TransferError] whose Err matches [ErrCancelled] (the peer
	// cancelled, or its context ended), [ErrReleased] (the peer will not
	// use the token: [Connector.Release]) or [ErrRemoteLost] (the peer
	// was lost), or carries the peer's reason for a failure, quoted; or
	// [ErrExpired], alone, as the exposure's last event when it expired.
	// A transfer that could not start is reported too, matching
	// [ErrNotStarted]: no byte moved, and the peer may try again.
	Err error
	// Note is what the peer attached to its completion with
	// [ContextWithNote] (at most [MaxNote] bytes), or nil. It is the
	// peer's word, like the outcome: nothing here checks it.
	Note []byte
}

// ExposeOption configures one [Connector.Expose] call. [WithExpiry] is
// one, and [WithEventBuffer].
type ExposeOption interface{ applyExpose(*exposeOptions) error }

type exposeOptions struct {
	expiry time.Duration
	buffer int
}

type exposeFunc func(*exposeOptions) error

func (f exposeFunc) applyExpose(o *exposeOptions) error { return f(o) }

// defaultEventBuffer is the capacity of an Exposure's Events.
const defaultEventBuffer = 64

// agentQueue is the least room for events in the agent's queue, which
// forward empties into Events: it absorbs a burst that comes while forward
// is not running, so that drops happen at Events, where they are counted
// per exposure.
const agentQueue = 256

// WithEventBuffer sets how many events an [Exposure] holds for a reader
// of Events that falls behind; events past it are dropped and counted
// ([Exposure.Dropped]), never buffered without bound.
//
// Default: 64.
func WithEventBuffer(n int) ExposeOption {
	return exposeFunc(func(o *exposeOptions) error {
		if n < 1 {
			return fmt.Errorf("%w: WithEventBuffer(%d): want at least 1", ErrInvalidOption, n)
		}
		o.buffer = n
		return nil
	})
}

// ExpiryOption is [WithExpiry]'s option: it configures a Connector
// ([NewConnector]) or one [Connector.Expose] call.
type ExpiryOption struct{ d time.Duration }

func (e ExpiryOption) check() error {
	if e.d <= 0 {
		return fmt.Errorf("%w: WithExpiry(%v): want a positive duration", ErrInvalidOption, e.d)
	}
	return nil
}

func (e ExpiryOption) apply(o *options) error {
	o.expiry = e.d
	return e.check()
}

func (e ExpiryOption) applyExpose(o *exposeOptions) error {
	o.expiry = e.d
	return e.check()
}

// WithExpiry makes exposed memory expire when unused for d: once no peer
// has held the memory, nor sent a notice about it, for d (counted from its
// creation, then from each use's end), the Connector closes it, as Close
// does. A transfer in progress keeps it open however long it takes. A
// passive operation's Wait then returns [ErrExpired], unless it had an
// outcome; an [Exposure] sends an event with ErrExpired and closes Events.
// Given to [NewConnector] it applies to every passive operation
// ([Connector.CreateReadable], [Connector.CreateWritable]) and every
// [Exposure] the Connector makes; given to [Connector.Expose], to that
// exposure alone, overriding the Connector's. Expiry bounds how long
// memory stays exposed to a peer that never comes, without a goroutine
// per exposure waiting for it.
//
// Default: none; exposed memory stays exposed until closed.
func WithExpiry(d time.Duration) ExpiryOption { return ExpiryOption{d} }

// Expose exposes descs, for reading (kind [KindRead]) or writing
// ([KindWrite]), to every holder of the returned exposure's [Metadata],
// until Close or its expiry ([WithExpiry]). Unlike
// [Connector.CreateReadable], which completes once, an Exposure serves any
// number of transfers, concurrent or not, each of the whole token or a
// selection of it, and reports each one's outcome on Events. The memory is
// registered as for CreateReadable. ctx is checked only on entry. Invalid
// descriptors fail with [ErrInvalidDescriptor], invalid options with
// [ErrInvalidOption], a closed Connector with [ErrClosed].
func (c *Connector) Expose(ctx context.Context, kind OperationKind, descs []Descriptor, opts ...ExposeOption) (*Exposure, error) {
	o := exposeOptions{expiry: c.expiry, buffer: defaultEventBuffer}
	for _, opt := range opts {
		if err := opt.applyExpose(&o); err != nil {
			return nil, err
		}
	}
	acc, name := agent.AccessRead, "readable"
	switch kind {
	case KindRead:
	case KindWrite:
		acc, name = agent.AccessWrite, "writable"
	default:
		return nil, fmt.Errorf("%w: Expose: want KindRead or KindWrite, found %v", ErrInvalidOption, kind)
	}
	ls, err := c.locals(descs)
	if err != nil {
		return nil, err
	}
	regs, err := c.enter(ctx, ls)
	if err != nil {
		return nil, err
	}
	defer c.calls.Done()
	exp, err := c.a.ExposeShared(acc, ls, max(o.buffer, agentQueue))
	if err != nil {
		_ = regs.Release()
		return nil, fmt.Errorf("connect: expose: %w", err)
	}
	md := newMetadata(kind, exp.Key(), c.info, ls)
	if err := md.check(); err != nil {
		exp.Revoke()
		_ = regs.Release()
		return nil, err
	}
	e := &Exposure{
		c: c, name: name, md: md, exp: exp, regs: regs,
		events: make(chan ExposureEvent, o.buffer), stop: make(chan struct{}),
	}
	c.mu.Lock()
	c.exposures[e] = struct{}{}
	c.mu.Unlock()
	e.fwd.Add(1)
	go e.forward()
	e.life = startExpiry(o.expiry, exp, func() { e.closeWith(ErrExpired) })
	return e, nil
}

// Metadata returns the token to hand to peers. It grants access to the
// whole exposure until Close; treat it as a secret until then.
func (e *Exposure) Metadata() Metadata { return e.md }

// Events delivers one event per outcome a peer reports (a transfer's
// completion or failure, a release, a loss) and, last, the exposure's
// expiry. It is closed once the exposure is closed or expired, after the
// events reported before that. Its capacity is [WithEventBuffer]'s; an
// event that finds it full is dropped and counted ([Exposure.Dropped]).
// The loss of every peer that used the exposure is reported, once per
// connection it used and once more if a registry declares it departed.
func (e *Exposure) Events() <-chan ExposureEvent { return e.events }

// Dropped counts the events dropped because Events was full. (The agent
// queues up to 256 events, or WithEventBuffer's number if more, before
// they reach Events, and a goroutine of the exposure empties that queue at
// once; should a burst ever overflow it, the Connector's
// Stats().DroppedNotifications counts the loss.)
func (e *Exposure) Dropped() uint64 { return e.dropped.Load() }

// Err returns nil while the exposure is open, then why it ended:
// [ErrClosed] (Close, or the Connector's Close) or [ErrExpired].
func (e *Exposure) Err() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err
}

// Close revokes every peer's access and releases the memory: when it
// returns, no peer touches the memory any more (it waits for the accesses
// in progress, which each backend bounds), and Events is closed. Transfers
// still in flight fail on the peer's side ([ErrAccessDenied]). The error is
// that of releasing the memory's registration. Close is idempotent and
// safe to call concurrently; every call returns the first call's result.
func (e *Exposure) Close() error {
	e.closeWith(ErrClosed)
	e.life.stop()
	return e.closeErr
}

// closeWith ends the exposure for why (ErrClosed or ErrExpired). It does
// not stop the expiry, which calls it.
func (e *Exposure) closeWith(why error) {
	e.closeOnce.Do(func() {
		e.mu.Lock()
		e.err = why
		e.mu.Unlock()
		e.exp.Revoke()
		e.closeErr = e.regs.Release()
		close(e.stop)
		e.fwd.Wait()
		e.c.mu.Lock()
		delete(e.c.exposures, e)
		e.c.mu.Unlock()
		if why == ErrExpired {
			e.c.log.Debug("connect: an exposure expired unused", "op", e.name, "token", e.md)
		}
	})
}

// forward turns the agent's events into Events until the exposure ends,
// then passes on those queued before, adds the expiry's, and closes Events.
func (e *Exposure) forward() {
	defer e.fwd.Done()
	for {
		select {
		case ev := <-e.exp.Events():
			e.pass(ev)
		case <-e.stop:
			for {
				select {
				case ev := <-e.exp.Events():
					e.pass(ev)
					continue
				default:
				}
				break
			}
			if e.Err() == ErrExpired {
				e.send(ExposureEvent{Err: ErrExpired})
			}
			close(e.events)
			return
		}
	}
}

// pass sends the event ev reports, if any.
func (e *Exposure) pass(ev agent.Event) {
	code, ok, err := readEvent(e.name, ev)
	if !ok {
		e.c.log.Debug("connect: dropped a malformed notification", "op", e.name, "from", ev.From, "len", len(ev.Msg))
		return
	}
	out := ExposureEvent{Peer: ev.From, Err: err}
	if code == noticeDone && err == nil {
		out.Note = decodeNote(ev.Msg)
	}
	e.send(out)
}

// send queues ev on Events, or counts it dropped if Events is full.
func (e *Exposure) send(ev ExposureEvent) {
	select {
	case e.events <- ev:
	default:
		e.dropped.Add(1)
	}
}

// Release tells the side that exposed md's memory that this process will
// not use md: a passive operation's Wait then returns a [*TransferError]
// matching [ErrReleased], and an [Exposure] reports it as an event for
// this Connector's agent. The exposure itself stays open until its owner
// closes it (or it expires); other holders of the token are not affected.
// A compact token is resolved first, with ctx. ctx bounds the call, which
// may need a connection to the peer. It returns the error of resolving
// or notifying the peer; a closed Connector fails with [ErrClosed].
func (c *Connector) Release(ctx context.Context, md Metadata) error {
	if md.kind == 0 {
		return fmt.Errorf("%w: Release given the zero Metadata", ErrInvalidMetadata)
	}
	if c.isClosing() {
		return ErrClosed
	}
	peer, err := c.resolve(ctx, md)
	if err != nil {
		return err
	}
	if err := c.a.Notify(ctx, peer, md.key.open(), encodeNotice(noticeReleased, "")); err != nil {
		return fmt.Errorf("connect: release: %w", err)
	}
	return nil
}

// expiry closes an exposure once it has been unused for d: no peer holds
// a lease on it, and none ended one or sent a notice, for d. A timer
// checks when d may have passed; it re-arms itself while the exposure is
// in use.
type expiry struct {
	d     time.Duration
	since time.Time // the exposure's creation
	exp   *agent.Exposure
	fire  func()

	mu      sync.Mutex
	t       *time.Timer
	stopped bool
	running sync.WaitGroup // the timer's callback, armed or running
}

// startExpiry arms an expiry for exp that calls fire; nil if d is 0.
func startExpiry(d time.Duration, exp *agent.Exposure, fire func()) *expiry {
	if d <= 0 {
		return nil
	}
	x := &expiry{d: d, since: time.Now(), exp: exp, fire: fire}
	x.mu.Lock()
	defer x.mu.Unlock()
	x.running.Add(1)
	x.t = time.AfterFunc(d, x.check)
	return x
}

// check fires the expiry if the exposure is unused, else re-arms it for
// when it may be.
func (x *expiry) check() {
	defer x.running.Done()
	leases, last := x.exp.Use()
	if last.Before(x.since) {
		last = x.since
	}
	idle := time.Since(last)
	if leases == 0 && idle >= x.d {
		x.fire()
		return
	}
	next := x.d - idle
	if leases > 0 {
		next = x.d
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if !x.stopped {
		x.running.Add(1)
		x.t.Reset(next)
	}
}

// stop disarms the expiry and waits for a check in progress to end. It
// must not be called from fire. Stopping nil does nothing.
func (x *expiry) stop() {
	if x == nil {
		return
	}
	x.mu.Lock()
	x.stopped = true
	if x.t.Stop() {
		x.running.Done() // the armed callback will not run
	}
	x.mu.Unlock()
	x.running.Wait()
}
