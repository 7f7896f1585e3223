package agent

import (
	"context"
	"sync"

	"github.com/goxfer/goxfer/agent/devmem"
)

// A staged transfer moves local device memory over a backend that cannot
// reach it: the agent cuts the transfer into chunks, copies each chunk's
// device pieces through a pinned host buffer, and posts each chunk to the
// backend as a transfer of its own (a part) whose local memory is that
// buffer. Up to stageDepth chunks are in flight, so that for a WRITE the
// device-to-host copy of one chunk overlaps the sending of the ones before
// it, and for a READ the host-to-device copy of one chunk overlaps the
// receiving of the ones after it. A WRITE's notification goes with the
// last part, posted only once every other part has finished, so it never
// overtakes a byte. A READ's goes out after the transfer has succeeded,
// every copy into device memory included ([Work.FinishNotify] with the
// backend's Notify): a READ whose last copy into the device failed must
// not have told the peer it completed. The caller's transfer finishes once
// every part has finished and every copy into device memory has
// completed: after Done, nothing the transfer started touches its memory.
type staged struct {
	a  *Agent
	b  Backend
	t  *transfer // the caller's transfer
	ds *devState

	slots chan struct{} // one per chunk in flight
	parts sync.WaitGroup
	h2d   chan *stagedPart // READ: parts whose bytes are in their buffer
	h2dWG sync.WaitGroup

	mu   sync.Mutex
	live map[*transfer]struct{} // parts posted and not finished
	err  error
}

// stagedPart is one chunk: its buffer and the device pieces it stages.
type stagedPart struct {
	buf    []byte
	pieces []devPiece
}

// devPiece is a device span and where it sits in a part's buffer.
type devPiece struct {
	addr uint64
	dev  int
	off  uint64
	n    uint64
}

// needsStaging reports whether a transfer over b must stage its local
// memory: some of it is device memory and b cannot reach device memory.
func needsStaging(b Backend, segs []Segment) bool {
	if b.Supports(KindVRAM) {
		return false
	}
	for i := range segs {
		if segs[i].Local.Kind == KindVRAM {
			return true
		}
	}
	return false
}

// postStaged starts t over b through staging.
func (a *Agent) postStaged(b Backend, t *transfer) error {
	ds, err := a.staging()
	if err != nil {
		return err
	}
	s := &staged{a: a, b: b, t: t, ds: ds, slots: make(chan struct{}, stageDepth), live: make(map[*transfer]struct{})}
	go s.run()
	return nil
}

func (s *staged) fail(err error) {
	s.mu.Lock()
	if s.err == nil {
		s.err = err
	}
	live := make([]*transfer, 0, len(s.live))
	for p := range s.live {
		live = append(live, p)
	}
	s.mu.Unlock()
	for _, p := range live {
		p.x.Cancel(err)
	}
}

func (s *staged) failed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err != nil
}

func (s *staged) run() {
	w := &s.t.w
	stop := w.AfterCancel(func() { s.fail(w.CancelErr()) })
	if w.Op == OpRead {
		s.h2d = make(chan *stagedPart, stageDepth)
		s.h2dWG.Add(1)
		go s.toDevice()
	}
	d2h := streams{a: s.a}
	c := Cursor{}
	for c.Seg < len(w.Segments) && !s.failed() {
		select {
		case s.slots <- struct{}{}:
		case <-w.Cancelled():
			s.fail(w.CancelErr())
			continue
		}
		end, n, _ := Span(w.Segments, c, s.ds.chunk, stageMaxPieces)
		last := end.Seg >= len(w.Segments)
		p, segs, err := s.prepare(c, n, &d2h)
		if err != nil {
			<-s.slots
			s.fail(err)
			break
		}
		var notify []byte
		if last && w.Notify != nil && w.Op == OpWrite {
			s.parts.Wait() // every other part first: the notice never overtakes them
			if s.failed() {
				s.release(p)
				<-s.slots
				break
			}
			notify = w.Notify
		}
		if err := s.post(p, segs, notify); err != nil {
			s.release(p)
			<-s.slots
			s.fail(err)
			break
		}
		c = end
	}
	s.parts.Wait()
	if s.h2d != nil {
		close(s.h2d)
		s.h2dWG.Wait()
	}
	if err := d2h.release(); err != nil {
		s.fail(err)
	}
	stop()
	s.mu.Lock()
	err := s.err
	s.mu.Unlock()
	select {
	case <-w.Cancelled():
		err = w.CancelErr()
	default:
	}
	if err == nil && w.Op == OpRead {
		// Bounded by the backend's own limits, as a part's is; Close
		// waits for it.
		w.FinishNotify(func(key Key, msg []byte) error { return s.b.Notify(context.Background(), w.Peer, key, msg) })
		return
	}
	w.Finish(err)
}

// prepare builds the part for the n bytes at c: a staging buffer for its
// device pieces (filled from the device, for a WRITE) and the segments the
// backend moves.
func (s *staged) prepare(c Cursor, n uint64, d2h *streams) (*stagedPart, []Segment, error) {
	w := &s.t.w
	var staged uint64
	count := 0
	for pc := range w.Pieces(c, n) {
		count++
		if pc.Seg.Local.Kind == KindVRAM {
			staged += pc.Len
		}
	}
	p := &stagedPart{}
	if staged > 0 {
		buf, err := s.ds.pool.get(staged, w.Cancelled(), 0)
		if err != nil {
			if s.failed() {
				err = w.CancelErr()
			}
			return nil, nil, err
		}
		p.buf = buf
	}
	segs := make([]Segment, 0, count)
	var off uint64
	for pc := range w.Pieces(c, n) {
		rem := pc.Seg.Remote
		rem.Addr, rem.Len = pc.RemoteAddr(), pc.Len
		if pc.Seg.Local.Kind != KindVRAM {
			segs = append(segs, Segment{Local: DRAM(pc.Local()), Remote: rem})
			continue
		}
		dp := devPiece{addr: pc.LocalAddr(), dev: int(pc.Seg.Local.Device), off: off, n: pc.Len}
		p.pieces = append(p.pieces, dp)
		segs = append(segs, Segment{Local: DRAM(p.buf[off : off+pc.Len : off+pc.Len]), Remote: rem})
		off += pc.Len
	}
	if w.Op == OpWrite && len(p.pieces) > 0 {
		for _, dp := range p.pieces {
			st, err := d2h.get(dp.dev)
			if err == nil {
				err = st.ToHost(p.buf[dp.off:dp.off+dp.n], uintptr(dp.addr))
			}
			if err != nil {
				_ = d2h.sync()
				s.release(p)
				return nil, nil, err
			}
		}
		if err := d2h.sync(); err != nil { // one sync per chunk, however many pieces
			s.release(p)
			return nil, nil, err
		}
	}
	return p, segs, nil
}

func (s *staged) release(p *stagedPart) {
	if p.buf != nil {
		s.ds.pool.put(p.buf)
		p.buf = nil
	}
}

// post starts one part over the backend.
func (s *staged) post(p *stagedPart, segs []Segment, notify []byte) error {
	w := &s.t.w
	var bytes uint64
	for _, sg := range segs {
		bytes += sg.Local.Len
	}
	pt := &transfer{
		a: s.a, backend: s.b.Name(), bytes: bytes,
		cancel: make(chan struct{}), done: make(chan struct{}),
	}
	pt.x.t = pt
	pt.w = Work{Op: w.Op, Peer: w.Peer, Key: w.Key, Segments: segs, Notify: notify, t: pt}
	pt.onDone = func(_ *Xfer, err error) { s.partDone(pt, p, err) }
	s.mu.Lock()
	if s.err != nil {
		s.mu.Unlock()
		return s.err
	}
	s.live[pt] = struct{}{}
	s.parts.Add(1)
	s.mu.Unlock()
	if err := s.b.Post(&pt.w); err != nil {
		s.mu.Lock()
		delete(s.live, pt)
		s.mu.Unlock()
		s.parts.Done()
		return err
	}
	return nil
}

// partDone runs when the backend finishes a part, on its goroutine.
func (s *staged) partDone(pt *transfer, p *stagedPart, err error) {
	s.mu.Lock()
	delete(s.live, pt)
	s.mu.Unlock()
	if err != nil {
		s.fail(err)
	}
	if err == nil && s.h2d != nil && len(p.pieces) > 0 && !s.failed() {
		s.h2d <- p // capacity stageDepth: never blocks, a slot is held per part
	} else {
		s.release(p)
		<-s.slots
	}
	s.parts.Done()
}

// toDevice copies READ parts from their buffers into device memory, in
// order, while later parts are still arriving.
func (s *staged) toDevice() {
	defer s.h2dWG.Done()
	h2d := streams{a: s.a}
	for p := range s.h2d {
		if !s.failed() {
			var err error
			for _, dp := range p.pieces {
				var st devmem.Stream
				if st, err = h2d.get(dp.dev); err == nil {
					err = st.ToDevice(uintptr(dp.addr), p.buf[dp.off:dp.off+dp.n])
				}
				if err != nil {
					break
				}
			}
			if serr := h2d.sync(); err == nil {
				err = serr
			}
			if err != nil {
				s.fail(err)
			}
		}
		s.release(p)
		<-s.slots
	}
	if err := h2d.release(); err != nil {
		s.fail(err)
	}
}
