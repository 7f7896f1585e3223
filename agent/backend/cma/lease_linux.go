//go:build linux

package cma

import (
	"encoding/binary"
	"errors"
	"fmt"
	"iter"
	"sync/atomic"
	"time"

	"github.com/goxfer/goxfer/agent"
)

// window is a span of a transfer covered by one lease: requested, granted,
// copied by the workers, ended.
type window struct {
	st      *xstate
	id      uint64 // set, under st.p.mu, when the request is queued; 0 before
	start   cursor
	n       uint64
	pieces  int
	granted chan error // the lease's answer, unless inline
	// addrs are where the peer's grant says to copy each piece of the
	// window, in order: staging buffers for its device memory. nil: at
	// the pieces' remote addresses. Set by the reader before the answer.
	addrs []uint64
	// staged: some of addrs are the peer's staging buffers, not the
	// ranges' own addresses (a WRITE then asks for tFlushed).
	staged bool
	// devs are where the pieces lie in the peer's device allocations
	// mapped here (capDevice), nil if none does; ims hold those mappings
	// until the window ends. Set by the reader before the answer.
	devs   []devAt
	ims    []*imported
	inline bool      // the reader handles the answer: a one-chunk transfer
	held   bool      // granted and not yet ended; under st.p.mu
	parked bool      // waiting in st.p.parked for room; under st.p.mu
	sent   time.Time // when the request was queued; under st.p.mu
	tasks  atomic.Int64
	// dispatched is set when the window's copies start, short when one of
	// them did not copy its bytes: a WRITE window is written in full if
	// dispatched and not short.
	dispatched bool
	short      atomic.Bool
	// flushing: a staged WRITE, ended, whose copy into the peer's device
	// is awaited (tFlushed) in st.p.waiting; set under st.p.mu.
	flushing bool
	// An inline window's guard, armed by begin and disarmed by done; under
	// st.p.mu.
	unhook func() bool // the hook on the transfer's cancellation
	timer  *time.Timer // the bound on the request's answer
}

// begin registers w for its answer and queues its lease request: every
// remote range it covers, so the exposing agent checks them all. If limit
// requests are unended already, w waits in p.parked, in order, until an end
// makes room (done); begin never waits. From then on whoever takes w out of
// p.waiting or p.parked (the reader, fail, the owner giving it up, or an
// inline window's guard) finishes it. An error means w was not registered:
// the peer failed, and the caller finishes w.
func (p *peer) begin(w *window) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.waiting == nil {
		if p.err != nil {
			return p.err
		}
		return fmt.Errorf("cma: peer %s: %w", p.id, agent.ErrRemoteLost)
	}
	if w.inline {
		// Under p.mu, so that nobody finishes w before its guard is armed.
		w.guard()
	}
	if p.inflight >= p.limit { // then windows parked before w go first: unpark keeps them in order
		w.parked = true
		p.parked = append(p.parked, w)
		return nil
	}
	p.request(w)
	return nil
}

// unpark requests parked windows while there is room. The caller holds
// p.mu.
func (p *peer) unpark() {
	for p.inflight < p.limit && len(p.parked) > 0 && p.waiting != nil {
		w := p.parked[0]
		p.parked[0] = nil
		p.parked = p.parked[1:]
		if w.parked { // else given up by its owner
			w.parked = false
			p.request(w)
		}
	}
	if len(p.parked) == 0 {
		p.parked = nil // let a burst's backing array go
	}
}

// request registers w for its answer and queues its lease request. The
// caller holds p.mu, so that the request goes out before any end of it.
func (p *peer) request(w *window) {
	st := w.st
	acc := agent.AccessRead
	if st.write {
		acc = agent.AccessWrite
	}
	w.id = p.seq.Add(1)
	w.sent = time.Now()
	p.waiting[w.id] = w
	p.inflight++
	if len(p.waiting) == 1 {
		p.watch()
	}
	h := header{typ: tBegin, status: uint8(acc), count: uint32(w.pieces), id: w.id, key: st.x.Key}
	p.send(&h, func(b []byte) []byte {
		for pc := range st.x.Pieces(w.start, w.n) {
			b = binary.LittleEndian.AppendUint64(b, pc.RemoteAddr())
			b = binary.LittleEndian.AppendUint64(b, pc.Len)
		}
		return b
	}, nil)
}

// lens yields the lengths of w's pieces, in order.
func (w *window) lens() iter.Seq[uint64] {
	return func(yield func(uint64) bool) {
		for pc := range w.st.x.Pieces(w.start, w.n) {
			if !yield(pc.Len) {
				return
			}
		}
	}
}

// remoteAddr returns where to copy piece pc, of segment seg, of w: at its
// remote address, or in the staging buffer the peer granted for it.
func (w *window) remoteAddr(seg int, pc agent.Piece) uintptr {
	if w.addrs == nil {
		return uintptr(pc.RemoteAddr())
	}
	// One piece per segment the window touches; the first may start
	// inside its segment.
	i, off := seg-w.start.Seg, pc.Off
	if i == 0 {
		off -= w.start.Off
	}
	return uintptr(w.addrs[i] + off)
}

// answer delivers the answer to w's lease request: to the driver, or for a
// one-chunk transfer straight to the copy, on the reader's goroutine, which
// spares a small transfer two goroutine hand-offs.
func (w *window) answer(err error) {
	if !w.inline {
		w.granted <- err // never blocks: one answer per request
		return
	}
	if err != nil {
		w.done(err)
		return
	}
	w.dispatch(w.st.chunk)
}

// unanswered returns how long w's request may still go unanswered before
// the peer is lost: the timeout, less the time since the request was sent.
// A parked window has not been asked for yet.
func (w *window) unanswered() time.Duration {
	p := w.st.p
	p.mu.Lock()
	defer p.mu.Unlock()
	return w.unansweredLocked()
}

// unansweredLocked is unanswered for a caller that holds p.mu.
func (w *window) unansweredLocked() time.Duration {
	p := w.st.p
	if w.id == 0 {
		return p.b.cfg.timeout
	}
	return p.b.cfg.timeout - time.Since(w.sent)
}

// claim takes w's answer away from the reader, if it is still awaited, or
// w out of the parked windows, and reports whether it did. A tombstone
// stays in p.waiting: the answer is still due, and the reader then drops
// it.
func (w *window) claim() bool {
	p := w.st.p
	p.mu.Lock()
	defer p.mu.Unlock()
	return w.claimLocked()
}

// claimLocked is claim for a caller that holds p.mu.
func (w *window) claimLocked() bool {
	p := w.st.p
	if w.parked {
		w.parked = false // unpark skips it
		return true
	}
	if cur, ok := p.waiting[w.id]; ok && cur == w && w.id != 0 && !w.flushing {
		p.waiting[w.id] = nil
		return true
	}
	return false
}

// abandon gives up a lease its driver requested, answered or not: the
// exposing agent handles frames in order, so an end sent now releases the
// lease right after granting it. Only the driver, which owns its windows'
// answers, abandons them.
func (w *window) abandon() {
	w.claim()
	w.done(nil)
}

// guard arms what ends an inline window, which has no driver to wait for
// its answer, before the reader takes that answer: the transfer's
// cancellation and a timer on the request. Neither costs a goroutine while
// it waits; done disarms both. The reader copies the window when granted.
// The caller holds p.mu.
func (w *window) guard() {
	fire := w.fire // one closure for both
	w.unhook = w.st.x.AfterCancel(fire)
	w.timer = time.AfterFunc(w.st.b.cfg.timeout, fire)
}

// fire runs when an inline window's transfer is cancelled or its timer
// expires, and ends the window, unless its answer was taken already:
// cancellation first.
func (w *window) fire() {
	x := w.st.x
	select {
	case <-x.Cancelled():
		if w.claim() {
			w.done(x.CancelErr())
		}
	default:
		w.expire()
	}
}

// expire ends an inline window whose lease request went unanswered for the
// timeout, and fails the peer, unless the answer was taken already.
func (w *window) expire() {
	p := w.st.p
	p.mu.Lock()
	if w.timer == nil { // disarmed by done
		p.mu.Unlock()
		return
	}
	if left := w.unansweredLocked(); left > 0 {
		w.timer.Reset(left) // parked, or sent after the timer started
		p.mu.Unlock()
		return
	}
	claimed := w.claimLocked()
	p.mu.Unlock()
	if claimed {
		err := p.unansweredErr()
		p.fail(err)
		w.done(err)
	}
}

// unansweredErr is the failure of a peer that left a lease request
// unanswered for the timeout.
func (p *peer) unansweredErr() error {
	return fmt.Errorf("cma: peer %s left a lease request unanswered for %v: %w", p.id, p.b.cfg.timeout, agent.ErrRemoteLost)
}

// done ends w's lease and releases its slot and reference. It is called
// once per window, by whoever took it out of p.waiting or p.parked or never
// put it there. The end is queued before the request's room is given to a
// parked window: the exposing side, which handles frames in order, has
// released the lease before it reads the next request. A WRITE written in
// full into staging buffers the peer granted waits, holding its slot and
// reference, until the peer says whether the bytes reached its device
// (flushed).
func (w *window) done(err error) {
	st := w.st
	p := st.p
	// w.id no longer changes: whoever finishes w took it out under p.mu.
	requested := w.id != 0
	written := err == nil && st.write && w.dispatched && !w.short.Load()
	ack := written && w.staged
	p.mu.Lock()
	// Awaited before the end goes out: the answer may come at once.
	awaited := false
	if ack {
		if p.waiting != nil {
			// The reader, or the peer's failure, finishes w (flushed).
			w.flushing, awaited = true, true
			p.waiting[w.id] = w
			if len(p.waiting) == 1 {
				p.watch()
			}
		} else {
			err = p.failureLocked() // the end is not sent: the bytes may not be in the device
		}
	}
	if requested && (err == nil || !errors.Is(err, agent.ErrAccessDenied)) {
		var status uint8
		if written {
			status |= endWritten
		}
		if ack {
			status |= endAck
		}
		p.send(&header{typ: tEnd, status: status, id: w.id}, nil, nil)
	}
	if w.timer != nil { // an inline window's guard
		w.unhook()
		w.timer.Stop()
		w.unhook, w.timer = nil, nil
	}
	last := false
	if w.held {
		w.held = false
		p.holding--
		last = p.holding == 0 && p.err != nil
	}
	if requested {
		p.inflight--
		p.unpark()
	}
	p.mu.Unlock()
	if last {
		p.shut() // the peer failed while w copied: no copy runs any more
	}
	for _, im := range w.ims { // no copy runs on them any more
		im.release()
	}
	w.ims = nil
	if awaited {
		return
	}
	w.finish(err)
}

// flushed finishes a staged WRITE window with the peer's word on its copy
// into the device, or with the peer's failure.
func (w *window) flushed(err error) { w.finish(err) }

// finish releases w's slot and its reference on the transfer.
func (w *window) finish(err error) {
	<-w.st.slots
	w.st.Done(err)
}
