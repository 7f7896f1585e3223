package tcp

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
)

// readBuf is the read buffer per connection: it batches small headers and
// tables into few system calls; payloads larger than it bypass it.
const readBuf = 16 << 10

func (b *Backend) accept() {
	defer b.wg.Done()
	for {
		c, err := b.ln.Accept()
		if err != nil {
			select {
			case <-b.stop:
				return
			default:
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			time.Sleep(10 * time.Millisecond) // e.g. EMFILE: do not spin
			continue
		}
		w := newWconn(c.(*net.TCPConn))
		w.ip = remoteIP(w.c)
		switch b.admit(w) {
		case admitClosed:
			_ = c.Close()
			return
		case admitRefused:
			_ = c.Close()
			b.host.Refused()
			continue
		}
		b.wg.Add(1)
		go b.serve(w)
	}
}

func remoteIP(c *net.TCPConn) netip.Addr {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.IPv6Unspecified()
}

const (
	admitted = iota
	admitRefused
	admitClosed
)

// admit tracks an accepted connection, or refuses it if its address already
// holds WithMaxConnsPerIP. When more than WithMaxHandshakes connections are
// in the handshake, it closes the oldest: a legitimate handshake takes one
// round trip, so the oldest is the likeliest to be a slow-loris.
func (b *Backend) admit(w *wconn) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return admitClosed
	}
	if b.byIP[w.ip] >= b.cfg.maxConnsPerIP {
		b.limited()
		return admitRefused
	}
	b.byIP[w.ip]++
	b.conns[w] = struct{}{}
	b.arrived++
	b.shaking[w] = b.arrived
	if len(b.shaking) > b.cfg.maxHandshakes {
		var oldest *wconn
		for v, n := range b.shaking {
			if oldest == nil || n < b.shaking[oldest] {
				oldest = v
			}
		}
		delete(b.shaking, oldest)
		oldest.evicted = true
		_ = oldest.c.Close() // its goroutine returns, uncounted: counted here
		b.limited()
		b.host.Refused()
	}
	return admitted
}

// handshook reports that w's handshake arrived, or ended, and whether w may
// go on: false if it was closed to make room for another.
func (b *Backend) handshook(w *wconn) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.shaking, w)
	return !w.evicted
}

// peerAddr names a claimed identity at one remote address: identities are
// claims, so a connection limit counted by identity alone would let a
// stranger lock a peer out by claiming its identity.
type peerAddr struct {
	id uuid.UUID
	ip netip.Addr
}

// server is the exposing side of one connection: it answers requests in
// order, one at a time.
type server struct {
	b     *Backend
	w     *wconn
	pc    *patientConn // under br
	br    *bufio.Reader
	peer  uuid.UUID
	link  agent.Link
	hdr   [hdrSize]byte
	table []byte
	iov   [][]byte
	bufs  [][]byte
	out   net.Buffers
}

func (b *Backend) serve(w *wconn) {
	defer b.wg.Done()
	defer b.untrack(w)
	defer w.c.Close()
	pc := &patientConn{c: w.c, rx: &w.rx, timeout: b.cfg.timeout}
	s := &server{b: b, w: w, pc: pc, br: bufio.NewReaderSize(pc, readBuf)}
	if err := s.handshake(); err != nil {
		if !b.stopping() && !errors.Is(err, errEvicted) && b.dropped(err, true) {
			b.host.Refused()
		}
		return
	}
	err := s.loop()
	if b.stopping() {
		return // our own shutdown closed it
	}
	if b.dropped(err, false) && errors.Is(err, errProtocol) {
		b.host.Refused()
	}
	// A goodbye is an orderly close, but the peer is gone all the same:
	// exposures it was using must not wait for it. Only the peer's last
	// connection reports it: every notification its control connection
	// carried has then been dispatched, so the loss never overtakes a
	// completion, and a stranger who claims a live peer's identity and
	// hangs up reports nothing.
	if link, last := b.left(s.peer); last {
		b.host.LinkLost(link, fmt.Errorf("tcp: connection from peer %s: %w: %w", s.peer, agent.ErrRemoteLost, err))
	}
}

func (b *Backend) stopping() bool {
	select {
	case <-b.stop:
		return true
	default:
		return false
	}
}

// inbound is the live connections from one peer, which share one link.
type inbound struct {
	link  agent.Link
	conns int
}

// joined counts w as a live connection from peer and returns the link it
// belongs to, or reports that peer already holds WithMaxConnsPerPeer
// connections from w's address.
func (b *Backend) joined(w *wconn, peer uuid.UUID) (agent.Link, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	k := peerAddr{peer, w.ip}
	if b.byPeer[k] >= b.cfg.maxConnsPerPeer {
		return agent.Link{}, false
	}
	b.byPeer[k]++
	w.peer = k
	in := b.inbound[peer]
	if in == nil {
		in = &inbound{link: agent.NewLink(peer)}
		b.inbound[peer] = in
	}
	in.conns++
	return in.link, true
}

// left uncounts a connection from peer and reports whether it was the
// last of its link.
func (b *Backend) left(peer uuid.UUID) (agent.Link, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	in := b.inbound[peer]
	if in.conns--; in.conns > 0 {
		return in.link, false
	}
	delete(b.inbound, peer)
	return in.link, true
}

var (
	errBye     = errors.New("tcp: peer said goodbye")
	errEvicted = errors.New("tcp: handshake closed to make room for another")
)

func (s *server) handshake() error {
	b := s.b
	var hs [hsSize]byte
	_ = s.w.c.SetDeadline(time.Now().Add(b.cfg.timeout))
	_, err := io.ReadFull(s.br, hs[:])
	if !b.handshook(s.w) {
		return errEvicted
	}
	if err != nil {
		return err
	}
	in, err := getHandshake(hs[:])
	if err != nil {
		return err
	}
	peer, expect := in.self, in.expect
	var status uint8
	switch {
	case expect != b.id: // an agent that used to live at this address
		status = stDenied
		err = fmt.Errorf("%w: handshake expected agent %s, this is %s", errProtocol, expect, b.id)
	case peer == uuid.Nil:
		status = stDenied
		err = fmt.Errorf("%w: handshake from the nil agent", errProtocol)
	case !s.join(peer):
		// Counted before the peer can use the connection: otherwise its
		// other connections could all close, and report it lost, before
		// this one, which may carry its last notification, is counted.
		status = stLimit
		err = fmt.Errorf("%w: peer %s already holds %d connections from %s", errLimit, peer, b.cfg.maxConnsPerPeer, s.w.ip)
	default:
		s.peer = peer
	}
	out := handshake{status: status, self: b.id, timeout: b.cfg.timeout, maxPieces: b.cfg.maxPieces, maxFrame: b.cfg.maxFrame}
	out.put(hs[:])
	s.w.wmu.Lock()
	_, werr := s.w.c.Write(hs[:])
	if err == nil && werr == nil {
		// Only now: the keepalive loop leaves connections without a ping
		// interval alone, and must not ping before the answer.
		b.setPingEvery(s.w, pingEvery(b.cfg.interval, in.timeout))
	}
	s.w.wmu.Unlock()
	if err != nil {
		return err
	}
	if werr != nil {
		if link, last := b.left(peer); last {
			b.host.LinkLost(link, fmt.Errorf("tcp: handshake with peer %s: %w: %w", peer, agent.ErrRemoteLost, werr))
		}
		return werr
	}
	_ = s.w.c.SetDeadline(time.Time{})
	return nil
}

func (s *server) join(peer uuid.UUID) bool {
	link, ok := s.b.joined(s.w, peer)
	s.link = link
	return ok
}

func (s *server) loop() error {
	var h header
	for {
		s.pc.arm()
		if _, err := io.ReadFull(s.br, s.hdr[:]); err != nil {
			return err
		}
		h.get(s.hdr[:])
		var err error
		switch h.typ {
		case tRead, tWrite:
			err = s.access(&h)
		case tNotify:
			err = s.notify(&h)
		case tPing:
		case tBye:
			return errBye
		default:
			err = fmt.Errorf("%w: frame type %d", errProtocol, h.typ)
		}
		if err != nil {
			return err
		}
	}
}

func (s *server) notify(h *header) error {
	if h.count != 0 {
		return fmt.Errorf("%w: notification with %d pieces", errProtocol, h.count)
	}
	if h.length > maxNotify {
		return fmt.Errorf("%w: notification of %d bytes, at most %d", errLimit, h.length, maxNotify)
	}
	msg := make([]byte, h.length)
	if _, err := io.ReadFull(s.br, msg); err != nil {
		return err
	}
	if !s.b.host.Deliver(s.link, h.key, msg) {
		return agent.ErrClosed
	}
	return nil
}

// access serves one READ or WRITE frame under one lease.
func (s *server) access(h *header) error {
	cfg := &s.b.cfg
	if h.count == 0 {
		return fmt.Errorf("%w: a request of no pieces", errProtocol)
	}
	if uint64(h.count) > uint64(cfg.maxPieces) {
		return fmt.Errorf("%w: %d pieces in a frame, at most %d", errLimit, h.count, cfg.maxPieces)
	}
	n := int(h.count) * pieceSize
	if cap(s.table) < n {
		s.table = make([]byte, n)
	}
	table := s.table[:n]
	if _, err := io.ReadFull(s.br, table); err != nil {
		return err
	}
	var total uint64
	for i := 0; i < n; i += pieceSize {
		l := binary.LittleEndian.Uint64(table[i+8:])
		if l == 0 {
			return fmt.Errorf("%w: piece %d of no bytes", errProtocol, i/pieceSize)
		}
		if l > uint64(cfg.maxFrame) || total+l > uint64(cfg.maxFrame) {
			return fmt.Errorf("%w: frame of more than %d bytes", errLimit, cfg.maxFrame)
		}
		total += l
	}
	write := h.typ == tWrite
	if write && h.length != total {
		return fmt.Errorf("%w: WRITE payload %d bytes, pieces add up to %d", errProtocol, h.length, total)
	}
	acc := agent.AccessRead
	if write {
		acc = agent.AccessWrite
	}
	iov, denied := s.iov[:0], error(nil)
	defer func() { clear(s.iov[:cap(s.iov)]) }() // hold no reference to exposed memory between frames
	lease, err := s.b.host.Open(s.link, h.key, acc)
	if errors.Is(err, agent.ErrRemoteLost) {
		return err // this agent is closing: drop the connection, the peer sees it lost
	}
	if err != nil {
		denied = err
	} else {
		defer lease.Release()
		for i := 0; i < n; i += pieceSize {
			mem, err := lease.Slice(binary.LittleEndian.Uint64(table[i:]), binary.LittleEndian.Uint64(table[i+8:]))
			if err == nil && mem == nil {
				err = fmt.Errorf("%w: device memory cannot be served over tcp", agent.ErrAccessDenied)
			}
			if err != nil {
				denied = fmt.Errorf("piece %d: %w", i/pieceSize, err)
				break
			}
			iov = append(iov, mem)
		}
	}
	s.iov = iov[:0]
	if denied != nil {
		s.b.stats.denied.Add(1)
	}
	if write {
		if denied != nil {
			if _, err := io.CopyN(io.Discard, s.br, int64(total)); err != nil {
				return err
			}
			return s.answer(tWriteAck, h.id, denied, nil)
		}
		for _, mem := range iov {
			if _, err := io.ReadFull(s.br, mem); err != nil {
				return err
			}
		}
		lease.Release()
		return s.answer(tWriteAck, h.id, nil, nil)
	}
	if denied != nil {
		return s.answer(tReadResp, h.id, denied, nil)
	}
	return s.answer(tReadResp, h.id, nil, iov)
}

// answer writes a response header and, for a successful READ, the data
// straight from the exposed memory in one vectored write.
func (s *server) answer(typ uint8, id uint64, denied error, data [][]byte) error {
	h := header{typ: typ, id: id}
	var msg []byte
	if denied != nil {
		h.status = stDenied
		msg = []byte(denied.Error())
		if len(msg) > maxErrMsg {
			msg = msg[:maxErrMsg]
		}
		h.length = uint64(len(msg))
	} else {
		for _, d := range data {
			h.length += uint64(len(d))
		}
	}
	h.put(s.hdr[:])
	s.bufs = append(s.bufs[:0], s.hdr[:])
	if msg != nil {
		s.bufs = append(s.bufs, msg)
	}
	s.bufs = append(s.bufs, data...)
	w := s.w
	w.wmu.Lock()
	defer w.wmu.Unlock()
	s.out = s.bufs // WriteTo consumes its receiver; s.bufs keeps the backing array
	err := writeFrame(w.c, &s.out, s.b.cfg.timeout)
	w.lastWrite.Store(time.Now().UnixNano())
	clear(s.bufs[:cap(s.bufs)])
	return err
}
