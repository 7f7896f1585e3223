//go:build linux

package cma

import (
	"fmt"
	"time"

	"github.com/goxfer/goxfer/agent"
)

// xstate tracks one transfer: a part for the driver plus one per window
// that holds a lease slot. The last part finishes the transfer.
type xstate struct {
	agent.Parts
	b     *Backend
	p     *peer
	x     *agent.Work
	write bool
	// localDev: some local memory is device memory, which only the
	// device path (copyDevice) reaches (the agent asked DirectDevice).
	localDev bool
	slots    chan struct{} // one per lease requested or held
	lease    uint64        // the most bytes one window covers
	chunk    uint64        // the most bytes one system call copies
	// probe: the device path over the peer's device memory, which the
	// peer shares, or stages if it cannot (memory not shareable) and then
	// only in windows its staging pool holds; it stages a whole lease
	// request if any of its memory cannot be shared. A window is large
	// only over segments known to lie in allocations the peer shared (its
	// grants name them, with their span); one that reaches a segment not
	// known so is a staged one's size, and the windows over the rest of
	// that segment wait for its grant (drive, windows).
	probe bool
}

// What the grants showed of a remote segment's memory (windows).
const (
	segUnknown = iota
	segShared  // in an allocation the peer shared, or host memory
	segStaged  // staged by the peer: windows of at most stagedLease
)

// windows sizes a transfer's windows over the peer's device memory by
// what the grants showed of it (xstate.probe); drive's alone.
type windows struct {
	st      *xstate
	segs    []uint8              // by segment
	shared  map[*imported]uint64 // the peer's allocations shared, by mapping: their ends
	learned bool                 // a grant came back
}

func newWindows(st *xstate) *windows {
	ws := &windows{st: st, segs: make([]uint8, len(st.x.Segments)), shared: map[*imported]uint64{}}
	for i := range st.x.Segments {
		if st.x.Segments[i].Remote.Kind != agent.KindVRAM {
			ws.segs[i] = segShared
		}
	}
	return ws
}

// state returns what is known of segment i.
func (ws *windows) state(i int) uint8 {
	if ws.segs[i] == segUnknown {
		r := ws.st.x.Segments[i].Remote
		for im, end := range ws.shared {
			if r.Addr >= im.base && r.Addr+r.Len <= end {
				ws.segs[i] = segShared
				break
			}
		}
	}
	return ws.segs[i]
}

// span cuts the window from c: up to lease bytes over segments in
// allocations the peer shared, else up to stagedLease.
func (ws *windows) span(c cursor, lease uint64, maxRanges int) (cursor, uint64, int) {
	segs := ws.st.x.Segments
	k, n := c.Seg, uint64(0)
	for k < len(segs) && k-c.Seg < maxRanges && n < lease && ws.state(k) == segShared {
		n += segs[k].Local.Len
		k++
	}
	if k == c.Seg {
		return agent.Span(segs, c, stagedLease, maxRanges)
	}
	return agent.Span(segs[:k], c, lease, maxRanges)
}

// wait reports whether the window from c should wait for the grants
// requested before it, which will say whether the memory there is shared
// or staged: no grant came back yet (the transfer's first window is a
// probe), or c is inside a segment whose start they asked for.
func (ws *windows) wait(c cursor) bool {
	return ws.state(c.Seg) == segUnknown && (c.Off > 0 || !ws.learned)
}

// learn records what w's grant showed: the allocations it shared, and the
// segments it staged.
func (ws *windows) learn(w *window) {
	ws.learned = true
	for _, im := range w.ims {
		ws.shared[im] = im.base + im.size
	}
	for i := range w.pieces {
		if seg := w.start.Seg + i; ws.segs[seg] == segUnknown && (w.devs == nil || w.devs[i].ptr == 0) {
			ws.segs[seg] = segStaged
		}
	}
}

// Windows over the peer's device memory, which its agent stages whole per
// lease from the half of its staging pool kept for peers (agent.Lease.Slice
// refuses a lease that needs more): at most stagedLease bytes each, and
// stagedDepth of them requested ahead, so that the peer's copies between
// device and staging buffers overlap this side's copies.
const (
	stagedLease = 4 << 20
	stagedDepth = 4
)

// remoteVRAM reports whether some of segs' remote memory is device memory.
func remoteVRAM(segs []agent.Segment) bool {
	for i := range segs {
		if segs[i].Remote.Kind != agent.KindDRAM {
			return true
		}
	}
	return false
}

// Post implements [agent.Backend]. It uses the connection Reachable found,
// and fails at once with [agent.ErrRemoteLost] if that connection has ended.
// A transfer of one chunk (WithChunkSize) asks for its lease on the
// calling goroutine and is copied on the connection's reader when the
// grant arrives; a larger one gets a driver goroutine that requests its
// leases (WithLeaseSize, two ahead) and hands their chunks to the copy
// workers. A transfer that reaches the peer's GPU memory has leases and
// chunks of at most 4 MiB, four leases ahead, and copies where the grants
// say (the peer's staging buffers); it fails at once with
// [agent.ErrAccessDenied] if the peer's cma predates staged grants. Such a
// WRITE's last bytes reach the peer's device after w.Finish: the peer
// copies them in as it handles the end of their lease, which has no
// answer, and before any notification sent after it (w.Notify included),
// which carries a failure of that copy ([agent.Event].Err). The backend
// touches w's local memory only until it calls w.Finish. Safe for
// concurrent use.
//
// Where the peer published the exposure in shared host memory
// (WithSharedMemory), the transfer is copied through the peer's segments
// mapped here instead: no lease round trip, at most 1 MiB copied before
// Post returns, larger ones by the workers (shm_linux.go). Where it
// published an exposure of one region of other host memory
// (WithLeaseFree), a transfer of at most 1 MiB is copied with one
// process_vm_readv/writev call before Post returns, with no lease either.
func (b *Backend) Post(x *agent.Work) error {
	if len(x.Notify) > b.cfg.maxNotify {
		// Refused here: once the bytes moved, a notification that cannot
		// be sent no longer fails the transfer (agent.Work.FinishNotify).
		return fmt.Errorf("%w: notification of %d bytes, at most %d", agent.ErrInvalid, len(x.Notify), b.cfg.maxNotify)
	}
	p, err := b.usable(x.Peer)
	if err != nil {
		return err
	}
	if p.shm && sharable(x) && b.postShared(p, x) {
		return nil
	}
	return b.postLeases(p, x)
}

// postLeases moves x under leases: Post's path for memory not shared. On
// an error x was not started and the transfer's count is given back.
func (b *Backend) postLeases(p *peer, x *agent.Work) error {
	st := &xstate{b: b, p: p, x: x, write: x.Op == agent.OpWrite, lease: uint64(b.cfg.lease), chunk: uint64(b.cfg.chunk)}
	depth := b.cfg.leaseDepth
	for i := range x.Segments {
		st.localDev = st.localDev || x.Segments[i].Local.Kind == agent.KindVRAM
	}
	switch {
	case st.localDev && !p.device:
		b.xwg.Done()
		return fmt.Errorf("cma: peer %s: %w: its connection maps no GPU memory (it was reconnected, or sharing is off), and this transfer's local memory is GPU memory", p.id, agent.ErrRemoteLost)
	case p.device && (st.localDev || remoteVRAM(x.Segments)):
		// Copies on the GPU: large windows, a task's worth each.
		st.lease = uint64(b.cfg.ipcLease)
		st.chunk = st.lease
		st.probe = remoteVRAM(x.Segments) && st.lease > stagedLease
		depth = max(depth, ipcDepth)
	case remoteVRAM(x.Segments):
		if !p.staged {
			b.xwg.Done()
			return fmt.Errorf("cma: peer %s: %w: its cma predates staged grants and cannot reach its GPU memory", p.id, agent.ErrAccessDenied)
		}
		st.lease, st.chunk = min(st.lease, stagedLease), min(st.chunk, stagedLease)
		depth = max(depth, stagedDepth)
	}
	st.slots = make(chan struct{}, depth)
	st.Init(x, p.notify, b.xwg.Done)
	// A small transfer is copied on the connection's reader: at most a
	// chunk (WithChunkSize), also on the GPU.
	if end, n, pieces := agent.Span(x.Segments, cursor{}, min(st.chunk, uint64(b.cfg.chunk)), iovMax); end.Seg == len(x.Segments) {
		// One chunk: request the lease here and copy when it is granted.
		st.slots <- struct{}{}
		w := &window{st: st, n: n, pieces: pieces, inline: true}
		st.Add()
		if err := p.begin(w); err != nil {
			w.done(err) // never requested: no answer will come
		}
		st.Done(nil)
		return nil
	}
	go b.drive(st)
	return nil
}

// drive requests the transfer's leases in order, at most leaseDepth at a
// time, and dispatches each granted span's chunks to the workers.
func (b *Backend) drive(st *xstate) {
	defer st.Done(nil)
	x, p := st.x, st.p
	lease, chunk := st.lease, st.chunk
	var ws *windows
	if st.probe {
		ws = newWindows(st)
	}
	timer := time.NewTimer(b.cfg.timeout)
	defer timer.Stop()
	var pending []*window // requested, not yet answered
	defer func() {
		for _, w := range pending { // on failure: end what may be granted
			w.abandon()
		}
	}()
	var c cursor
	for {
		for c.Seg < len(x.Segments) && !st.Failed() {
			if ws != nil && len(pending) > 0 && ws.wait(c) {
				goto wait // the grant of the segment's start sizes the windows over the rest
			}
			select {
			case st.slots <- struct{}{}:
			default:
				if len(pending) > 0 {
					goto wait
				}
				select {
				case st.slots <- struct{}{}:
				case <-x.Cancelled():
					st.Fail(x.CancelErr())
					return
				case <-p.dead:
					st.Fail(p.failure())
					return
				}
			}
			var end cursor
			var n uint64
			var pieces int
			if ws != nil {
				end, n, pieces = ws.span(c, lease, b.cfg.maxRanges)
			} else {
				end, n, pieces = agent.Span(x.Segments, c, lease, b.cfg.maxRanges)
			}
			w := &window{st: st, start: c, n: n, pieces: pieces, granted: make(chan error, 1)}
			st.Add()
			pending = append(pending, w)
			if err := p.begin(w); err != nil {
				st.Fail(err)
				return
			}
			c = end
		}
	wait:
		if len(pending) == 0 || st.Failed() {
			return
		}
		w := pending[0]
		timer.Reset(b.cfg.timeout)
	answer:
		select {
		case err := <-w.granted:
			pending = pending[1:]
			if err != nil {
				w.done(err) // a refused lease holds nothing
				return
			}
			if ws != nil {
				ws.learn(w)
			}
			w.dispatch(chunk)
		case <-x.Cancelled():
			st.Fail(x.CancelErr())
			return
		case <-timer.C:
			if left := w.unanswered(); left > 0 {
				timer.Reset(left) // parked, or sent after the timer started
				goto answer
			}
			err := p.unansweredErr()
			p.fail(err)
			st.Fail(err)
			return
		}
	}
}
