package tcp

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
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

	ready   chan struct{} // closed when dialling ended
	dead    chan struct{} // closed when the peer failed
	streams []*stream     // data streams; set (under mu) before ready is closed
	ctrl    *stream       // notifications only; likewise
	rr      atomic.Uint32
	chunk   uint64 // most bytes in a frame: ours, or less if the peer takes less; set before ready is closed
	pieces  int    // most pieces in a frame, likewise

	mu       sync.Mutex
	err      error
	failOnce sync.Once
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

	// under w.wmu
	dead bool
	err  error // why the stream died, set with dead
	seq  uint64
	head []byte // header and piece table of the frame being written
	bufs [][]byte
	out  net.Buffers

	rhdr    [hdrSize]byte // reader only
	writing atomic.Bool   // a frame is being written
}

// frame is one request awaiting its answer.
type frame struct {
	st    *xstate
	id    uint64
	start cursor
	n     uint64
	typ   uint8
}

// xstate tracks one transfer: a part per frame in flight plus one for the
// goroutine posting them. The last part finishes the transfer.
type xstate struct {
	agent.Parts
	b *Backend
	x *agent.Xfer
	p *peer
}

// Post implements agent.Backend.
func (b *Backend) Post(x *agent.Xfer) error {
	p, err := b.peerFor(x.Peer)
	if err != nil {
		return err
	}
	st := &xstate{b: b, x: x, p: p}
	st.Init(x, p.notify, b.wg.Done)
	typ := uint8(tRead)
	if x.Op == agent.OpWrite {
		typ = tWrite
	}
	if p.usable() && x.Bytes() <= inlineMax {
		end, n, pieces := agent.Span(x.Segments, cursor{}, p.chunk, p.pieces)
		if end.Seg == len(x.Segments) {
			if s := p.tryStream(); s != nil {
				// Inline only if the stream is free this instant: a small
				// transfer never waits behind another one's frame here.
				if s.w.wmu.TryLock() {
					st.Add()
					s.sendLocked(frame{st: st, n: n, typ: typ}, pieces)
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
		st.Add()
		s.send(frame{st: st, start: c, n: n, typ: typ}, pieces)
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
	b.wg.Add(1) // the transfer's, released by xstate.finish or by the caller on error
	// Connections are keyed by identity and address together: a token that
	// claims a known agent's identity at another address gets connections
	// of its own and never redirects anyone else's transfers.
	k := peerKey{info.ID, ci.addr}
	if p := b.peers[k]; p != nil {
		return p, nil
	}
	p := &peer{b: b, id: info.ID, addr: ci.addr, ready: make(chan struct{}), dead: make(chan struct{})}
	b.peers[k] = p
	b.wg.Add(1)
	go p.dial()
	return p, nil
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
func (p *peer) acquire(x *agent.Xfer) (*stream, error) {
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

func (p *peer) dial() {
	b := p.b
	defer b.wg.Done()
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { // the dial's own watcher, joined below
		defer close(stopped)
		select {
		case <-b.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	err := p.connect(ctx)
	cancel()
	<-stopped
	if err != nil {
		p.fail(err)
	}
	close(p.ready)
}

func (p *peer) connect(ctx context.Context) error {
	b := p.b
	d := net.Dialer{Timeout: b.cfg.timeout}
	n := b.cfg.streams
	all := make([]*stream, 0, n+1)
	chunk, pieces := b.cfg.chunk, b.cfg.maxPieces
	for i := 0; i <= n; i++ {
		c, err := d.DialContext(ctx, "tcp", p.addr)
		if err != nil {
			closeStreams(all)
			return fmt.Errorf("tcp: dial peer %s at %s: %w: %w", p.id, p.addr, agent.ErrRemoteLost, err)
		}
		s, in, err := p.handshake(c.(*net.TCPConn), uint8(i))
		if err != nil {
			_ = c.Close()
			closeStreams(all)
			return err
		}
		chunk, pieces = peerLimits(chunk, pieces, in)
		all = append(all, s)
	}
	p.chunk, p.pieces = uint64(chunk), pieces
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
	p.mu.Lock() // fail, from Close, may look at them concurrently
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

func (p *peer) handshake(c *net.TCPConn, idx uint8) (*stream, handshake, error) {
	b := p.b
	var hs [hsSize]byte
	out := handshake{stream: idx, self: b.id, expect: p.id, timeout: b.cfg.timeout, maxPieces: b.cfg.maxPieces, maxFrame: b.cfg.maxFrame}
	out.put(hs[:])
	_ = c.SetDeadline(time.Now().Add(b.cfg.timeout))
	if _, err := c.Write(hs[:]); err != nil {
		return nil, handshake{}, fmt.Errorf("tcp: handshake with peer %s at %s: %w: %w", p.id, p.addr, agent.ErrRemoteLost, err)
	}
	w := newWconn(c)
	pc := &patientConn{c: c, rx: &w.rx, timeout: b.cfg.timeout}
	br := bufio.NewReaderSize(pc, readBuf)
	if _, err := io.ReadFull(br, hs[:]); err != nil {
		return nil, handshake{}, fmt.Errorf("tcp: handshake with peer %s at %s: %w: %w", p.id, p.addr, agent.ErrRemoteLost, err)
	}
	in, err := getHandshake(hs[:])
	if err != nil {
		return nil, in, fmt.Errorf("tcp: handshake with peer %s at %s: %w: %w", p.id, p.addr, agent.ErrRemoteLost, err)
	}
	if in.status == stLimit {
		return nil, in, fmt.Errorf("tcp: peer %s at %s refused a connection: this agent holds as many as it allows (tcp.WithMaxConnsPerPeer): %w", p.id, p.addr, agent.ErrRemoteLost)
	}
	if in.status != stOK || in.self != p.id {
		return nil, in, fmt.Errorf("tcp: %s is now agent %s, not peer %s: %w", p.addr, in.self, p.id, agent.ErrRemoteLost)
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

// fail marks the peer failed once: transfers waiting for it give up, its
// connections close (their readers fail the frames in flight), and a later
// transfer dials afresh.
// An outgoing channel presents no key to this agent, so its failure is no
// loss for this agent's exposures: only the channels a peer used to reach
// them report that (agent.Link).
func (p *peer) fail(err error) {
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
		b.mu.Unlock()
		for _, s := range streams {
			_ = s.w.c.Close()
		}
		if ctrl != nil {
			_ = ctrl.w.c.Close()
		}
	})
}

// notify sends a notification on the control connection, which carries no
// data, so it never waits behind a transfer.
func (p *peer) notify(key agent.Key, msg []byte) error {
	if len(msg) > maxNotify {
		return fmt.Errorf("%w: notification of %d bytes, at most %d", agent.ErrInvalid, len(msg), maxNotify)
	}
	select {
	case <-p.ready:
	case <-p.dead:
	}
	if err := p.failure(); err != nil {
		return err
	}
	s := p.ctrl
	w := s.w
	w.wmu.Lock()
	defer w.wmu.Unlock()
	if s.dead {
		return p.failure()
	}
	h := header{typ: tNotify, length: uint64(len(msg)), key: key}
	h.put(s.head)
	s.bufs = append(s.bufs[:0], s.head[:hdrSize], msg)
	s.out = s.bufs
	err := writeFrame(w.c, &s.out, p.b.cfg.timeout)
	w.lastWrite.Store(time.Now().UnixNano())
	if err != nil {
		_ = w.c.Close()
		return fmt.Errorf("tcp: notify peer %s: %w: %w", p.id, agent.ErrRemoteLost, err)
	}
	return nil
}

// Notify implements agent.Backend.
func (b *Backend) Notify(info agent.Info, key agent.Key, msg []byte) error {
	p, err := b.peerFor(info)
	if err != nil {
		return err
	}
	defer b.wg.Done()
	return p.notify(key, msg)
}

// send writes a frame holding a slot of s. Its answer, or the stream's
// failure, releases the slot and the frame's reference.
func (s *stream) send(f frame, pieces int) {
	s.w.wmu.Lock()
	s.sendLocked(f, pieces)
}

// sendLocked is send with the write lock already held; it unlocks it.
func (s *stream) sendLocked(f frame, pieces int) {
	w := s.w
	if s.dead {
		err := s.err
		w.wmu.Unlock()
		<-s.slots
		f.st.Done(err)
		return
	}
	s.seq++
	f.id = s.seq
	s.pending <- f // never blocks: the slot guarantees room

	segs := f.st.x.Segments
	table := s.head[hdrSize : hdrSize+pieces*pieceSize]
	s.bufs = append(s.bufs[:0], s.head[:hdrSize+len(table)])
	c, left, i := f.start, f.n, 0
	for left > 0 {
		sg := &segs[c.Seg]
		take := min(sg.Local.Len-c.Off, left)
		binary.LittleEndian.PutUint64(table[i:], sg.Remote.Addr+c.Off)
		binary.LittleEndian.PutUint64(table[i+8:], take)
		if f.typ == tWrite {
			s.bufs = append(s.bufs, sg.Local.Mem[c.Off:c.Off+take])
		}
		i += pieceSize
		left -= take
		if c.Off += take; c.Off == sg.Local.Len {
			c.Seg, c.Off = c.Seg+1, 0
		}
	}
	h := header{typ: f.typ, count: uint32(pieces), id: f.id, key: f.st.x.Key}
	if f.typ == tWrite {
		h.length = f.n
	}
	h.put(s.head)
	s.out = s.bufs
	s.writing.Store(true)
	err := writeFrame(w.c, &s.out, s.p.b.cfg.timeout)
	s.writing.Store(false)
	w.lastWrite.Store(time.Now().UnixNano())
	clear(s.bufs)
	w.wmu.Unlock()
	if err != nil {
		_ = w.c.Close() // the reader fails every pending frame, this one included
	}
}

// read is the stream's reader goroutine: it matches answers to frames and
// lands READ data in local memory. When the connection ends it fails every
// frame still pending and the peer.
func (s *stream) read() {
	b := s.p.b
	defer b.wg.Done()
	defer b.untrack(s.w)
	err := s.loop()
	select {
	case <-b.stop:
		err = agent.ErrClosed
	default:
		if perr := s.p.failure(); perr != nil {
			err = perr // another stream failed first and closed this one: report the cause
			break
		}
		if b.dropped(err, false) && errors.Is(err, errProtocol) {
			b.host.Refused()
		}
		err = fmt.Errorf("tcp: connection to peer %s: %w: %w", s.p.id, agent.ErrRemoteLost, err)
	}
	// From here on, frames that find the stream dead fail with err; those
	// already pending are failed below.
	s.w.wmu.Lock()
	s.dead, s.err = true, err
	s.w.wmu.Unlock()
	_ = s.w.c.Close()
	for {
		select {
		case f := <-s.pending:
			<-s.slots
			f.st.Done(err)
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
	var unanswered time.Time // since when keepalives came while requests waited
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
			// the clock does not run while we are still writing one, nor
			// while the peer's pings say it is still reading one.
			if len(s.pending) == 0 || s.writing.Load() || h.status == stBusy {
				unanswered = time.Time{}
			} else if now := time.Now(); unanswered.IsZero() {
				unanswered = now
			} else if now.Sub(unanswered) > timeout {
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
		unanswered = time.Time{}
		err := s.land(&h, &f)
		<-s.slots
		if err != nil && !errors.Is(err, agent.ErrAccessDenied) {
			cause := fmt.Errorf("tcp: connection to peer %s: %w: %w", s.p.id, agent.ErrRemoteLost, err)
			if perr := s.p.failure(); perr != nil {
				cause = perr // the peer was failed, closing this connection under the frame: report why
			}
			f.st.Done(cause)
			return err
		}
		f.st.Done(err)
	}
}

// land consumes one answer for f: READ data goes straight into the
// transfer's local memory.
func (s *stream) land(h *header, f *frame) error {
	wantTyp := uint8(tReadResp)
	if f.typ == tWrite {
		wantTyp = tWriteAck
	}
	if h.id != f.id || h.typ != wantTyp {
		return fmt.Errorf("%w: answer type %d id %d, want type %d id %d", errProtocol, h.typ, h.id, wantTyp, f.id)
	}
	if h.status != stOK {
		if h.length > maxErrMsg {
			return fmt.Errorf("%w: error message of %d bytes", errProtocol, h.length)
		}
		msg := make([]byte, h.length)
		if _, err := io.ReadFull(s.br, msg); err != nil {
			return err
		}
		return fmt.Errorf("tcp: peer %s refused %s: %w (%s)", s.p.id, f.st.x.Op, agent.ErrAccessDenied, msg)
	}
	if f.typ == tWrite {
		if h.length != 0 {
			return fmt.Errorf("%w: WRITE ack with %d payload bytes", errProtocol, h.length)
		}
		return nil
	}
	if h.length != f.n {
		return fmt.Errorf("%w: READ answer of %d bytes, want %d", errProtocol, h.length, f.n)
	}
	segs := f.st.x.Segments
	c, left := f.start, f.n
	for left > 0 {
		sg := &segs[c.Seg]
		take := min(sg.Local.Len-c.Off, left)
		if _, err := io.ReadFull(s.br, sg.Local.Mem[c.Off:c.Off+take]); err != nil {
			return err
		}
		left -= take
		if c.Off += take; c.Off == sg.Local.Len {
			c.Seg, c.Off = c.Seg+1, 0
		}
	}
	return nil
}

// PeerDeparted implements agent.Departer: the connections to agent id are
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
