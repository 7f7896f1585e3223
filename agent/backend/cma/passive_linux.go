//go:build linux

package cma

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/serve"
)

// admit is the accept loop's handler ([serve.Accept]): it refuses a
// connection whose peer has no credentials, or whose process already holds
// WithMaxConnsPerProcess, and lets the others into the gate of
// WithMaxHandshakes, which closes the oldest handshake when it is full.
// Entering the gate and serving are one step that Close's stopping of
// b.conns is ordered against (serve.Set.Admit): a backend that is closing
// evicts and counts nothing. It reports false once the backend is closing:
// the loop ends.
func (b *Backend) admit(nc net.Conn) bool {
	if b.stopping() {
		_ = nc.Close()
		return false
	}
	c := nc.(*net.UnixConn)
	pid, err := peerCred(c)
	if err != nil {
		_ = c.Close()
		if b.stopping() {
			return false // dropped by a backend that is closing: not the peer's doing
		}
		b.stats.Drop(serve.HandshakeFailure)
		b.log.Debug("cma: dropped a connection whose peer has no credentials", "err", err)
		b.host.Refused()
		return true
	}
	if !b.byPID.Acquire(pid) {
		_ = c.Close()
		if b.stopping() {
			return false
		}
		b.stats.Drop(serve.LimitRejected)
		b.log.Debug("cma: refused a connection: its process holds WithMaxConnsPerProcess", "pid", pid, "max", b.cfg.maxConnsPerProc)
		b.host.Refused()
		return true
	}
	evicted, ok := b.conns.Admit(b.gate, c, c, func(c *net.UnixConn, pass *serve.Pass) { b.serve(c, pid, pass) })
	if !ok {
		b.byPID.Release(pid)
		_ = c.Close()
		return false
	}
	if evicted { // its goroutine ends uncounted (serve.ErrEvicted): counted here
		b.stats.Drop(serve.LimitRejected)
		b.log.Debug("cma: closed the oldest handshake to make room: WithMaxHandshakes in progress", "max", b.cfg.maxHandshakes)
		b.host.Refused()
	}
	return true
}

// frameReader is a server's connection that bounds how long a frame may
// take once begun: a peer may stay idle between frames as long as it likes
// (the copying side holds its connection open without keepalives), but one
// that starts a frame and trickles the rest is cut after the timeout. While
// the connection holds leases, reading also wakes up to renew them when
// they are due (server.renew), whatever the peer sends or withholds.
type frameReader struct {
	s       *server
	inFrame bool      // set once the frame's first byte is in
	frameBy time.Time // when the frame begun must be complete; zero until a read waits for it
	set     time.Time // the read deadline in force
}

func (r *frameReader) Read(p []byte) (int, error) {
	s := r.s
	for {
		var now time.Time
		if r.inFrame || !s.renewAt.IsZero() {
			now = time.Now()
		}
		if !s.renewAt.IsZero() && !now.Before(s.renewAt) {
			if err := s.renew(now); err != nil {
				return 0, err
			}
		}
		if r.inFrame && r.frameBy.IsZero() {
			r.frameBy = now.Add(s.b.cfg.timeout)
		}
		d := r.frameBy
		if !s.renewAt.IsZero() && (d.IsZero() || s.renewAt.Before(d)) {
			d = s.renewAt
		}
		if !d.Equal(r.set) {
			_ = s.c.SetReadDeadline(d)
			r.set = d
		}
		n, err := s.c.Read(p)
		var ne net.Error
		if n == 0 && errors.As(err, &ne) && ne.Timeout() && (r.frameBy.IsZero() || time.Now().Before(r.frameBy)) {
			continue // renewal's deadline, not the frame's
		}
		return n, err
	}
}

// begin waits, without a deadline of its own, for the next frame's first
// byte. Leases due are renewed first: frames already buffered need no Read.
func (r *frameReader) begin(br *bufio.Reader) error {
	r.inFrame, r.frameBy = false, time.Time{}
	if err := r.s.renewDue(); err != nil {
		return err
	}
	if _, err := br.Peek(1); err != nil {
		return err
	}
	r.inFrame = true
	return nil
}

// server is the exposing side of one connection: it answers lease requests
// in order, one at a time, and holds the leases it granted until the peer
// ends them or the connection closes.
type server struct {
	b       *Backend
	c       *net.UnixConn
	pass    *serve.Pass // through Backend.gate, until the handshake arrived
	peer    uuid.UUID
	link    agent.Link // this connection, as the agent sees it
	pid     int
	ptracer bool // pid is named in the Yama ptracer exception
	leases  map[uint64]held
	renewAt time.Time // no lease is due for renewal before; zero: none held
	out     []byte
}

// held is a lease the server granted, with what renews it.
type held struct {
	lease agent.Lease
	key   agent.Key
	acc   agent.Access
	since time.Time // granted or last renewed
}

// errRevoking ends a connection that holds a lease on an exposure being
// revoked (or an agent closing) for longer than the timeout.
var errRevoking = errors.New("cma: a lease held past the timeout is being revoked")

// renewDue renews the leases, if any is due.
func (s *server) renewDue() error {
	if s.renewAt.IsZero() {
		return nil
	}
	if now := time.Now(); !now.Before(s.renewAt) {
		return s.renew(now)
	}
	return nil
}

// renew replaces each lease held for the timeout by a fresh one, as tcp
// renews a frame's. An exposure being revoked, or an agent closing, grants
// none: revocation has then waited on this connection for up to the
// timeout, so the connection is dropped (errRevoking) and serve releases
// its leases once the copier closed its end, or after another timeout
// (drain). Revoke therefore waits at most about twice WithTimeout for a
// connection, whatever its peer does or withholds. Reads between frames
// and grant writes wake up for renewal (frameReader, answer).
func (s *server) renew(now time.Time) error {
	timeout := s.b.cfg.timeout
	var next time.Time
	for id, h := range s.leases {
		if now.Sub(h.since) >= timeout {
			l, err := s.b.host.Open(s.link, h.key, h.acc)
			if err != nil {
				return fmt.Errorf("%w: lease %d, held since %v: %w", errRevoking, id, now.Sub(h.since).Round(time.Millisecond), err)
			}
			h.lease.Release()
			h.lease, h.since = l, now
			s.leases[id] = h
		}
		if at := h.since.Add(timeout); next.IsZero() || at.Before(next) {
			next = at
		}
	}
	s.renewAt = next
	return nil
}

// serve runs the exposing side of connection c from process pid, on a
// goroutine of b.conns, which holds c until it returns.
func (b *Backend) serve(c *net.UnixConn, pid int, pass *serve.Pass) {
	defer b.byPID.Release(pid)
	defer pass.Done()
	defer c.Close()
	s := &server{b: b, c: c, pid: pid, pass: pass, leases: map[uint64]held{}}
	if err := s.handshake(); err != nil {
		if !b.stopping() && !errors.Is(err, serve.ErrEvicted) && b.dropped(err, true, "pid", pid) {
			b.host.Refused()
		}
		return
	}
	if s.ptracer {
		defer b.ptracers.release(s.pid)
	}
	err := s.loop()
	stopping := b.stopping()
	if !stopping && b.dropped(err, false, "peer", s.peer, "pid", pid) && errors.Is(err, errProtocol) {
		b.host.Refused()
	}
	if len(s.leases) > 0 && !closedByPeer(err) {
		s.drain()
	}
	for _, h := range s.leases { // a peer gone mid-copy touches nothing more
		h.lease.Release()
	}
	if stopping {
		return
	}
	// The connection's loss reaches only the exposures whose keys it
	// presented, after every notification it carried was delivered: a
	// probe, or a stranger claiming a peer's ID, reports nothing.
	if s.link != (agent.Link{}) {
		b.host.LinkLost(s.link, fmt.Errorf("cma: connection from peer %s: %w: %w", s.peer, agent.ErrRemoteLost, err))
	}
}

// closedByPeer reports whether a connection ended because the copying side
// closed its end: its process is gone, or it closed the socket itself,
// which it does only once no copy under the connection's leases can run.
func closedByPeer(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)
}

// drain waits, when this side ends a connection that holds leases, until no
// copy under them can run any more: the copying side may be in the middle of
// one, and a closed connection is no proof that it stopped. Shutting this
// end for writing tells it the connection is over; it stops before its next
// chunk and closes its end once its copies in flight returned, and a dead
// process's end closes with it. That end's closing is what drain waits for,
// for at most the timeout (WithTimeout): a copying side that keeps the
// connection open longer is broken or hostile, and a hostile process
// permitted to copy could touch this memory without asking anyway.
func (s *server) drain() {
	_ = s.c.CloseWrite()
	_ = s.c.SetReadDeadline(time.Now().Add(s.b.cfg.timeout))
	var buf [512]byte
	for {
		if _, err := s.c.Read(buf[:]); err != nil {
			return
		}
	}
}

// stopping reports whether the backend's lifetime is over: a connection
// that ends now ends because this agent closes.
func (b *Backend) stopping() bool { return b.ctx.Err() != nil }

// handshake checks the dialler's claims against the kernel's: the process
// ID it names must be the socket's peer credential. It answers with the
// probe address and nonce, after naming the peer as a ptracer where Yama
// requires it and the peer presented a valid key (nameTracer).
func (s *server) handshake() error {
	b := s.b
	var hs [hsSize]byte
	_ = s.c.SetDeadline(time.Now().Add(b.cfg.timeout))
	_, err := io.ReadFull(s.c, hs[:])
	if !s.pass.Done() {
		return serve.ErrEvicted
	}
	if err != nil {
		return err
	}
	in, err := getHandshake(hs[:])
	if err != nil {
		return err
	}
	pid := s.pid
	out := handshake{self: b.id, pid: uint32(b.pid), scope: noScope}
	if b.scope >= 0 && b.scope < noScope {
		out.scope = uint8(b.scope)
	}
	switch hsErr := serve.CheckHandshake(b.id, in.self, in.expect); {
	case hsErr != nil:
		out.status = stWrong
		err = fmt.Errorf("%w: %w", errProtocol, hsErr)
	case int(in.pid) != pid:
		out.status = stWrong
		err = fmt.Errorf("%w: handshake claims process %d, the socket's peer is process %d", errProtocol, in.pid, pid)
	default:
		out.probe, out.nonce, out.leases = b.probeAddr(), *b.probe, maxLeases
	}
	if err == nil && b.scope == 1 {
		// Before the answer: the peer probes as soon as it has it. The
		// exception is withdrawn when this connection closes (serve).
		out.ptracer = s.nameTracer(in)
	}
	out.put(hs[:])
	if _, werr := s.c.Write(hs[:]); werr != nil && err == nil {
		err = werr
	}
	s.pid = pid
	if err != nil {
		if s.ptracer {
			b.ptracers.release(pid)
		}
		return err
	}
	s.peer, s.link = in.self, agent.NewLink(in.self)
	_ = s.c.SetDeadline(time.Time{})
	return nil
}

// nameTracer names the dialler, whose claims checked out, this process's
// ptracer under Yama mode 1, if it presented a key of a live exposure of
// this agent for the access it named and no other process holds the
// exception. A key-less local process is named nothing: the exception lets
// the named process attach to this one, not just copy what leases allow.
// The key is checked with a lease taken and released at once, on no link:
// the check binds the dialler to no exposure, so a dialler that probes and
// then falls back is no peer those exposures can lose.
func (s *server) nameTracer(in handshake) uint8 {
	b := s.b
	if !b.cfg.ptracer {
		return ptrOff
	}
	acc := agent.Access(in.status)
	if in.nonce == [16]byte{} || (acc != agent.AccessRead && acc != agent.AccessWrite) {
		return ptrNoKey
	}
	l, err := b.host.Open(agent.Link{}, agent.Key(in.nonce), acc)
	if err != nil {
		return ptrRefused // counted by the host
	}
	l.Release()
	if !b.ptracers.claim(s.pid) {
		return ptrHeld
	}
	s.ptracer = true
	return ptrNamed
}

func (s *server) loop() error {
	fr := &frameReader{s: s}
	br := bufio.NewReaderSize(fr, 16<<10)
	var hdr [hdrSize]byte
	var buf []byte
	var f frame
	for {
		if err := fr.begin(br); err != nil {
			return err
		}
		if err := readFrame(br, hdr[:], &buf, s.b.lim, &f); err != nil {
			return err
		}
		var err error
		switch f.typ {
		case tBegin:
			err = s.begin(&f)
		case tEnd:
			if h, ok := s.leases[f.id]; ok {
				delete(s.leases, f.id)
				h.lease.Release()
				if len(s.leases) == 0 {
					s.renewAt = time.Time{}
				}
			}
		case tNotify:
			msg := make([]byte, len(f.payload))
			copy(msg, f.payload)
			if !s.b.host.Deliver(s.link, f.key, msg) {
				return agent.ErrClosed
			}
		case tBye:
			return errBye
		default:
			err = fmt.Errorf("%w: frame type %d from the copying side", errProtocol, f.typ)
		}
		if err != nil {
			return err
		}
	}
}

// begin grants or refuses one lease: the key, the access kind and every
// range are checked; a lease is granted for all of them or none.
func (s *server) begin(f *frame) error {
	if _, dup := s.leases[f.id]; dup {
		return fmt.Errorf("%w: lease %d requested twice", errProtocol, f.id)
	}
	if len(s.leases) >= maxLeases {
		return fmt.Errorf("%w: more than %d leases held at once", errLimit, maxLeases)
	}
	lease, err := s.b.host.Open(s.link, f.key, agent.Access(f.status))
	if errors.Is(err, agent.ErrRemoteLost) {
		return s.answer(f.id, stLost, err) // this agent is closing
	}
	if err != nil {
		s.b.stats.Deny()
		return s.answer(f.id, stDenied, err)
	}
	for i := range int(f.count) {
		mem, err := lease.Slice(f.rangeAt(i))
		if err == nil && mem == nil {
			err = fmt.Errorf("%w: device memory cannot be copied by cma", agent.ErrAccessDenied)
		}
		if err != nil {
			lease.Release()
			s.b.stats.Deny()
			return s.answer(f.id, stDenied, fmt.Errorf("range %d: %w", i, err))
		}
	}
	now := time.Now()
	if s.renewAt.IsZero() {
		s.renewAt = now.Add(s.b.cfg.timeout)
	}
	s.leases[f.id] = held{lease: lease, key: f.key, acc: agent.Access(f.status), since: now}
	if err := s.answer(f.id, stOK, nil); err != nil {
		return err // serve releases the lease
	}
	return nil
}

func (s *server) answer(id uint64, status uint8, why error) error {
	var msg string
	if why != nil {
		msg = why.Error()
		if len(msg) > maxErrMsg {
			msg = msg[:maxErrMsg]
		}
	}
	b := s.out[:0]
	if cap(b) < hdrSize+maxErrMsg {
		b = make([]byte, 0, hdrSize+maxErrMsg)
	}
	b = b[:hdrSize]
	(&header{typ: tGrant, status: status, id: id, length: uint32(len(msg))}).put(b)
	b = append(b, msg...)
	s.out = b
	// The write may wait for the peer to read for the timeout, and no
	// longer than leases stay unrenewed.
	writeBy := time.Now().Add(s.b.cfg.timeout)
	for {
		d := writeBy
		if !s.renewAt.IsZero() && s.renewAt.Before(d) {
			d = s.renewAt
		}
		_ = s.c.SetWriteDeadline(d)
		n, err := s.c.Write(b)
		b = b[n:]
		var ne net.Error
		if err != nil && errors.As(err, &ne) && ne.Timeout() && time.Now().Before(writeBy) {
			if err := s.renewDue(); err != nil {
				return err
			}
			continue // renewal's deadline, not the write's
		}
		return err
	}
}
