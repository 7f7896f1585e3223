package tcp

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
)

// inlineMax is the largest single-frame transfer posted from the caller's
// goroutine, sparing small transfers a goroutine hand-off.
const inlineMax = 64 << 10

// peerKey names a remote agent at one address.
type peerKey struct {
	id   uuid.UUID
	addr string
}

// peer is the dialling side's state for one remote agent: its data streams
// and its control connection.
type peer struct {
	b    *Backend
	id   uuid.UUID
	addr string

	ready    chan struct{} // closed when dialling ended
	dead     chan struct{} // closed when the peer failed
	streams  []*stream     // data streams; set (under mu) before ready is closed
	ctrl     *stream       // notifications only; likewise
	rr       atomic.Uint32
	chunk    uint64 // most bytes in a frame: ours, or less if the peer takes less; set before ready is closed
	pieces   int    // most pieces in a frame, likewise
	trailers bool   // the peer takes a WRITE's notification in its frame (stTrailer), likewise

	// session names this peer's connections to the listener, which groups
	// them into one agent.Link: random, so a stranger claiming this agent's
	// identity cannot join them.
	session [16]byte

	mu       sync.Mutex
	err      error
	failOnce sync.Once

	// under Backend.mu
	users    int        // transfers and notifications using the peer
	lastUsed time.Time  // when users last dropped to zero
	ip       netip.Addr // the address its connections reach
	conns    int        // its connections counted in Backend.out
	ended    bool       // failed or retired: counts nothing more
}

// stream is one connection to a peer. Requests are written under the
// connection's write lock; the stream's reader goroutine matches answers to
// requests in order.
type stream struct {
	p       *peer
	w       *wconn
	pc      *patientConn // under br; reader only
	br      *bufio.Reader
	slots   chan struct{} // one token per frame awaiting its answer
	pending chan frame    // frames awaiting answers, in order

	// under w.wl
	dead bool
	err  error // why the stream died, set with dead
	seq  uint64
	head []byte // header and piece table of the frame being written
	bufs [][]byte
	out  net.Buffers

	rhdr    [hdrSize]byte // reader only
	writing atomic.Bool   // a frame is being written

	// The transfers whose memory the reader and the writer touch now,
	// under tmu, so that cancelling one can fence them (wfence, and the
	// reader's pc.fence).
	tmu     sync.Mutex
	landing *xstate
	sending *xstate
	wfence  fence
}

// frame is one request awaiting its answer.
type frame struct {
	st    *xstate
	id    uint64
	start cursor
	n     uint64
	size  uint64 // bytes on the wire: header, table, a WRITE's payload and trailer
	typ   uint8
	note  []byte // a WRITE's notification, sent in its trailer (stTrailer)
}

// xstate tracks one transfer: a part per frame in flight plus one for the
// goroutine posting them, and one for each connection writing its memory.
// The last part finishes the transfer.
type xstate struct {
	agent.Parts
	b *Backend
	x *agent.Work
	p *peer

	mu        sync.Mutex
	abandoned bool // cancelled: answers still to come land nowhere
	queued    int  // frames sent whose answers have not begun to land

	// The notification went in the trailer of the transfer's one frame,
	// whose acknowledgement says the peer delivered it: Parts sends none.
	// Set before the frame is sent.
	inFrame bool

	unwatch func() bool // set by watch before any frame is sent
}

// trailer puts the transfer's notification in the trailer of f, its one
// frame, if it is a WRITE and the peer takes trailers: the peer delivers
// it once the payload landed and before it acknowledges.
func (st *xstate) trailer(f *frame) {
	x := st.x
	if f.typ == tWrite && x.Notify != nil && len(x.Notify) <= maxNotify && st.p.trailers {
		f.note, st.inFrame = x.Notify, true
	}
}

// notify sends the transfer's notification for Parts, unless it went in
// the frame's trailer.
func (st *xstate) notify(key agent.Key, msg []byte) error {
	if st.inFrame {
		return nil
	}
	return st.p.notifyDone(key, msg)
}

// finished runs after the transfer's Finish.
func (st *xstate) finished() {
	if st.unwatch() {
		st.b.wg.Done() // the abandoning goroutine will never run
	}
	st.p.release()
	st.b.wg.Done()
}

// watch arranges for st to be abandoned if it is cancelled before it
// finishes: cancelling must not wait for a peer's answer, since a hostile
// peer may never give one. No goroutine waits meanwhile; a cancelled
// transfer gets one ([agent.Work.AfterCancel]). Call it while st holds its
// count in b.wg, before any frame is sent.
func (st *xstate) watch() {
	st.b.wg.Add(1) // the abandoning goroutine's, given back by finished if it never runs
	st.unwatch = st.x.AfterCancel(func() {
		defer st.b.wg.Done()
		st.abandon(st.x.CancelErr())
	})
}

// abandon finishes the transfer with err without waiting for the answers
// still due: the frames awaiting one are released now (their answers, when
// they come, are read and dropped), and a connection reading into or
// writing from the transfer's memory is fenced, so that it lets go of the
// memory at once; the transfer finishes when it has.
func (st *xstate) abandon(err error) {
	st.Fail(err)
	st.mu.Lock()
	if st.abandoned {
		st.mu.Unlock()
		return
	}
	st.abandoned = true
	n := st.queued
	st.queued = 0
	if st.p.isReady() {
		for _, s := range st.p.all() {
			s.fenceFor(st)
		}
	}
	st.mu.Unlock()
	for range n {
		st.Done(nil)
	}
}

// fenceFor stops s's reader and writer from touching st's memory. Callers
// hold st.mu.
func (s *stream) fenceFor(st *xstate) {
	s.tmu.Lock()
	defer s.tmu.Unlock()
	if s.landing == st {
		s.pc.fence.raise(s.w.c.SetReadDeadline)
	}
	if s.sending == st {
		s.wfence.raise(s.w.c.SetWriteDeadline)
	}
}

// Post implements [agent.Backend]: it dials the peer in the background if
// it is not connected, and never waits for it (a small transfer is written
// on the caller's goroutine only as far as the socket takes it at once).
// The backend reads or writes w's local memory until it calls w.Finish.
func (b *Backend) Post(x *agent.Work) error {
	if len(x.Notify) > maxNotify {
		// Refused here: once the bytes moved, a notification that cannot
		// be sent no longer fails the transfer (agent.Work.FinishNotify).
		return fmt.Errorf("%w: notification of %d bytes, at most %d", agent.ErrInvalid, len(x.Notify), maxNotify)
	}
	p, err := b.peerFor(x.Peer)
	if err != nil {
		return err
	}
	st := &xstate{b: b, x: x, p: p}
	st.Init(x, st.notify, st.finished)
	st.watch()
	typ := uint8(tRead)
	if x.Op == agent.OpWrite {
		typ = tWrite
	}
	if p.usable() && x.Bytes() <= inlineMax {
		end, n, pieces := agent.Span(x.Segments, cursor{}, p.chunk, p.pieces)
		if end.Seg == len(x.Segments) {
			if s := p.idleStream(); s != nil {
				// Inline only if the stream is free this instant: a small
				// transfer never waits behind another one's frame here,
				// nor for the peer to take it (sendLocked).
				if s.w.wl.tryLock() {
					f := frame{st: st, n: n, typ: typ}
					st.trailer(&f)
					st.Add()
					s.sendLocked(f, pieces, true)
					st.Done(nil)
					return nil
				}
				<-s.slots
			}
		}
	}
	b.wg.Add(1)
	go b.drive(st, typ)
	return nil
}

// drive posts a transfer's frames, waiting for free slots.
func (b *Backend) drive(st *xstate, typ uint8) {
	defer b.wg.Done()
	defer st.Done(nil)
	x, p := st.x, st.p
	select {
	case <-p.ready:
	case <-x.Cancelled():
		st.Fail(x.CancelErr())
		return
	}
	if err := p.failure(); err != nil {
		st.Fail(err)
		return
	}
	chunk := p.chunk
	if typ == tWrite && len(p.streams) > 1 && x.Bytes() > 2*chunk {
		b.driveParallel(st, chunk)
		return
	}
	for c := (cursor{}); c.Seg < len(x.Segments); {
		if st.Failed() {
			return
		}
		end, n, pieces := agent.Span(x.Segments, c, chunk, p.pieces)
		s, err := p.acquire(x)
		if err != nil {
			st.Fail(err)
			return
		}
		f := frame{st: st, start: c, n: n, typ: typ}
		if c == (cursor{}) && end.Seg == len(x.Segments) {
			st.trailer(&f)
		}
		st.Add()
		s.send(f, pieces)
		c = end
	}
}

// driveParallel posts a large WRITE with one writer per stream, each taking
// the next frame when its stream has a free slot. Writing a WRITE frame
// blocks until the socket drains, so one writer would move the bytes at the
// speed of one connection.
func (b *Backend) driveParallel(st *xstate, chunk uint64) {
	x, p := st.x, st.p
	var mu sync.Mutex
	var c cursor
	next := func() (f frame, pieces int, ok bool) {
		mu.Lock()
		defer mu.Unlock()
		if c.Seg >= len(x.Segments) || st.Failed() {
			return f, 0, false
		}
		end, n, pieces := agent.Span(x.Segments, c, chunk, p.pieces)
		f = frame{st: st, start: c, n: n, typ: tWrite}
		c = end
		return f, pieces, true
	}
	var wg sync.WaitGroup
	for _, s := range p.streams {
		wg.Go(func() {
			for {
				select {
				case s.slots <- struct{}{}:
				case <-x.Cancelled():
					st.Fail(x.CancelErr())
					return
				case <-p.dead:
					st.Fail(p.failure())
					return
				}
				f, pieces, ok := next()
				if !ok {
					<-s.slots
					return
				}
				st.Add()
				s.send(f, pieces)
			}
		})
	}
	wg.Wait()
}

// peerFor returns the peer's state, dialling it in the background if it is
// not connected yet.
func (b *Backend) peerFor(info agent.Info) (*peer, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, agent.ErrClosed
	}
	raw, _ := info.Conn(Name)
	ci, err := parseConnInfo(raw)
	if err != nil {
		return nil, fmt.Errorf("tcp: peer %s: %w: %v", info.ID, agent.ErrInvalid, err)
	}
	b.wg.Add(1) // the transfer's, released by xstate.finished or by the caller on error
	// Connections are keyed by identity and address together: a token that
	// claims a known agent's identity at another address gets connections
	// of its own and never redirects anyone else's transfers.
	k := peerKey{info.ID, ci.addr}
	if p := b.peers[k]; p != nil {
		p.users++
		return p, nil
	}
	p := &peer{b: b, id: info.ID, addr: ci.addr, ready: make(chan struct{}), dead: make(chan struct{}), users: 1}
	_, _ = rand.Read(p.session[:])
	b.peers[k] = p
	b.wg.Add(1)
	go p.dial()
	return p, nil
}

// release ends one use of p begun by peerFor.
func (p *peer) release() {
	b := p.b
	b.mu.Lock()
	if p.users--; p.users == 0 {
		p.lastUsed = time.Now()
	}
	b.mu.Unlock()
}

// reapable removes the peers idle for the idle timeout from b.peers and
// returns them, to be retired. Callers hold b.mu.
func (b *Backend) reapable(now time.Time) []*peer {
	var idle []*peer
	for k, p := range b.peers {
		if p.users == 0 && now.Sub(p.lastUsed) >= b.cfg.idle && p.isReady() {
			delete(b.peers, k)
			idle = append(idle, p)
		}
	}
	return idle
}

// reserve counts one more connection of p to ip against
// WithMaxOutgoingPerIP, retiring the peers at ip idle the longest to make
// room, and reports whether it could. Connections to one address are
// bounded because a token names any identity it likes at any address: a
// token issuer must not make this agent hoard connections.
func (b *Backend) reserve(p *peer, ip netip.Addr) (bool, []*peer) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed || p.ended {
		return false, nil
	}
	var evicted []*peer
	for b.out[ip] >= b.cfg.maxOut {
		var lru *peer
		for _, q := range b.peers {
			if q.ip == ip && q.users == 0 && q.conns > 0 && (lru == nil || q.lastUsed.Before(lru.lastUsed)) {
				lru = q
			}
		}
		if lru == nil {
			return false, evicted
		}
		delete(b.peers, peerKey{lru.id, lru.addr})
		b.unreserve(lru)
		evicted = append(evicted, lru)
	}
	b.out[ip]++
	p.ip = ip
	p.conns++
	return true, evicted
}

// reserve counts one more connection of p to ip (Backend.reserve).
func (p *peer) reserve(ip netip.Addr) error {
	b := p.b
	ok, evicted := b.reserve(p, ip)
	for _, q := range evicted {
		q.retire()
	}
	if ok {
		return nil
	}
	if err := p.failure(); err != nil {
		return err
	}
	return fmt.Errorf("tcp: dial peer %s at %q: this agent holds %d connections to that address, none idle: %w",
		p.id, p.addr, b.cfg.maxOut, ErrOutgoingLimit)
}

// unreserve uncounts p's connections. Callers hold b.mu.
func (b *Backend) unreserve(p *peer) {
	p.ended = true
	if p.conns == 0 {
		return
	}
	if b.out[p.ip] -= p.conns; b.out[p.ip] <= 0 {
		delete(b.out, p.ip)
	}
	p.conns = 0
}

func (p *peer) isReady() bool {
	select {
	case <-p.ready:
		return true
	default:
		return false
	}
}

// all returns p's streams and its control connection; p must be ready.
func (p *peer) all() []*stream {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ctrl == nil {
		return nil
	}
	return append(p.streams[:len(p.streams):len(p.streams)], p.ctrl)
}

func (p *peer) usable() bool {
	select {
	case <-p.ready:
		return p.failure() == nil
	default:
		return false
	}
}

func (p *peer) failure() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// idleStream takes a slot on the first stream with no frame in flight, or
// returns nil. A small transfer takes it: one at a time, transfers then
// keep to one connection, whose reader (and the peer's server) is awake
// or, in latency mode, polling; in flight together, they spread over the
// streams.
func (p *peer) idleStream() *stream {
	for _, s := range p.streams {
		if len(s.pending) > 0 {
			continue
		}
		select {
		case s.slots <- struct{}{}:
			return s
		default:
		}
	}
	return p.tryStream()
}

// tryStream takes a slot on a stream with one free, or returns nil.
func (p *peer) tryStream() *stream {
	n := len(p.streams)
	start := int(p.rr.Add(1))
	for i := range n {
		s := p.streams[(start+i)%n]
		select {
		case s.slots <- struct{}{}:
			return s
		default:
		}
	}
	return nil
}

// acquire takes a slot on some stream, waiting if all are busy.
func (p *peer) acquire(x *agent.Work) (*stream, error) {
	select {
	case <-x.Cancelled():
		return nil, x.CancelErr()
	default:
	}
	if s := p.tryStream(); s != nil {
		return s, nil
	}
	s := p.streams[int(p.rr.Add(1))%len(p.streams)]
	select {
	case s.slots <- struct{}{}:
		return s, nil
	case <-x.Cancelled():
		return nil, x.CancelErr()
	case <-p.dead:
		return nil, p.failure()
	}
}

// dial connects p within the backend's lifetime: closing the backend ends
// a dial or handshake in progress.
func (p *peer) dial() {
	defer p.b.wg.Done()
	if err := p.connect(p.b.ctx); err != nil {
		p.fail(err)
	}
	close(p.ready)
}

func (p *peer) connect(ctx context.Context) error {
	b := p.b
	n := b.cfg.streams
	all := make([]*stream, 0, n+1)
	chunk, pieces := b.cfg.chunk, b.cfg.maxPieces
	trailers := true
	ap, err := netip.ParseAddrPort(p.addr)
	literal := err == nil
	for i := 0; i <= n; i++ {
		if literal { // counted before it exists
			if err := p.reserve(ap.Addr().Unmap()); err != nil {
				closeStreams(all)
				return err
			}
		}
		c, err := b.dial(ctx, p.addr)
		if err != nil {
			closeStreams(all)
			return p.lost("dial", err)
		}
		if !literal {
			if err := p.reserve(remoteIP(c)); err != nil {
				_ = c.Close()
				closeStreams(all)
				return err
			}
		}
		s, in, err := p.handshake(ctx, c, uint8(i))
		if err != nil {
			_ = c.Close()
			closeStreams(all)
			return err
		}
		chunk, pieces = peerLimits(chunk, pieces, in)
		trailers = trailers && in.trailers
		all = append(all, s)
	}
	p.chunk, p.pieces, p.trailers = uint64(chunk), pieces, trailers
	for _, s := range all {
		if !b.track(s.w) {
			closeStreams(all)
			return agent.ErrClosed
		}
	}
	select { // their ping intervals may be shorter than any the keepalive loop knows
	case b.nudge <- struct{}{}:
	default:
	}
	p.mu.Lock()                   // fail, from Close, may look at them concurrently
	if err := p.err; err != nil { // failed or retired while dialling
		p.mu.Unlock()
		closeStreams(all)
		return err
	}
	p.streams, p.ctrl = all[:n], all[n]
	p.mu.Unlock()
	for _, s := range all {
		b.wg.Add(1)
		go s.read()
	}
	return nil
}

func closeStreams(ss []*stream) {
	for _, s := range ss {
		_ = s.w.c.Close()
	}
}

// handshake opens c as p's stream number idx. It waits for the peer for
// the keepalive timeout at most, and not once ctx is done.
func (p *peer) handshake(ctx context.Context, c net.Conn, idx uint8) (*stream, handshake, error) {
	b := p.b
	var hs [hsSize]byte
	out := handshake{stream: idx, self: b.id, expect: p.id, session: p.session, timeout: b.cfg.timeout, maxPieces: b.cfg.maxPieces, maxFrame: b.cfg.maxFrame}
	out.put(hs[:])
	_ = c.SetDeadline(time.Now().Add(b.cfg.timeout))
	// A deadline in the past interrupts the handshake when ctx is done; it
	// may come after the handshake ended, but the backend is closing then,
	// and the connection with it.
	defer context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })()
	if _, err := c.Write(hs[:]); err != nil {
		return nil, handshake{}, p.lost("handshake with", err)
	}
	w := newWconn(c)
	w.tx.Store(hsSize)
	pc := &patientConn{c: c, rx: &w.rx, timeout: b.cfg.timeout, spin: b.cfg.spin}
	br := bufio.NewReaderSize(pc, readBuf)
	if _, err := io.ReadFull(br, hs[:]); err != nil {
		return nil, handshake{}, p.lost("handshake with", err)
	}
	in, err := getHandshake(hs[:])
	if err != nil {
		return nil, in, p.lost("handshake with", err)
	}
	if in.status == stLimit {
		return nil, in, fmt.Errorf("tcp: peer %s at %q refused a connection: this agent holds as many as it allows (tcp.WithMaxConnsPerPeer): %w", p.id, p.addr, agent.ErrRemoteLost)
	}
	if in.status != stOK || in.self != p.id {
		return nil, in, fmt.Errorf("tcp: %q is now agent %s, not peer %s: %w", p.addr, in.self, p.id, agent.ErrRemoteLost)
	}
	_ = c.SetDeadline(time.Time{})
	inflight := b.cfg.inflight
	w.every.Store(int64(pingEvery(b.cfg.interval, in.timeout)))
	return &stream{
		p: p, w: w, pc: pc, br: br,
		slots:   make(chan struct{}, inflight),
		pending: make(chan frame, inflight),
		head:    make([]byte, hdrSize+b.cfg.maxPieces*pieceSize),
	}, in, nil
}

// lost returns the error of a dial or handshake (what) with p that failed
// with err: the peer is lost.
func (p *peer) lost(what string, err error) error {
	return fmt.Errorf("tcp: %s peer %s at %q: %w: %w", what, p.id, p.addr, agent.ErrRemoteLost, err)
}

// fail marks the peer failed once: transfers waiting for it give up, its
// connections close (their readers fail the frames in flight), and a later
// transfer dials afresh.
// An outgoing channel presents no key to this agent, so its failure is no
// loss for this agent's exposures: only the channels a peer used to reach
// them report that (agent.Link).
func (p *peer) fail(err error) { p.end(err, false) }

// errIdle ends a peer closed for having nothing in flight for the idle
// timeout.
var errIdle = errors.New("tcp: idle connections closed")

// retire closes p's connections, idle by the caller's judgement, with an
// idle goodbye: the peer learns that this agent is not leaving, so the
// exposures we used hear of no loss. A later transfer dials afresh.
func (p *peer) retire() { p.end(errIdle, true) }

func (p *peer) end(err error, idle bool) {
	p.failOnce.Do(func() {
		p.mu.Lock()
		p.err = err
		streams, ctrl := p.streams, p.ctrl
		p.mu.Unlock()
		close(p.dead)
		b := p.b
		b.mu.Lock()
		if k := (peerKey{p.id, p.addr}); b.peers[k] == p {
			delete(b.peers, k)
		}
		b.unreserve(p)
		b.mu.Unlock()
		var bye [hdrSize]byte
		(&header{typ: tBye, status: stIdle}).put(bye[:])
		// An idle connection's writer is done or about to be (finishing a
		// ping, or a cancelled WRITE's zeros): its goodbye waits for it a
		// little, never for a peer that does not read.
		by := time.Now().Add(100 * time.Millisecond)
		for _, s := range append(streams[:len(streams):len(streams)], ctrl) {
			if s == nil {
				continue
			}
			if idle && s.w.wl.lockBy(by) {
				_ = s.w.c.SetWriteDeadline(by)
				_, _ = s.w.c.Write(bye[:])
				s.w.wl.unlock()
			}
			_ = s.w.c.Close()
		}
	})
}

// notifyDone sends a transfer's notification (agent.Parts) within the
// backend's lifetime: waiting for the control connection's writer, and the
// write, end when the backend closes, or with the keepalive timeout.
func (p *peer) notifyDone(key agent.Key, msg []byte) error { return p.notify(p.b.ctx, key, msg) }

// errNotifyCut is why a peer's connections were closed, and why the
// transfers in flight on them failed, when a notification's write was cut
// short by its context: the control connection's framing was broken.
var errNotifyCut = errors.New("tcp: a notification was cut short when its context ended, leaving half a frame on the control connection")

// notify sends a notification on the control connection, which carries no
// data, so it never waits behind a transfer. Waiting for the connection to
// be dialled or for its writer, and the write itself, end when ctx is done
// (and the waits when the backend is), with an error wrapping
// context.Cause(ctx). A write cut short leaves half a frame on the
// connection: the peer is failed then (errNotifyCut), its connections
// closed and its transfers in flight failed, and the next transfer or
// notification dials afresh. A write cut before its first byte leaves the
// connection as it was.
func (p *peer) notify(ctx context.Context, key agent.Key, msg []byte) error {
	if len(msg) > maxNotify {
		return fmt.Errorf("%w: notification of %d bytes, at most %d", agent.ErrInvalid, len(msg), maxNotify)
	}
	select {
	case <-p.ready:
	case <-p.dead:
	case <-ctx.Done():
		return fmt.Errorf("tcp: notify peer %s: %w", p.id, context.Cause(ctx))
	}
	if err := p.failure(); err != nil {
		return err
	}
	s := p.ctrl
	w := s.w
	if !w.wl.lockOr(ctx.Done(), p.dead, p.b.ctx.Done()) {
		if err := p.failure(); err != nil {
			return err
		}
		if ctx.Err() != nil {
			return fmt.Errorf("tcp: notify peer %s: %w", p.id, context.Cause(ctx))
		}
		return agent.ErrClosed
	}
	defer w.wl.unlock()
	if s.dead {
		return p.failure()
	}
	if ctx.Err() != nil { // the lock may be taken with ctx done: write nothing then
		return fmt.Errorf("tcp: notify peer %s: %w", p.id, context.Cause(ctx))
	}
	h := header{typ: tNotify, length: uint64(len(msg)), key: key}
	h.put(s.head)
	s.bufs = append(s.bufs[:0], s.head[:hdrSize], msg)
	s.out = s.bufs
	// ctx ends the write as it ends the waits: a fence raised when it is
	// done sets a deadline in the past, and keeps writeFrame from setting
	// a later one. A raise under way is waited for before the lock is let
	// go, so that it never lands on the next writer's deadline.
	var f fence
	raised := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(raised)
		f.raise(w.c.SetWriteDeadline)
	})
	err := writeFrame(w, &s.out, p.b.cfg.timeout, &f, nil, time.Time{})
	if !stop() {
		<-raised
	}
	w.lastWrite.Store(time.Now().UnixNano())
	var left int
	for _, b := range s.out {
		left += len(b)
	}
	clear(s.bufs) // msg stays the caller's
	s.out = nil
	switch {
	case err == nil:
		return nil
	case errors.Is(err, errFenced) && left == hdrSize+len(msg):
		return fmt.Errorf("tcp: notify peer %s: the socket took none of it: %w", p.id, context.Cause(ctx))
	case errors.Is(err, errFenced):
		why := fmt.Errorf("tcp: connections to peer %s closed: %w (%d of its %d bytes sent)", p.id, errNotifyCut, hdrSize+len(msg)-left, hdrSize+len(msg))
		if p.b.stopping() {
			why = agent.ErrClosed
		}
		p.fail(why) // before the lock is let go: no one writes after the half frame
		return fmt.Errorf("tcp: notify peer %s: cut short, %d of %d bytes sent, and the peer's connections closed: %w",
			p.id, hdrSize+len(msg)-left, hdrSize+len(msg), context.Cause(ctx))
	default:
		_ = w.c.Close()
		return fmt.Errorf("tcp: notify peer %s: %w: %w", p.id, agent.ErrRemoteLost, err)
	}
}

// Notify implements [agent.Backend]: it sends msg, at most 64 KiB, on the
// peer's control connection, dialling the peer if it is not connected. It
// returns once the socket took msg, which it does not keep. Waiting for the
// dial or for the connection's writer, and the write itself, end when ctx
// is done, with an error wrapping context.Cause(ctx); a write that ctx cut
// short closes the peer's connections (the half-written frame cannot be
// taken back), failing its transfers in flight, and the next use dials
// afresh.
func (b *Backend) Notify(ctx context.Context, info agent.Info, key agent.Key, msg []byte) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("tcp: notify peer %s: %w", info.ID, context.Cause(ctx))
	}
	p, err := b.peerFor(info)
	if err != nil {
		return err
	}
	defer b.wg.Done()
	defer p.release()
	return p.notify(ctx, key, msg)
}

// send writes a frame holding a slot of s. Its answer, or the stream's
// failure, releases the slot and the frame's reference. Waiting for the
// write lock, which another transfer's frame may hold at the pace of a
// slow peer, ends when the transfer is cancelled or the peer fails: the
// frame is then never sent.
func (s *stream) send(f frame, pieces int) {
	st := f.st
	if !s.w.wl.lockOr(st.x.Cancelled(), s.p.dead, nil) {
		<-s.slots
		if err := s.p.failure(); err != nil {
			st.Done(err)
			return
		}
		st.Done(st.x.CancelErr())
		return
	}
	s.sendLocked(f, pieces, false)
}

// sendLocked is send with the write lock already held; it unlocks it, or
// leaves that to a goroutine it starts. If inline, the caller does not wait
// for the peer: what the socket does not take at once is written by a
// goroutine.
func (s *stream) sendLocked(f frame, pieces int, inline bool) {
	w, st := s.w, f.st
	if s.dead {
		err := s.err
		w.wl.unlock()
		<-s.slots
		st.Done(err)
		return
	}
	write := f.typ == tWrite
	st.mu.Lock()
	if st.abandoned { // cancelled meanwhile: the frame need not go
		st.mu.Unlock()
		w.wl.unlock()
		<-s.slots
		st.Done(nil)
		return
	}
	st.queued++
	if write {
		st.Add() // the writer's hold on the transfer's memory
		s.tmu.Lock()
		s.sending = st
		s.tmu.Unlock()
	}
	st.mu.Unlock()
	s.seq++
	f.id = s.seq
	f.size = uint64(hdrSize + pieces*pieceSize)
	if write {
		f.size += f.n
	}
	if f.note != nil {
		f.size += uint64(len(f.note)) + 1
	}
	s.pending <- f // never blocks: the slot guarantees room

	table := s.head[hdrSize : hdrSize+pieces*pieceSize]
	s.bufs = append(s.bufs[:0], s.head[:hdrSize+len(table)])
	i := 0
	for pc := range st.x.Pieces(f.start, f.n) {
		binary.LittleEndian.PutUint64(table[i:], pc.RemoteAddr())
		binary.LittleEndian.PutUint64(table[i+8:], pc.Len)
		if write {
			s.bufs = append(s.bufs, pc.Local())
		}
		i += pieceSize
	}
	h := header{typ: f.typ, count: uint32(pieces), id: f.id, key: st.x.Key}
	if write {
		h.length = f.n
	}
	if f.note != nil {
		// The whole byte comes last: a frame cut short is padded with
		// zeros from where it stopped, and a zero says so.
		h.status = stTrailer
		h.length += uint64(len(f.note)) + 1
		s.bufs = append(s.bufs, f.note, whole[:])
	}
	h.put(s.head)
	s.out = s.bufs
	s.writing.Store(true)
	b := s.p.b
	if inline {
		if err := writeSoon(w, &s.out, &s.wfence); !errors.Is(err, errLater) {
			s.wrote(st, write, err)
			return
		}
		b.wg.Add(1) // Post's transfer holds a count: b.wg is not waited on yet
		go func() {
			defer b.wg.Done()
			s.wrote(st, write, writeFrame(w, &s.out, b.cfg.timeout, &s.wfence, nil, time.Time{}))
		}()
		return
	}
	s.wrote(st, write, writeFrame(w, &s.out, b.cfg.timeout, &s.wfence, nil, time.Time{}))
}

// wrote ends the write of a frame of st, which ended with err, and
// unlocks the write lock, or leaves that to the goroutine that finishes
// the frame with zeros.
func (s *stream) wrote(st *xstate, write bool, err error) {
	w := s.w
	if write {
		s.tmu.Lock()
		s.sending = nil
		s.tmu.Unlock()
		s.wfence.lower()
		fenced := errors.Is(err, errFenced)
		if fenced {
			// The transfer was cancelled and its memory is no longer ours
			// to read: let it finish at once. The peer expects the
			// frame's length all the same.
			s.out = padding(s.out, len(s.out) == len(s.bufs))
		}
		clear(s.bufs)
		st.Done(nil)
		if fenced {
			// The goroutine posting the frames holds the transfer too: it
			// must not wait for the padding either. The padder takes
			// over the write lock; a transfer waiting for it gives up
			// when cancelled.
			b := s.p.b
			b.wg.Add(1)
			go func() {
				defer b.wg.Done()
				s.finishLocked(writeFrame(w, &s.out, b.cfg.timeout, nil, nil, time.Time{}))
			}()
			return
		}
	}
	s.finishLocked(err)
}

// finishLocked ends the write of a frame, which ended with err, and
// unlocks the write lock.
func (s *stream) finishLocked(err error) {
	w := s.w
	s.writing.Store(false)
	w.lastWrite.Store(time.Now().UnixNano())
	clear(s.bufs)
	w.wl.unlock()
	if err != nil {
		w.cut(err) // the reader fails every pending frame, this one included
	}
}

// whole ends the trailer of a WRITE frame sent whole.
var whole = [1]byte{1}

// zeros stands in for the payload of a cancelled WRITE.
var zeros [64 << 10]byte

// padding returns what is left to write of an interrupted WRITE frame,
// rest, with zeros in place of its payload; head says whether rest begins
// with what is left of the header and table.
func padding(rest net.Buffers, head bool) net.Buffers {
	var out net.Buffers
	if head && len(rest) > 0 {
		out, rest = append(out, rest[0]), rest[1:]
	}
	for _, b := range rest {
		for n := len(b); n > 0; n -= min(n, len(zeros)) {
			out = append(out, zeros[:min(n, len(zeros))])
		}
	}
	return out
}

// settle ends a frame that will get no answer, unless its transfer was
// abandoned, which released it already.
func (st *xstate) settle(err error) {
	st.mu.Lock()
	if st.abandoned {
		st.mu.Unlock()
		return
	}
	st.queued--
	st.mu.Unlock()
	st.Done(err)
}

// read is the stream's reader goroutine: it matches answers to frames and
// lands READ data in local memory. When the connection ends it fails every
// frame still pending and the peer.
func (s *stream) read() {
	b := s.p.b
	defer b.wg.Done()
	defer b.untrack(s.w)
	err := s.w.reason(s.loop())
	switch perr := s.p.failure(); {
	case b.stopping():
		err = agent.ErrClosed
	case perr != nil:
		err = perr // another stream failed first and closed this one: report the cause
	default:
		if b.dropped(err, false, "peer", s.p.id, "addr", s.p.addr) && errors.Is(err, errProtocol) {
			b.host.Refused()
		}
		err = fmt.Errorf("tcp: connection to peer %s: %w: %w", s.p.id, agent.ErrRemoteLost, err)
	}
	// Closed first: a writer blocked on a peer that does not read lets go.
	_ = s.w.c.Close()
	// From here on, frames that find the stream dead fail with err; those
	// already pending are failed below.
	s.w.wl.lock() // its holder lets go at once: the connection is closed
	s.dead, s.err = true, err
	s.w.wl.unlock()
	for {
		select {
		case f := <-s.pending:
			<-s.slots
			f.st.settle(err)
			continue
		default:
		}
		break
	}
	s.p.fail(err)
}

func (s *stream) loop() error {
	var h header
	timeout := s.p.b.cfg.timeout
	var since time.Time // since when keepalives came while requests waited
	var claimed uint64  // request bytes the peer's claims proved received, then
	// floor is what the peer had received when its oldest pending request
	// began (the handshake and every answered request), in the same
	// units: no claim of progress below it counts towards the requests
	// still waiting.
	floor := uint64(hsSize)
	for {
		s.pc.arm()
		if _, err := io.ReadFull(s.br, s.rhdr[:]); err != nil {
			return err
		}
		h.get(s.rhdr[:])
		switch h.typ {
		case tPing:
			// Keepalives prove the peer alive, not that it serves: a peer
			// that keeps pinging but leaves requests unanswered is lost.
			// On a slow link a request takes a while to arrive, though:
			// the clock does not run while we are still writing one, and
			// starts afresh each time the peer's pings say it has received
			// another minProgress bytes of our requests. A ping's claim
			// beyond what we sent, or of less progress, counts for nothing;
			// nor do our own keepalives, whose pace the peer sets with the
			// timeout it announces: a claim proves received at most what
			// it counts beyond every ping we sent.
			now := time.Now()
			var credit uint64
			if tx := s.w.tx.Load(); h.id <= tx {
				credit = h.id - min(h.id, s.w.ptx.Load()) // tx first: a ping written between undercounts
			}
			switch {
			case len(s.pending) == 0 || s.writing.Load():
				since = time.Time{}
			case since.IsZero():
				since, claimed = now, max(credit, floor)
			case h.status == stBusy && credit >= claimed+minProgress:
				since, claimed = now, credit
			case now.Sub(since) > timeout:
				return fmt.Errorf("%w: peer sends keepalives but left a request unanswered for more than %v", errStalled, timeout)
			}
			continue
		case tBye:
			return errBye
		case tReadResp, tWriteAck:
		default:
			return fmt.Errorf("%w: unexpected frame type %d", errProtocol, h.typ)
		}
		var f frame
		select {
		case f = <-s.pending:
		default:
			return fmt.Errorf("%w: answer %d to no request", errProtocol, h.id)
		}
		since = time.Time{}
		floor += f.size
		st := f.st
		st.mu.Lock()
		gone := st.abandoned
		if !gone {
			st.queued--
			s.tmu.Lock()
			s.landing = st
			s.tmu.Unlock()
		}
		st.mu.Unlock()
		released, err := s.land(&h, &f, gone)
		if gone {
			released = true // by abandon
		} else {
			s.unland()
		}
		<-s.slots
		if err != nil && !errors.Is(err, agent.ErrAccessDenied) {
			cause := fmt.Errorf("tcp: connection to peer %s: %w: %w", s.p.id, agent.ErrRemoteLost, err)
			if perr := s.p.failure(); perr != nil {
				cause = perr // the peer was failed, closing this connection under the frame: report why
			}
			if !released {
				st.Done(cause)
			}
			return err
		}
		s.pc.busy()
		if !released {
			st.Done(err)
		}
	}
}

// unland records that the reader no longer touches the transfer it was
// landing, and lowers the fence a cancellation of it may have raised.
func (s *stream) unland() {
	s.tmu.Lock()
	s.landing = nil
	s.tmu.Unlock()
	s.pc.fence.lower()
}

// land consumes one answer for f: READ data goes straight into the
// transfer's local memory, or nowhere if sink. If the transfer is
// cancelled while its data lands, the rest is read and dropped; land then
// reports that it released the frame, which it did as soon as it let go
// of the memory.
func (s *stream) land(h *header, f *frame, sink bool) (released bool, err error) {
	wantTyp := uint8(tReadResp)
	if f.typ == tWrite {
		wantTyp = tWriteAck
	}
	if h.id != f.id || h.typ != wantTyp {
		return false, fmt.Errorf("%w: answer type %d id %d, want type %d id %d", errProtocol, h.typ, h.id, wantTyp, f.id)
	}
	if h.status != stOK {
		if h.length > maxErrMsg {
			return false, fmt.Errorf("%w: error message of %d bytes", errProtocol, h.length)
		}
		// The text lands in a buffer of ours, not the transfer's memory:
		// a cancellation fencing the reader meanwhile is no reason to
		// stop, and the stream must go on past the whole text.
		msg := make([]byte, h.length)
		for got := 0; got < len(msg); {
			n, err := io.ReadFull(s.br, msg[got:])
			got += n
			if errors.Is(err, errFenced) {
				s.unland()
				s.pc.arm()
				continue
			}
			if err != nil {
				return false, err
			}
		}
		return false, fmt.Errorf("tcp: peer %s refused %s: %w (%q)", s.p.id, f.st.x.Op, agent.ErrAccessDenied, msg)
	}
	if f.typ == tWrite {
		if h.length != 0 {
			return false, fmt.Errorf("%w: WRITE ack with %d payload bytes", errProtocol, h.length)
		}
		return false, nil
	}
	if h.length != f.n {
		return false, fmt.Errorf("%w: READ answer of %d bytes, want %d", errProtocol, h.length, f.n)
	}
	left := f.n
	if !sink {
		for pc := range f.st.x.Pieces(f.start, f.n) {
			n, err := io.ReadFull(s.br, pc.Local())
			left -= uint64(n)
			if errors.Is(err, errFenced) {
				s.unland()
				f.st.Done(nil) // its outcome is the cancellation, recorded already
				released, sink = true, true
				break
			}
			if err != nil {
				return false, err
			}
		}
	}
	if sink && left > 0 {
		s.pc.arm()
		if _, err := io.CopyN(io.Discard, s.br, int64(left)); err != nil {
			return released, err
		}
	}
	return released, nil
}

// PeerDeparted implements [agent.Departer]: the connections to agent id are
// closed and its transfers' pending frames fail with cause at once, rather than
// when the keepalive timeout notices a silent connection. The next transfer
// to it dials afresh. Connections it opened to this agent are left to
// their own keepalives: they serve its requests if it is in fact alive.
func (b *Backend) PeerDeparted(id uuid.UUID, cause error) {
	b.mu.Lock()
	var gone []*peer
	for k, p := range b.peers {
		if k.id == id {
			gone = append(gone, p)
		}
	}
	b.mu.Unlock()
	for _, p := range gone {
		p.fail(fmt.Errorf("tcp: peer %s departed: %w", id, cause))
	}
}
