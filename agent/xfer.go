package agent

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
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

// Request describes a transfer to post.
type Request struct {
	Op Op
	// Peer is the remote agent, as its metadata describes it. Each request
	// names its peer in full, from the token it came with, so a forged token
	// can misdirect only the transfers that use it.
	Peer     Info
	Key      Key       // the remote exposure's key
	Segments []Segment // any number; each Local.Len == Remote.Len
	// Notify, when non-nil, is delivered to the remote agent under Key once
	// every byte is in place, before the transfer reports success.
	Notify []byte
	// Backend forces a backend by name; empty lets the agent choose.
	Backend string
	// OnDone, when set, is called once with the transfer's outcome when it
	// finishes, on the goroutine that finishes it, before Done is closed. It
	// must not block; it is how layers above learn of completion without a
	// goroutine per transfer.
	OnDone func(x *Xfer, err error)
}

// Xfer is a transfer in flight: the agent's handle for the caller, and the
// work item a backend executes. Its methods are safe for concurrent use.
type Xfer struct {
	Op       Op
	Peer     Info
	Key      Key
	Segments []Segment
	Notify   []byte

	a       *Agent
	backend string
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

// Bytes returns the total length of the transfer's segments.
func (x *Xfer) Bytes() uint64 { return x.bytes }

// Backend returns the name of the backend moving the transfer's bytes.
func (x *Xfer) Backend() string { return x.backend }

// Done is closed when the transfer has finished, successfully or not, and
// its backend no longer touches its local memory.
func (x *Xfer) Done() <-chan struct{} { return x.done }

// Err returns the transfer's outcome once Done is closed, and nil before.
func (x *Xfer) Err() error {
	select {
	case <-x.done:
		return x.err
	default:
		return nil
	}
}

// Cancel asks the backend to abort the transfer; cause, if non-nil, is
// joined to ErrCancelled in the transfer's error. Wait on Done to learn when
// the backend has let go of the local memory. Cancelling a finished transfer
// does nothing.
func (x *Xfer) Cancel(cause error) {
	x.cancelOnce.Do(func() {
		err := ErrCancelled
		if cause != nil && !errors.Is(cause, ErrCancelled) {
			err = fmt.Errorf("%w: %w", ErrCancelled, cause)
		}
		x.cause.Store(&err)
		close(x.cancel)
		x.runAfter()
	})
}

// abort cancels the transfer with err as its outcome, not joined to
// ErrCancelled: the transfer did not stop by anyone's choice.
func (x *Xfer) abort(err error) {
	x.cancelOnce.Do(func() {
		x.cause.Store(&err)
		close(x.cancel)
		x.runAfter()
	})
}

type afterCancel struct {
	x *Xfer
	f func()
}

// AfterCancel arranges for f to run in its own goroutine once the transfer
// is cancelled (at once if it already is), as context.AfterFunc does: a
// backend learns of cancellation without a goroutine per transfer waiting
// for it. stop unregisters f and reports whether it did so before f was
// started; after a false, f has started or will. Safe for concurrent use.
func (x *Xfer) AfterCancel(f func()) (stop func() bool) {
	a := &afterCancel{x: x, f: f}
	x.afterMu.Lock()
	if x.cancelled {
		x.afterMu.Unlock()
		go f()
		a.x = nil
		return a.stop
	}
	if x.after == nil {
		x.after = x.afterBuf[:0]
	}
	x.after = append(x.after, a)
	x.afterMu.Unlock()
	return a.stop
}

func (a *afterCancel) stop() bool {
	x := a.x
	if x == nil {
		return false
	}
	x.afterMu.Lock()
	defer x.afterMu.Unlock()
	i := slices.Index(x.after, a)
	if i < 0 {
		return false
	}
	x.after = slices.Delete(x.after, i, i+1)
	return true
}

func (x *Xfer) runAfter() {
	x.afterMu.Lock()
	x.cancelled = true
	fs := x.after
	x.after = nil
	x.afterMu.Unlock()
	for _, a := range fs {
		go a.f()
	}
}

// Cancelled is closed when the transfer has been cancelled. Backends select
// on it between chunks.
func (x *Xfer) Cancelled() <-chan struct{} { return x.cancel }

// CancelErr returns the error a backend should finish a cancelled transfer
// with: ErrCancelled joined with the cause given to Cancel, or the error of
// an agent that aborted the transfer (Agent.PeerDeparted).
func (x *Xfer) CancelErr() error {
	if p := x.cause.Load(); p != nil {
		return *p
	}
	return ErrCancelled
}

// Finish records the transfer's outcome and releases waiters. Backends call
// it exactly once; later calls are ignored.
func (x *Xfer) Finish(err error) {
	x.doneOnce.Do(func() {
		x.err = err
		// Out of Stats().InFlight before anyone can see it finish (OnDone
		// wakes connect's waiters), so that a caller that saw it finish
		// never counts it; still counted by Close, which must not return
		// before Done is closed.
		tracked := x.a.untrack(x)
		if x.onDone != nil {
			x.onDone(x, err)
		}
		close(x.done)
		if tracked {
			x.a.xferWG.Done()
		}
	})
}

// Cursor is a position in a transfer's segments: byte Off of segment Seg.
// Backends cut a transfer into spans (frames, leases, chunks) between two
// cursors; each contiguous part of one segment in a span is a piece.
type Cursor struct {
	Seg int
	Off uint64
}

// Span returns where the span starting at c ends, its bytes and its
// pieces: at most maxBytes bytes and maxPieces pieces.
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
