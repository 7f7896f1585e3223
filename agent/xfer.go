package agent

import (
	"errors"
	"fmt"
	"iter"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/google/uuid"
)

// Op is the direction of a one-sided transfer.
type Op uint8

const (
	// OpRead copies remote memory into local memory.
	OpRead Op = 1
	// OpWrite copies local memory into remote memory.
	OpWrite Op = 2
)

// String returns "read" or "write".
func (o Op) String() string {
	switch o {
	case OpRead:
		return "read"
	case OpWrite:
		return "write"
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// Access returns the access a transfer of this direction needs on the remote.
func (o Op) Access() Access {
	if o == OpWrite {
		return AccessWrite
	}
	return AccessRead
}

// Segment pairs local memory with remote memory of the same length.
type Segment struct {
	Local  Local
	Remote Region
}

// Request describes a transfer to post with [Agent.Post].
type Request struct {
	Op Op
	// Peer is the remote agent, as its metadata describes it. Each request
	// names its peer in full, from the token it came with, so a forged token
	// can misdirect only the transfers that use it.
	Peer     Info
	Key      Key       // the remote exposure's key
	Segments []Segment // any number; each Local.Len == Remote.Len
	// Notify, when non-nil, is delivered to the remote agent under Key once
	// every byte is in place, right after the transfer reports success
	// ([Work.FinishNotify]); a notification that fails then is counted in
	// [Stats].LostNotifications. Backends only read it, so one message may
	// serve many requests; it must stay unchanged until the agent is
	// closed or the peer has it (connect builds one per operation).
	Notify []byte
	// Backend forces a backend by name; empty lets the agent choose.
	Backend string
	// OnDone, when set, is called once with the transfer's outcome when it
	// finishes, on the goroutine that finishes it (a backend's, or the
	// caller's: a small transfer may finish before Post returns), before
	// Done is closed. It must not block; it is how layers above learn of
	// completion without a goroutine per transfer.
	OnDone func(x *Xfer, err error)
}

// Xfer is the caller's handle on a transfer posted with [Agent.Post]: wait
// for it, read its outcome, cancel it. Its methods are safe for concurrent
// use.
type Xfer struct{ t *transfer }

// Work is a transfer as the backend that moves it sees it: what to move and
// where, and the calls that end it. The fields are set by the agent before
// [Backend.Post] and must not be changed; the memory the segments name is
// the backend's to touch only until it calls Finish. Methods are safe for
// concurrent use.
type Work struct {
	Op       Op
	Peer     Info
	Key      Key
	Segments []Segment
	Notify   []byte

	t *transfer
}

// transfer is one posted transfer; the caller's handle and the backend's
// work item point into it, so the pair costs one allocation.
type transfer struct {
	x Xfer
	w Work

	a       *Agent
	backend string
	path    string                 // backend, "+staging" where device memory is staged
	via     atomic.Pointer[string] // the path a backend named (Work.Via)
	bytes   uint64
	onDone  func(*Xfer, error)

	cancel     chan struct{}
	cancelOnce sync.Once
	cause      atomic.Pointer[error]

	afterMu   sync.Mutex
	after     []*afterCancel // registered, not yet started; under afterMu
	afterBuf  [1]*afterCancel
	cancelled bool // under afterMu

	done     chan struct{}
	doneOnce sync.Once
	err      error
}

// Op returns the transfer's direction.
func (x *Xfer) Op() Op { return x.t.w.Op }

// Peer returns the remote agent's identity.
func (x *Xfer) Peer() uuid.UUID { return x.t.w.Peer.ID }

// Bytes returns the total length of the transfer's segments.
func (x *Xfer) Bytes() uint64 { return x.t.bytes }

// Backend returns the name of the backend moving the transfer's bytes.
func (x *Xfer) Backend() string { return x.t.backend }

// Path returns how the bytes move: the backend's name, with "+staging"
// appended when device memory on either side goes through pinned host
// buffers because the backend cannot reach it directly ("tcp+staging"), or
// with the backend's own device path where it moves device memory itself
// ("cma+ipc": the peer's GPU memory mapped by CUDA IPC, see
// [DeviceDirect]; "cma+shm": the peer's shared memory mapped, see
// [Work.Via]). A backend may name its path only as it moves the bytes:
// read Path once Done is closed.
func (x *Xfer) Path() string {
	if v := x.t.via.Load(); v != nil {
		return *v
	}
	return x.t.path
}

// Done is closed when the transfer has finished, successfully or not, and
// its backend no longer touches its local memory.
func (x *Xfer) Done() <-chan struct{} { return x.t.done }

// Err returns the transfer's outcome once Done is closed, and nil before.
func (x *Xfer) Err() error {
	select {
	case <-x.t.done:
		return x.t.err
	default:
		return nil
	}
}

// Cancel asks the backend to abort the transfer, without waiting; cause, if
// non-nil, is joined to [ErrCancelled] in the transfer's error. Wait on
// Done to learn when the backend has let go of the local memory. A transfer
// that completes before the backend notices may still succeed. Only the
// first Cancel (or abort by the agent) counts; cancelling a finished
// transfer does nothing.
func (x *Xfer) Cancel(cause error) {
	t := x.t
	t.cancelOnce.Do(func() {
		err := ErrCancelled
		if cause != nil && !errors.Is(cause, ErrCancelled) {
			err = fmt.Errorf("%w: %w", ErrCancelled, cause)
		}
		t.cause.Store(&err)
		close(t.cancel)
		t.runAfter()
	})
}

// abort cancels the transfer with err as its outcome, not joined to
// ErrCancelled: the transfer did not stop by anyone's choice.
func (t *transfer) abort(err error) {
	t.cancelOnce.Do(func() {
		t.cause.Store(&err)
		close(t.cancel)
		t.runAfter()
	})
}

type afterCancel struct {
	t *transfer
	f func()
}

// Bytes returns the total length of the transfer's segments.
func (w *Work) Bytes() uint64 { return w.t.bytes }

// AfterCancel arranges for f to run in its own goroutine once the transfer
// is cancelled (at once if it already is), as [context.AfterFunc] does: a
// backend learns of cancellation without a goroutine per transfer waiting
// for it. stop unregisters f and reports whether it did so before f was
// started; after a false, f has started or will.
func (w *Work) AfterCancel(f func()) (stop func() bool) {
	t := w.t
	a := &afterCancel{t: t, f: f}
	t.afterMu.Lock()
	if t.cancelled {
		t.afterMu.Unlock()
		go f()
		a.t = nil
		return a.stop
	}
	if t.after == nil {
		t.after = t.afterBuf[:0]
	}
	t.after = append(t.after, a)
	t.afterMu.Unlock()
	return a.stop
}

func (a *afterCancel) stop() bool {
	t := a.t
	if t == nil {
		return false
	}
	t.afterMu.Lock()
	defer t.afterMu.Unlock()
	i := slices.Index(t.after, a)
	if i < 0 {
		return false
	}
	t.after = slices.Delete(t.after, i, i+1)
	return true
}

func (t *transfer) runAfter() {
	t.afterMu.Lock()
	t.cancelled = true
	fs := t.after
	t.after = nil
	t.afterMu.Unlock()
	for _, a := range fs {
		go a.f()
	}
}

// Cancelled is closed when the transfer has been cancelled ([Xfer.Cancel],
// [Agent.Close], [Agent.PeerDeparted]). Backends select on it between
// chunks, or use [Work.AfterCancel].
func (w *Work) Cancelled() <-chan struct{} { return w.t.cancel }

// CancelErr returns the error a backend should finish a cancelled transfer
// with: [ErrCancelled] joined with the cause given to [Xfer.Cancel], or the
// error of an agent that aborted the transfer ([Agent.PeerDeparted]).
func (w *Work) CancelErr() error {
	if p := w.t.cause.Load(); p != nil {
		return *p
	}
	return ErrCancelled
}

// Done is closed once [Work.Finish] has been called.
func (w *Work) Done() <-chan struct{} { return w.t.done }

// Via names the path by which the backend moves a transfer of host memory,
// when it chose one of its own as it went (cma: "shm", the peer's shared
// memory mapped): [Xfer.Path] then reads the backend's name, "+", and how.
// A transfer whose path names staging or a device path keeps it. Call it
// before Finish.
func (w *Work) Via(how string) {
	if w.t.path != w.t.backend {
		return
	}
	p := w.t.backend + "+" + how
	w.t.via.Store(&p)
}

// Finish records the transfer's outcome and releases its waiters: the
// backend has let go of the local memory. Backends call it exactly once
// ([Parts] does for transfers moved in parts); later calls are ignored. It
// runs Request.OnDone on the calling goroutine.
func (w *Work) Finish(err error) { w.finish(err, nil) }

// FinishNotify finishes w with success, as Finish(nil) does, and then,
// on the calling goroutine, delivers w.Notify (when not nil) with send:
// the waiters are released before the notification is written, as
// ARCHITECTURE semantic 2 orders them (the active Wait returns, then the
// passive side is notified), and [Agent.Close] waits for send to return
// before it stops the backends, so a Close right after the active Wait
// does not lose it. A send that fails cannot fail a transfer that already
// succeeded: it is counted in [Stats].LostNotifications and logged at
// debug level. Backends that do not finish through [Parts] call it once
// every byte is in place; send must return within the backend's own bounds
// (a dead peer, the backend's Close).
func (w *Work) FinishNotify(send func(key Key, msg []byte) error) {
	if w.Notify == nil {
		w.Finish(nil)
		return
	}
	w.finish(nil, func() {
		// The waiter just woken waits in this processor's run-next slot
		// until this goroutine blocks: yield, so that it runs first.
		runtime.Gosched()
		if err := send(w.Key, w.Notify); err != nil {
			w.t.a.lostNotify(w, err)
		}
	})
}

// finish is Finish, then after (when not nil) on the calling goroutine
// once the waiters are released, while Close still counts the transfer:
// Close does not stop the backends before after has returned.
func (w *Work) finish(err error, after func()) {
	t := w.t
	first, tracked := false, false
	t.doneOnce.Do(func() {
		first = true
		t.err = err
		// Out of Stats().InFlight before anyone can see it finish (OnDone
		// wakes connect's waiters), so that a caller that saw it finish
		// never counts it; still counted by Close, which must not return
		// before Done is closed.
		tracked = t.a.untrack(t)
		if after != nil && !tracked {
			// A part of a staged transfer, which the agent does not
			// track: its parent, still counted until onDone below ends
			// the part, must not let Close stop the backends before
			// after (the notification) has returned. Counted here, while
			// the parent's count keeps xferWG above zero.
			t.a.xferWG.Add(1)
			tracked = true
		}
		if t.onDone != nil {
			t.onDone(&t.x, err)
		}
		close(t.done)
	})
	if !first {
		return
	}
	// after runs outside the Once: a later Finish from another goroutine
	// (a backend's cancellation path, say) must not wait for it.
	if after != nil {
		after()
	}
	if tracked {
		t.a.xferWG.Done()
	}
}

// Pieces yields the pieces of w's n bytes that start at c; see [Pieces].
func (w *Work) Pieces(c Cursor, n uint64) iter.Seq[Piece] { return Pieces(w.Segments, c, n) }

// Cursor is a position in a transfer's segments: byte Off of segment Seg.
// Backends cut a transfer into spans (frames, leases, chunks) between two
// cursors; each contiguous part of one segment in a span is a piece.
type Cursor struct {
	Seg int
	Off uint64
}

// Span returns where the span starting at c ends, its bytes and its
// pieces: at most maxBytes bytes and maxPieces pieces. Walk the span with
// [Pieces] (or [Work.Pieces]) from c for n bytes.
func Span(segs []Segment, c Cursor, maxBytes uint64, maxPieces int) (end Cursor, n uint64, pieces int) {
	for c.Seg < len(segs) && n < maxBytes && pieces < maxPieces {
		l := segs[c.Seg].Local.Len
		take := min(l-c.Off, maxBytes-n)
		n += take
		pieces++
		c.Off += take
		if c.Off == l {
			c.Seg, c.Off = c.Seg+1, 0
		}
	}
	return c, n, pieces
}

// Piece is one contiguous part of one segment: Len bytes at offset Off of
// segment Seg.
type Piece struct {
	Seg *Segment
	Off uint64
	Len uint64
}

// Local returns the piece's local bytes (nil for memory Go cannot address,
// such as VRAM).
func (p Piece) Local() []byte {
	if p.Seg.Local.Mem == nil {
		return nil
	}
	return p.Seg.Local.Mem[p.Off : p.Off+p.Len : p.Off+p.Len]
}

// LocalAddr returns the address of the piece's local bytes.
func (p Piece) LocalAddr() uint64 { return p.Seg.Local.Addr + p.Off }

// RemoteAddr returns the address of the piece's remote bytes.
func (p Piece) RemoteAddr() uint64 { return p.Seg.Remote.Addr + p.Off }

// Pieces yields, in order, the pieces of the n bytes of segs that start at
// c, as [Span] cut them: every backend walks a span this way to build its
// frames, I/O vectors or requests. n must not run past the last segment.
// Breaking out of the loop early is allowed.
func Pieces(segs []Segment, c Cursor, n uint64) iter.Seq[Piece] {
	return func(yield func(Piece) bool) {
		for n > 0 {
			sg := &segs[c.Seg]
			take := min(sg.Local.Len-c.Off, n)
			if !yield(Piece{Seg: sg, Off: c.Off, Len: take}) {
				return
			}
			n -= take
			if c.Off += take; c.Off == sg.Local.Len {
				c.Seg, c.Off = c.Seg+1, 0
			}
		}
	}
}
