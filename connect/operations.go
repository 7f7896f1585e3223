package connect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
)

// Status is where an operation stands.
type Status uint8

const (
	// StatusInitialized: a passive operation no peer has touched yet.
	StatusInitialized Status = iota
	// StatusInProgress: bytes are moving, or a peer has begun using a
	// passive operation.
	StatusInProgress
	// StatusComplete: every byte is in place (active side), or the peer
	// reported completion (passive side).
	StatusComplete
	// StatusCancelled: cancelled by Cancel, a context, the peer, Close or
	// its expiry, or released by the peer (the operation's error matches
	// [ErrCancelled], [ErrClosed], [ErrExpired] or [ErrReleased]).
	StatusCancelled
	// StatusErrored: failed for any other reason; Wait returns why.
	StatusErrored
)

// String returns INIT, PROC, DONE, STOP or ERR.
func (s Status) String() string {
	switch s {
	case StatusInitialized:
		return "INIT"
	case StatusInProgress:
		return "PROC"
	case StatusComplete:
		return "DONE"
	case StatusCancelled:
		return "STOP"
	case StatusErrored:
		return "ERR"
	}
	return fmt.Sprintf("Status(%d)", uint8(s))
}

func (s Status) terminal() bool { return s >= StatusComplete }

// statusOf classifies a finished operation's outcome.
func statusOf(err error) Status {
	switch {
	case err == nil:
		return StatusComplete
	case errors.Is(err, ErrCancelled), errors.Is(err, ErrClosed),
		errors.Is(err, ErrExpired), errors.Is(err, ErrReleased):
		return StatusCancelled
	}
	return StatusErrored
}

// ReadableOperation exposes local memory for reading by the holder of its
// [Metadata] ([Connector.BeginRead]); Wait reports the first outcome a peer
// reports. Create one with [Connector.CreateReadable]. It is safe for
// concurrent use. The memory it names must stay alive and unchanged until
// Close returns.
type ReadableOperation struct{ passiveOp }

// WritableOperation exposes local memory for writing by the holder of its
// [Metadata] ([Connector.BeginWrite]); Wait reports the first outcome a peer
// reports. Create one with [Connector.CreateWritable]. It is safe for
// concurrent use. The memory it names holds the peer's bytes once Wait
// returns nil; it must stay alive, and the caller must not touch it, until
// Close returns.
type WritableOperation struct{ passiveOp }

// ReadOperation reads remote memory into local memory. Start one with
// [Connector.BeginRead]. It is safe for concurrent use. The local memory
// must stay alive and untouched until Wait returns (or, if nobody waits,
// until the transfer has ended: see Wait). It needs no Close.
type ReadOperation struct{ activeOp }

// WriteOperation writes local memory into remote memory. Start one with
// [Connector.BeginWrite]. It is safe for concurrent use. The local memory
// must stay alive and unchanged until Wait returns (or, if nobody waits,
// until the transfer has ended: see Wait). It needs no Close.
type WriteOperation struct{ activeOp }

// CreateReadable exposes descs for reading by the holder of the returned
// operation's [Metadata]. The memory is registered with the Connector's
// backends (registrations are reference-counted, so several operations may
// share a buffer) and stays readable until the operation is closed, or
// until it expires unused when the Connector was given [WithExpiry]. ctx is
// checked only on entry: creating waits on no peer. Invalid descriptors
// fail with [ErrInvalidDescriptor], a closed Connector with [ErrClosed].
// For memory that many peers read, many times, see [Connector.Expose].
func (c *Connector) CreateReadable(ctx context.Context, descs ...Descriptor) (*ReadableOperation, error) {
	o := &ReadableOperation{}
	return made(o, c.create(ctx, &o.passiveOp, KindRead, descs))
}

// CreateWritable exposes descs for writing by the holder of the returned
// operation's [Metadata], as [Connector.CreateReadable] does for reading.
func (c *Connector) CreateWritable(ctx context.Context, descs ...Descriptor) (*WritableOperation, error) {
	o := &WritableOperation{}
	return made(o, c.create(ctx, &o.passiveOp, KindWrite, descs))
}

// BeginRead starts reading the remote memory md names into local, index by
// index, and returns without waiting for the bytes. md must be a READ token
// (else [ErrKindMismatch]) naming as many descriptors as local, of the same
// sizes (else [ErrSizeMismatch]); both are checked before any byte moves.
// A compact token ([Metadata.Compact]) is resolved first, with ctx, through
// the Connector's [Resolver]. Invalid arguments, a failed resolution, a
// closed Connector ([ErrClosed]) come as plain errors; a ctx already done
// comes as a [*TransferError] matching [ErrCancelled] and ctx.Err(), as
// when it ends during the transfer, and so does a transfer the agent could
// not start (no backend both sides share reaches the peer, a backend
// refused it), with an empty Backend. The peer is told of these, and of
// local descriptors of the wrong sizes, best effort (for at most 10 s),
// from a goroutine the Connector owns: a passive operation then fails
// (size mismatch) or is cancelled (ctx), but survives a transfer that could
// not start, since no byte moved and a retry may succeed; a reader that
// gives up should then [Connector.Release] the token.
//
// A note put on ctx with [ContextWithNote] travels with the completion
// notice to the passive side, where an [Exposure] reports it.
//
// ctx bounds the whole transfer, not just the call, as with
// [exec.CommandContext]: if it ends before the transfer finishes, the
// transfer is cancelled, with an error matching both [ErrCancelled] and
// ctx.Err() (and the cause, for a context cancelled with one). The context
// given to [ReadOperation.Wait] cancels the transfer too when it ends: on
// the active side no context bounds only the wait.
func (c *Connector) BeginRead(ctx context.Context, md Metadata, local ...Descriptor) (*ReadOperation, error) {
	o := &ReadOperation{}
	return made(o, c.begin(ctx, &o.activeOp, agent.OpRead, md, local))
}

// BeginWrite starts writing local into the remote memory md names, index by
// index, as [Connector.BeginRead] does for reading; md must be a WRITE
// token.
func (c *Connector) BeginWrite(ctx context.Context, md Metadata, local ...Descriptor) (*WriteOperation, error) {
	o := &WriteOperation{}
	return made(o, c.begin(ctx, &o.activeOp, agent.OpWrite, md, local))
}

// made returns o, or nil and err if making it failed.
func made[T any](o *T, err error) (*T, error) {
	if err != nil {
		return nil, err
	}
	return o, nil
}

// passiveOp is the side that exposes memory and waits for the peer.
type passiveOp struct {
	c    *Connector
	name string // "readable" or "writable"
	md   Metadata
	exp  *agent.Exposure
	regs *agent.Registration
	life *expiry   // nil without one
	made time.Time // for the observer; zero without one

	closeOnce sync.Once
	closeErr  error

	// The outcome is decided by the first terminal event, whoever takes it
	// off the exposure's queue: Wait, Status or Close. Only the holder of
	// the turn takes events, and it records each before giving the turn
	// back, so that an event is always either still queued or already
	// recorded. Without it, Close could find the queue empty while a Wait
	// held a completion it had not yet recorded, and record ErrClosed over
	// it.
	turn  chan struct{} // capacity 1: full while the turn is held
	yield chan struct{} // a Wait blocked on the queue hands its turn over here

	mu     sync.Mutex
	status Status
	err    error
	done   chan struct{} // closed when status becomes terminal
}

func (c *Connector) create(ctx context.Context, o *passiveOp, kind OperationKind, descs []Descriptor) error {
	ls, err := c.locals(descs)
	if err != nil {
		return err
	}
	regs, err := c.enter(ctx, ls)
	if err != nil {
		return err
	}
	defer c.calls.Done()
	acc, name := agent.AccessRead, "readable"
	if kind == KindWrite {
		acc, name = agent.AccessWrite, "writable"
	}
	exp, err := c.a.Expose(acc, ls)
	if err != nil {
		_ = regs.Release()
		return fmt.Errorf("connect: expose: %w", err)
	}
	md := newMetadata(kind, exp.Key(), c.info, ls)
	if err := md.check(); err != nil {
		exp.Revoke()
		_ = regs.Release()
		return err
	}
	*o = passiveOp{
		c: c, name: name, md: md, exp: exp, regs: regs,
		turn: make(chan struct{}, 1), yield: make(chan struct{}),
		done: make(chan struct{}),
	}
	if c.observe != nil {
		o.made = time.Now()
	}
	c.mu.Lock()
	c.passive[o] = struct{}{}
	c.mu.Unlock()
	o.life = startExpiry(c.expiry, exp, func() { o.closeWith(ErrExpired) })
	return nil
}

// Metadata returns the token to hand to the peer. It grants access to the
// operation's memory until Close; treat it as a secret until then.
func (o *passiveOp) Metadata() Metadata { return o.md }

// Wait blocks until the peer reports completion (nil), reports that it
// failed or was cancelled (a [*TransferError], matching [ErrCancelled] when
// the peer cancelled), releases the token unused (a [*TransferError]
// matching [ErrReleased]), is lost (a [*TransferError] matching
// [ErrRemoteLost]), until the operation or its Connector is closed
// ([ErrClosed]), until it expires ([ErrExpired], with [WithExpiry]), or
// until ctx is done (ctx.Err(), unwrapped). A context
// that ends leaves the operation open and its status unchanged: Wait may be
// called again, and the peer's access is not affected. The operation's
// outcome is the first of these events, other than ctx's end; once it has
// one, every Wait returns it, also after Close. Safe to call concurrently.
func (o *passiveOp) Wait(ctx context.Context) error {
	for {
		if s, err := o.outcome(); s.terminal() {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		select {
		case <-o.done:
		case <-ctx.Done():
		case o.turn <- struct{}{}:
			o.await(ctx)
		}
	}
}

// await, holding the turn, waits for the next event and records it, then
// gives the turn back; or hands the turn to acquire, without taking an
// event.
func (o *passiveOp) await(ctx context.Context) {
	select {
	case ev := <-o.exp.Events():
		o.handle(ev)
	case <-o.yield:
		return // the turn is acquire's now
	case <-o.done: // decided while this Wait was taking the turn
	case <-ctx.Done():
	}
	<-o.turn
}

// acquire takes the turn: at once from a Wait blocked on the queue, or once
// its holder has recorded the event it took. Give it back with release.
func (o *passiveOp) acquire() {
	select {
	case o.turn <- struct{}{}:
	case o.yield <- struct{}{}:
	}
}

func (o *passiveOp) release() { <-o.turn }

// Status returns where the operation stands: [StatusInitialized] until a
// peer uses it, [StatusInProgress] once one has, then its outcome's status.
// It notices a completion the peer reported even if nobody is waiting for
// it, and every event queued before the call, even one a concurrent Wait is
// taking. It never blocks for long: at most while a concurrent Status or
// Close records an event. Safe to call concurrently.
func (o *passiveOp) Status() Status {
	if s, _ := o.outcome(); !s.terminal() {
		o.acquire()
		o.drain()
		o.release()
	}
	s, _ := o.outcome()
	if s == StatusInitialized && o.exp.Peer() != uuid.Nil {
		return StatusInProgress
	}
	return s
}

// Close revokes the peer's access and releases the memory: when it returns,
// no peer can touch the memory any more, and the caller may reuse or free
// it. It waits for the peer accesses in progress to end, which each backend
// bounds (see docs/concepts.md, Lifetimes). A Wait in progress returns
// [ErrClosed], unless the operation already had an outcome (the peer's
// completion, failure or cancellation, or its loss), which it then returns,
// as every later Wait does. The error is that of releasing the memory's
// registration. Close is idempotent and safe to call concurrently; every
// call returns the first call's result.
func (o *passiveOp) Close() error {
	o.closeWith(ErrClosed)
	o.life.stop() // after closeWith: an expiry firing now closes nothing, and ends
	return o.closeErr
}

// closeWith closes the operation, recording why (ErrClosed, ErrExpired)
// unless it already has an outcome. It does not stop the expiry, which
// calls it.
func (o *passiveOp) closeWith(why error) {
	o.closeOnce.Do(func() {
		o.exp.Revoke()
		o.closeErr = o.regs.Release()
		// An outcome reported before Close still counts, even one a Wait is
		// taking off the queue at this moment: with the turn, every event
		// that came before is either queued, for drain, or recorded.
		o.acquire()
		o.drain()
		o.finish(StatusCancelled, why)
		o.release()
		o.c.mu.Lock()
		delete(o.c.passive, o)
		o.c.mu.Unlock()
		if why == ErrExpired {
			o.c.log.Debug("connect: an exposure expired unused", "op", o.name, "token", o.md)
		}
	})
}

// drain handles the events queued so far, without waiting for more. The
// caller holds the turn.
func (o *passiveOp) drain() {
	for {
		select {
		case ev := <-o.exp.Events():
			o.handle(ev)
		default:
			return
		}
	}
}

func (o *passiveOp) outcome() (Status, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.status, o.err
}

// finish records the operation's outcome unless it already has one. The
// caller holds the turn, so no other finish runs meanwhile: the observer,
// called without the lock, sees the outcome before any Wait returns it.
func (o *passiveOp) finish(s Status, err error) {
	o.mu.Lock()
	decided := o.status.terminal()
	o.mu.Unlock()
	if decided {
		return
	}
	if o.c.observe != nil {
		var n uint64
		for _, r := range o.md.regions {
			n += r.Len
		}
		o.c.observe(OpReport{Kind: o.md.kind, Role: RolePassive, Bytes: n, Duration: time.Since(o.made), Status: s, Err: err})
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.status, o.err = s, err
	close(o.done)
}

// handle turns an exposure event into the operation's outcome. Events after
// the outcome, and events that decide nothing, are dropped. The caller holds
// the turn.
func (o *passiveOp) handle(ev agent.Event) {
	code, ok, err := readEvent(o.name, ev)
	switch {
	case !ok:
		o.c.log.Debug("connect: dropped a malformed notification", "op", o.name, "from", ev.From, "len", len(ev.Msg))
	case code == noticeUnstarted: // no byte moved: the peer may try again
		o.c.log.Debug("connect: a peer's transfer could not start", "op", o.name, "from", ev.From, "err", err)
	default:
		o.finish(statusOf(err), err)
	}
}

// readEvent reads what an exposure event reports of a peer's use of the
// operation named name: the notice's code (0 for the peer's loss), false
// for a notification that is malformed or of an unknown code, and the
// outcome, nil for a completion.
func readEvent(name string, ev agent.Event) (code byte, ok bool, err error) {
	fail := func(err error) error {
		return &TransferError{Op: name, Peer: ev.From, Err: err}
	}
	if ev.Kind == agent.EventPeerLost {
		err := ev.Err
		if !errors.Is(err, ErrRemoteLost) {
			err = fmt.Errorf("%w: %w", ErrRemoteLost, err)
		}
		return 0, true, fail(err)
	}
	if ev.Kind != agent.EventNotify {
		return 0, false, nil
	}
	code, reason, ok := decodeNotice(ev.Msg)
	if !ok {
		return 0, false, nil
	}
	switch code {
	case noticeDone:
		if ev.Err != nil { // the peer's WRITE did not all reach GPU memory
			return code, true, fail(ev.Err)
		}
		return code, true, nil
	case noticeCancelled:
		return code, true, fail(fmt.Errorf("%w by the peer: %q", ErrCancelled, reason))
	case noticeReleased:
		return code, true, fail(fmt.Errorf("%w by the peer", ErrReleased))
	case noticeUnstarted:
		return code, true, fail(fmt.Errorf("%w (no byte moved): %q", ErrNotStarted, reason))
	}
	if ev.Err != nil { // the peer failed because its WRITE did not reach this side's GPU memory
		return code, true, fail(fmt.Errorf("%w: %w: %q", ev.Err, errPeerFailed, reason))
	}
	return code, true, fail(fmt.Errorf("%w: %q", errPeerFailed, reason))
}

// activeOp is the side that moves the bytes. Its transfer's completion
// callback finishes it, so that memory is released and the peer hears of a
// failure even if nobody calls Wait, without a goroutine per operation.
type activeOp struct {
	c    *Connector
	name string // "read" or "write"
	x    *agent.Xfer
	peer agent.Info
	key  sealedKey // as in Metadata: fmt prints an op without the key
	regs *agent.Registration
	kind OperationKind
	sent time.Time // Begin's start, for the observer; zero without one

	mu       sync.Mutex
	stop     func() bool // detaches the transfer from Begin's context
	finished bool

	err  error         // the outcome, set before done is closed
	done chan struct{} // closed when finished
}

func (c *Connector) begin(ctx context.Context, o *activeOp, op agent.Op, md Metadata, descs []Descriptor) error {
	want, call := KindRead, "BeginRead"
	if op == agent.OpWrite {
		want, call = KindWrite, "BeginWrite"
	}
	switch {
	case md.kind == 0:
		return fmt.Errorf("%w: %s given the zero Metadata", ErrInvalidMetadata, call)
	case md.kind != want:
		return fmt.Errorf("%w: %s needs a %v token, got a %v token", ErrKindMismatch, call, want, md.kind)
	case len(descs) != md.Len():
		err := fmt.Errorf("%w: %d local descriptors != %d remote descriptors", ErrSizeMismatch, len(descs), md.Len())
		c.tell(md, noticeFailed, err)
		return err
	}
	note, err := noteOf(ctx)
	if err != nil {
		return err
	}
	ls, err := c.locals(descs)
	if err != nil {
		return err
	}
	segs := make([]agent.Segment, len(ls))
	for i, l := range ls {
		r := md.regions[i]
		if l.Len != r.Len {
			err := fmt.Errorf("%w: descriptor %d: local size %d != remote size %d", ErrSizeMismatch, i, l.Len, r.Len)
			c.tell(md, noticeFailed, err)
			return err
		}
		segs[i] = agent.Segment{Local: l, Remote: r}
	}
	if c.isClosing() { // spare a closed Connector the resolver's round trip
		return ErrClosed
	}
	var sent time.Time
	if c.observe != nil {
		sent = time.Now()
	}
	name := op.String()
	if ctx.Err() != nil {
		return c.unstarted(ctx, name, md)
	}
	peer, err := c.resolve(ctx, md)
	if err != nil {
		if ctx.Err() != nil {
			return c.unstarted(ctx, name, md)
		}
		return err
	}
	regs, err := c.enter(ctx, ls)
	if err != nil {
		if ctx.Err() != nil {
			return c.unstarted(ctx, name, md)
		}
		return err
	}
	defer c.calls.Done()
	*o = activeOp{c: c, name: name, peer: peer, key: md.key, regs: regs, kind: want, sent: sent, done: make(chan struct{})}
	// Tracked before posting: a small transfer may finish inside Post.
	c.mu.Lock()
	c.active[o] = struct{}{}
	c.watchers.Add(1)
	c.mu.Unlock()
	x, err := c.a.Post(ctx, agent.Request{
		Op: op, Peer: peer, Key: md.key.open(), Segments: segs,
		Notify: encodeDone(note), Backend: c.force,
		OnDone: o.finish,
	})
	if err != nil {
		c.mu.Lock()
		delete(c.active, o)
		c.mu.Unlock()
		_ = regs.Release()
		if ctx.Err() != nil && !errors.Is(err, ErrCancelled) {
			err = fmt.Errorf("%w: %w", ErrCancelled, ctxErr(ctx))
		}
		// No backend moved a byte: Backend stays empty.
		err = &TransferError{Op: o.name, Peer: o.peer.ID, Err: err}
		if c.observe != nil {
			var n uint64
			for _, s := range segs {
				n += s.Local.Len
			}
			c.observe(OpReport{Kind: want, Role: RoleActive, Bytes: n, Duration: time.Since(sent), Status: statusOf(err), Err: err})
		}
		// Telling the peer may take a connection: not on the caller's time.
		go func() {
			defer c.watchers.Done()
			code := byte(noticeUnstarted)
			if errors.Is(err, ErrCancelled) {
				code = noticeCancelled
			}
			o.notifyPeer(code, err)
		}()
		return err
	}
	o.x = x
	stop := context.AfterFunc(ctx, func() { x.Cancel(ctxErr(ctx)) })
	o.mu.Lock()
	if o.finished {
		stop()
	} else {
		o.stop = stop
	}
	o.mu.Unlock()
	if c.log.Enabled(ctx, slog.LevelDebug) { // spares the hot path the arguments' allocations
		c.log.Debug("connect: transfer posted", "op", o.name, "peer", o.peer.ID, "backend", x.Backend(), "descriptors", len(segs), "bytes", x.Bytes())
	}
	return nil
}

// finish is the transfer's completion callback: it runs once, on the
// backend's goroutine, and must not block.
func (o *activeOp) finish(x *agent.Xfer, err error) {
	o.mu.Lock()
	o.finished = true
	if o.stop != nil {
		o.stop()
	}
	o.mu.Unlock()
	if rerr := o.regs.Release(); rerr != nil {
		o.c.log.Warn("connect: releasing memory failed", "op", o.name, "err", rerr)
	}
	if err != nil {
		err = &TransferError{Op: o.name, Peer: o.peer.ID, Backend: x.Backend(), Err: err}
	}
	o.err = err
	c := o.c
	c.mu.Lock()
	delete(c.active, o)
	c.mu.Unlock()
	if c.observe != nil { // before the waiter wakes: Wait returns after the report
		c.observe(OpReport{
			Kind: o.kind, Role: RoleActive, Backend: x.Backend(), Path: x.Path(), Bytes: x.Bytes(),
			Duration: time.Since(o.sent), Status: statusOf(err), Err: err,
		})
	}
	// Waking the waiter is the last thing done on this goroutine before it
	// goes back to the network: the waiter then runs at once instead of
	// waiting for the bookkeeping.
	close(o.done)
	if err == nil {
		c.watchers.Done()
		return
	}
	// Telling the peer may block on the network: off the backend's
	// goroutine, still owned by the Connector, which waits for it on Close.
	go func() {
		defer c.watchers.Done()
		o.tellPeer(err)
	}()
}

// tellPeerTimeout bounds telling the peer of a failure: the notice may
// need a new connection to a peer that is slow to answer.
const tellPeerTimeout = 10 * time.Second

// tellPeer tells the passive side, best effort, that the operation failed or
// was cancelled, so that its Wait returns instead of waiting for a
// completion that will never come.
func (o *activeOp) tellPeer(err error) {
	code := byte(noticeFailed)
	if errors.Is(err, ErrCancelled) || errors.Is(err, ErrClosed) {
		code = noticeCancelled
	}
	o.notifyPeer(code, err)
}

// notifyPeer sends the passive side a notice of code with err as the
// reason, best effort, unless the peer is lost.
func (o *activeOp) notifyPeer(code byte, err error) {
	if errors.Is(err, ErrRemoteLost) {
		return // nobody to tell
	}
	ctx, cancel := context.WithTimeout(context.Background(), tellPeerTimeout)
	defer cancel()
	if nerr := o.c.a.Notify(ctx, o.peer, o.key.open(), encodeNotice(code, err.Error())); nerr != nil {
		o.c.log.Debug("connect: could not tell the peer about a failed transfer", "op", o.name, "peer", o.peer.ID, "err", nerr)
	}
}

// unstarted is the error of an operation whose ctx ended before it was
// posted: the shape of one cancelled by its ctx in flight, with no
// backend. The peer is told.
func (c *Connector) unstarted(ctx context.Context, name string, md Metadata) error {
	err := &TransferError{Op: name, Peer: md.Agent(), Err: fmt.Errorf("%w: %w", ErrCancelled, ctxErr(ctx))}
	c.tell(md, noticeCancelled, err)
	return err
}

// tell sends the passive side md names a notice of code with err as the
// reason, best effort (for at most 10 s), from a goroutine the Connector
// owns: for an operation that failed before it had a peer to post to.
func (c *Connector) tell(md Metadata, code byte, err error) {
	c.mu.Lock()
	if c.closing {
		c.mu.Unlock()
		return
	}
	c.watchers.Add(1)
	c.mu.Unlock()
	go func() {
		defer c.watchers.Done()
		ctx, cancel := context.WithTimeout(context.Background(), tellPeerTimeout)
		defer cancel()
		peer, nerr := c.resolve(ctx, md)
		if nerr == nil {
			nerr = c.a.Notify(ctx, peer, md.key.open(), encodeNotice(code, err.Error()))
		}
		if nerr != nil {
			c.log.Debug("connect: could not tell the peer about a failed transfer", "peer", md.Agent(), "err", nerr)
		}
	}()
}

// Wait blocks until every byte is in place (nil: for a read, landed in local
// memory; for a write, acknowledged by the remote) or the operation fails
// (a [*TransferError]). When ctx ends first, Wait cancels the transfer, as
// [ReadOperation.Cancel] does, for every waiter: it does not stop waiting
// alone. It then waits until the backend no longer touches local memory,
// and returns an error matching both [ErrCancelled] and ctx.Err(), unless
// the transfer completed, failed or was cancelled meanwhile. When Wait
// returns, the local memory is the caller's again; it is too once the
// transfer has ended, even if nobody calls Wait. Once the operation has
// finished, every Wait returns the same result. Safe to call concurrently.
func (o *activeOp) Wait(ctx context.Context) error {
	select {
	case <-o.done:
		return o.err
	default:
	}
	select {
	case <-o.done:
	case <-ctx.Done():
		o.x.Cancel(ctxErr(ctx))
		<-o.done
	}
	return o.err
}

// ctxErr is why ctx ended: ctx.Err(), joined with the cause given to its
// cancel function (context.WithCancelCause) when there is one, so that the
// operation's error matches both.
func ctxErr(ctx context.Context) error {
	err, cause := ctx.Err(), context.Cause(ctx)
	if cause == nil || cause == err {
		return err
	}
	return fmt.Errorf("%w: %w", err, cause)
}

// Cancel asks the transfer to stop and returns without waiting; Wait then
// returns an error matching [ErrCancelled] once the local memory is free,
// unless the transfer completed first. The peer is told, best effort, from
// a goroutine the Connector owns. Cancelling a finished operation does
// nothing. Safe to call concurrently.
func (o *activeOp) Cancel() { o.x.Cancel(nil) }

// Status returns [StatusInProgress] until the transfer finishes, then
// [StatusComplete], [StatusCancelled] or [StatusErrored]. It never blocks.
func (o *activeOp) Status() Status {
	select {
	case <-o.done:
		return statusOf(o.err)
	default:
		return StatusInProgress
	}
}

// Backend returns the name of the backend moving the bytes ("mem", "cma",
// "tcp", ...).
func (o *activeOp) Backend() string { return o.x.Backend() }

// Path returns how the bytes move: the backend's name, with "+staging"
// when GPU memory on either side goes through pinned host buffers because
// the backend cannot reach it directly ("tcp+staging"); "ucx" alone when
// UCX moves GPU memory itself.
func (o *activeOp) Path() string { return o.x.Path() }

// Notifications from the active side to the passive side: one code byte,
// then for a completion the active side's note (at most [MaxNote] bytes),
// for the other codes a UTF-8 reason of at most maxReason bytes. They are
// remote input, so decodeNotice trusts nothing in them.
const (
	noticeDone      = 1
	noticeCancelled = 2
	noticeFailed    = 3
	// noticeUnstarted: a transfer failed before any byte moved (it could
	// not be posted); a retry may follow, so the passive side carries on.
	noticeUnstarted = 4
	// noticeReleased: the holder of the token will not use it.
	noticeReleased = 5

	maxReason = 256
)

// MaxNote is the most bytes a note ([ContextWithNote]) may hold.
const MaxNote = 256

// doneNotice is the notification of a successful transfer with no note;
// backends only read it.
var doneNotice = encodeNotice(noticeDone, "")

// encodeDone is the notification of a successful transfer carrying note.
func encodeDone(note []byte) []byte {
	if len(note) == 0 {
		return doneNotice
	}
	return append([]byte{noticeDone}, note...)
}

// decodeNote returns the note of a completion notice msg, a copy cut at
// MaxNote bytes, or nil.
func decodeNote(msg []byte) []byte {
	if len(msg) < 2 || msg[0] != noticeDone {
		return nil
	}
	n := msg[1:]
	return append([]byte(nil), n[:min(len(n), MaxNote)]...)
}

type noteKey struct{}

// ContextWithNote returns a copy of ctx that carries note: a
// [Connector.BeginRead] or [Connector.BeginWrite] given it sends note to
// the passive side with its completion, as NIXL's notif_msg does, and an
// [Exposure] reports it in the peer's [ExposureEvent] ("layer 7 done").
// A note holds at most [MaxNote] bytes; Begin fails with [ErrInvalidOption]
// given a longer one. note is copied. One-shot passive operations ignore
// notes. The note travels like gRPC's outgoing metadata: on the context,
// so that the Begin calls keep their signatures.
func ContextWithNote(ctx context.Context, note []byte) context.Context {
	return context.WithValue(ctx, noteKey{}, append([]byte(nil), note...))
}

// noteOf returns the note ctx carries, or nil.
func noteOf(ctx context.Context) ([]byte, error) {
	note, _ := ctx.Value(noteKey{}).([]byte)
	if len(note) > MaxNote {
		return nil, fmt.Errorf("%w: ContextWithNote: want a note of at most %d bytes, found %d", ErrInvalidOption, MaxNote, len(note))
	}
	return note, nil
}

func encodeNotice(code byte, reason string) []byte {
	if len(reason) > maxReason {
		reason = strings.ToValidUTF8(reason[:maxReason], "")
	}
	return append([]byte{code}, reason...)
}

// decodeNotice returns the code and reason of msg, or false for a message
// that is empty or carries an unknown code (from a newer peer, perhaps), which
// the caller ignores. A reason too long is cut, invalid UTF-8 replaced.
func decodeNotice(msg []byte) (code byte, reason string, ok bool) {
	if len(msg) == 0 || msg[0] < noticeDone || msg[0] > noticeReleased {
		return 0, "", false
	}
	r := msg[1:]
	if len(r) > maxReason {
		r = r[:maxReason]
	}
	return msg[0], strings.ToValidUTF8(string(r), "\uFFFD"), true
}
