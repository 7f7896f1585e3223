package tcp

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/serve"
)

// readBuf is the read buffer per connection: it batches small headers and
// tables into few system calls; payloads larger than it bypass it.
const readBuf = 16 << 10

// admit is the accept loop's handler (serve.Accept): it refuses a
// connection whose address already holds WithMaxConnsPerIP, and lets the
// others into the gate of WithMaxHandshakes, which closes the oldest
// handshake when it is full: a legitimate handshake takes one round trip,
// so the oldest is the likeliest to be a slow-loris. Entering the gate and
// serving are one step that Close's stopping of b.conns is ordered against
// (serve.Set.Admit): a backend that is closing evicts and counts nothing.
// It reports false once the backend is closing: the loop ends.
func (b *Backend) admit(c net.Conn) bool {
	ip := remoteIP(c)
	if !b.byIP.Acquire(ip) {
		_ = c.Close()
		if b.conns.Stopping() || b.stopping() {
			return false // refused, but by a backend that is closing: not the peer's doing
		}
		b.stats.Drop(serve.LimitRejected)
		b.host.Refused()
		b.log.Debug("refused a connection: its address holds WithMaxConnsPerIP connections", "remote", c.RemoteAddr().String())
		return true
	}
	w := newWconn(c)
	w.ip = ip
	evicted, ok := b.conns.Admit(b.gate, w, c, func(w *wconn, pass *serve.Pass) {
		w.pass = pass
		b.serve(w)
	})
	if !ok {
		b.byIP.Release(ip)
		_ = c.Close()
		return false
	}
	if evicted { // its goroutine returns, uncounted: counted here
		b.stats.Drop(serve.LimitRejected)
		b.host.Refused()
		b.log.Debug("closed the oldest handshake to make room (WithMaxHandshakes)")
	}
	return true
}

// remoteIP returns the IP address of c's remote end.
func remoteIP(c net.Conn) netip.Addr {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.IPv6Unspecified()
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
	b    *Backend
	w    *wconn
	pc   *patientConn // under br
	br   *bufio.Reader
	peer uuid.UUID
	in   *inbound
	link agent.Link
	hdr  [hdrSize]byte

	// The lease of the frame being served, when it was taken, and what
	// renews it (renew).
	lease   agent.Lease
	leased  time.Time
	key     agent.Key
	acc     agent.Access
	renewFn func() bool
	table   []byte
	iov     [][]byte
	bufs    [][]byte
	out     net.Buffers
}

// serve serves an accepted connection, on a goroutine of its own
// (serve.Set.Admit), until it ends.
func (b *Backend) serve(w *wconn) {
	defer b.untrack(w)
	defer w.c.Close()
	pc := &patientConn{c: w.c, rx: &w.rx, timeout: b.cfg.timeout, spin: b.cfg.spin}
	s := &server{b: b, w: w, pc: pc, br: bufio.NewReaderSize(pc, readBuf)}
	s.renewFn = s.renew
	if err := s.handshake(); err != nil {
		if !b.stopping() && !errors.Is(err, serve.ErrEvicted) && b.dropped(err, true, "remote", w.c.RemoteAddr().String()) {
			b.host.Refused()
		}
		return
	}
	err := w.reason(s.loop())
	if b.stopping() {
		return // our own shutdown closed it
	}
	if b.dropped(err, false, "remote", w.c.RemoteAddr().String(), "peer", s.peer) && errors.Is(err, errProtocol) {
		b.host.Refused()
	}
	// A goodbye is an orderly close, but the peer is gone all the same:
	// exposures it was using must not wait for it; an idle goodbye, or a
	// frame we cut because its exposure was revoked, is no departure. The
	// loss is reported when the last connection of the peer's session
	// ends: every notification its control connection carried has then
	// been dispatched, so the loss never overtakes a completion. A stranger
	// who claims the peer's identity has a session of its own, and its
	// hang-up reaches none of the peer's exposures.
	loss := !errors.Is(err, errIdleBye) && !errors.Is(err, errRevoked)
	if b.left(s.in, loss) {
		b.host.LinkLost(s.link, fmt.Errorf("tcp: connection from peer %s: %w: %w", s.peer, agent.ErrRemoteLost, err))
	}
}

// stopping reports whether the backend is closing: the agent began to
// close it, or Close was called.
func (b *Backend) stopping() bool { return b.ctx.Err() != nil }

// sessionKey names one dialling peer's connections: the identity it
// claims and the random session its handshakes carry.
type sessionKey struct {
	peer    uuid.UUID
	session [16]byte
}

// inbound is the live connections of one session, which share one link.
type inbound struct {
	key   sessionKey
	link  agent.Link
	conns int  // under Backend.mu
	lost  bool // one of them ended for a reason that is a departure; likewise
}

// joined counts w as a live connection of peer's session and returns the
// group it belongs to, or reports that peer already holds
// WithMaxConnsPerPeer connections from w's address. A zero session (never
// sent by this package) groups nothing: the connection is a link of its own.
func (b *Backend) joined(w *wconn, peer uuid.UUID, session [16]byte) (*inbound, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	k := peerAddr{peer, w.ip}
	if !b.byPeer.Acquire(k) {
		return nil, false
	}
	w.peer = k
	sk := sessionKey{peer, session}
	in := b.inbound[sk]
	if in == nil {
		in = &inbound{key: sk, link: agent.NewLink(peer)}
		if session != ([16]byte{}) {
			b.inbound[sk] = in
		}
	}
	in.conns++
	return in, true
}

// left uncounts a connection of in, which ended by a departure of the
// peer if loss, and reports whether the session is now lost: this was its
// last connection, and one of them ended by a departure.
func (b *Backend) left(in *inbound, loss bool) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	in.lost = in.lost || loss
	if in.conns--; in.conns > 0 {
		return false
	}
	if b.inbound[in.key] == in {
		delete(b.inbound, in.key)
	}
	return in.lost
}

var (
	errBye     = errors.New("tcp: peer said goodbye")
	errIdleBye = errors.New("tcp: peer closed an idle connection")
)

func (s *server) handshake() error {
	b := s.b
	var hs [hsSize]byte
	_ = s.w.c.SetDeadline(time.Now().Add(b.cfg.timeout))
	_, err := io.ReadFull(s.br, hs[:])
	if !s.w.pass.Done() {
		return serve.ErrEvicted
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
	switch hsErr := serve.CheckHandshake(b.id, peer, expect); {
	case hsErr != nil: // an agent that used to live at this address, or none
		status = stDenied
		err = fmt.Errorf("%w: %w", errProtocol, hsErr)
	case !s.join(peer, in.session):
		// Counted before the peer can use the connection: otherwise its
		// other connections could all close, and report it lost, before
		// this one, which may carry its last notification, is counted.
		status = stLimit
		err = fmt.Errorf("%w: peer %s already holds %d connections from %q", errLimit, peer, b.cfg.maxConnsPerPeer, s.w.ip)
	default:
		s.peer = peer
	}
	out := handshake{status: status, self: b.id, timeout: b.cfg.timeout, maxPieces: b.cfg.maxPieces, maxFrame: b.cfg.maxFrame, trailers: true}
	out.put(hs[:])
	s.w.wl.lock() // no ping before the answer: nobody else writes yet
	_, werr := s.w.c.Write(hs[:])
	if err == nil && werr == nil {
		// Only now: the keepalive loop leaves connections without a ping
		// interval alone, and must not ping before the answer.
		b.setPingEvery(s.w, pingEvery(b.cfg.interval, in.timeout))
	}
	s.w.wl.unlock()
	if err != nil {
		return err
	}
	if werr != nil {
		if b.left(s.in, true) {
			b.host.LinkLost(s.link, fmt.Errorf("tcp: handshake with peer %s: %w: %w", peer, agent.ErrRemoteLost, werr))
		}
		return werr
	}
	_ = s.w.c.SetDeadline(time.Time{})
	return nil
}

func (s *server) join(peer uuid.UUID, session [16]byte) bool {
	in, ok := s.b.joined(s.w, peer, session)
	if ok {
		s.in, s.link = in, in.link
	}
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
			s.pc.busy()
		case tNotify:
			err = s.notify(&h)
		case tPing:
		case tBye:
			if h.status == stIdle {
				return errIdleBye
			}
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
	// rest is what follows the table: a WRITE's payload and trailer. A
	// request's status means nothing else.
	var rest, trailer uint64
	switch {
	case write && h.status == stTrailer:
		if h.length <= total || h.length-total-1 > maxNotify {
			return fmt.Errorf("%w: WRITE of %d bytes with a trailer of %d, want a notification of at most %d and its whole byte", errProtocol, total, h.length-min(h.length, total), maxNotify)
		}
		rest, trailer = h.length, h.length-total
	case write && h.length != total:
		return fmt.Errorf("%w: WRITE payload %d bytes, pieces add up to %d", errProtocol, h.length, total)
	case write:
		rest = total
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
		s.lease, s.key, s.acc, s.leased = lease, h.key, acc, time.Now()
		defer s.dropLease()
		// Device memory is staged whole for the frame: one buffer, and for
		// a READ one wait for the copies out of the device (Ready).
		if err := lease.Prepare(total); err != nil {
			denied = err
			n = 0
		}
		for i := 0; i < n; i += pieceSize {
			mem, err := lease.Slice(binary.LittleEndian.Uint64(table[i:]), binary.LittleEndian.Uint64(table[i+8:]))
			if err == nil && mem == nil { // the agent stages device memory for tcp: never nil
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
		s.b.stats.Deny()
	}
	if write {
		if denied != nil {
			if _, err := io.CopyN(io.Discard, s.br, int64(rest)); err != nil {
				return err
			}
			return s.answer(tWriteAck, h.id, denied, nil)
		}
		// The payload may take many timeouts to arrive on a slow link: the
		// lease is renewed at each, so that a revocation waits for at
		// most one.
		s.pc.renew = s.renewFn
		var got uint64
		for _, mem := range iov {
			n, err := io.ReadFull(s.br, mem)
			got += uint64(n)
			if errors.Is(err, errRevoked) {
				s.pc.renew = nil
				s.dropLease()
				s.b.stats.Deny()
				s.pc.arm()
				if _, err := io.CopyN(io.Discard, s.br, int64(rest-got)); err != nil {
					return err
				}
				return s.answer(tWriteAck, h.id, fmt.Errorf("%w: exposure revoked while the WRITE arrived", agent.ErrAccessDenied), nil)
			}
			if err != nil {
				s.pc.renew = nil
				return err
			}
		}
		s.pc.renew = nil
		var note []byte
		if trailer > 0 {
			note = make([]byte, trailer)
			if _, err := io.ReadFull(s.br, note); err != nil {
				return err
			}
		}
		// Staged device memory reaches the device before the ack: a
		// failure is the peer's to hear, and the ack never overtakes it.
		flushErr := s.lease.Flush()
		s.dropLease()
		if flushErr != nil {
			return s.answer(tWriteAck, h.id, flushErr, nil)
		}
		// The notification after the data, and before the ack: the peer's
		// transfer succeeds only once it was delivered. A frame its sender
		// cut short (its whole byte zero) landed zeros: no notification.
		if len(note) > 0 && note[len(note)-1] == whole[0] {
			if !s.b.host.Deliver(s.link, h.key, note[:len(note)-1]) {
				return agent.ErrClosed
			}
		}
		return s.answer(tWriteAck, h.id, nil, nil)
	}
	if denied == nil {
		denied = lease.Ready()
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
	timeout := s.b.cfg.timeout
	var renew func() bool
	var first time.Time // the end of the first timeout granted
	if data != nil {
		// As for a WRITE's payload: a revocation waits for one timeout at
		// most, counted from when the lease was taken, waiting for the
		// write lock included. Its holder is a keepalive the peer does
		// not take (finishPing): the peer is not reading.
		renew, first = s.renewFn, s.leased.Add(timeout)
		if !w.wl.lockBy(first) {
			return fmt.Errorf("tcp: READ answer waited for the connection's writer until its lease ran out: %w", os.ErrDeadlineExceeded)
		}
	} else {
		w.wl.lock()
	}
	defer w.wl.unlock()
	s.out = s.bufs // WriteTo consumes its receiver; s.bufs keeps the backing array
	err := writeFrame(w, &s.out, timeout, nil, renew, first)
	w.lastWrite.Store(time.Now().UnixNano())
	clear(s.bufs[:cap(s.bufs)])
	return err
}

// renew replaces the lease of the frame being served by a fresh one, at
// each timeout a slow frame is granted: a revoked exposure grants none, and
// the frame ends (errRevoked) without touching the memory again.
func (s *server) renew() bool {
	// Renew, not a fresh lease: the frame's staging buffers stay valid.
	if err := s.lease.Renew(); err != nil {
		s.dropLease()
		return false
	}
	return true
}

func (s *server) dropLease() {
	s.lease.Release()
	s.lease = agent.Lease{}
}
