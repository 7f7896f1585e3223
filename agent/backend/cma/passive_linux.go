//go:build linux

package cma

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"

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
}

func (r *frameReader) Read(p []byte) (int, error) {
	s := r.s
	for {
		if err := s.renewDue(); err != nil {
			return 0, err
		}
		if err := s.aborted(); err != nil {
			return 0, err
		}
		if r.inFrame && r.frameBy.IsZero() {
			r.frameBy = time.Now().Add(s.b.cfg.timeout)
		}
		s.armRead(r.frameBy)
		n, err := readQuiet(s.c, p)
		var ne net.Error
		if n == 0 && errors.As(err, &ne) && ne.Timeout() && (r.frameBy.IsZero() || time.Now().Before(r.frameBy)) {
			continue // renewal's deadline, not the frame's
		}
		return n, err
	}
}

// readQuiet is c.Read without the runtime's system call bookkeeping: the
// socket is non-blocking, so each read(2) returns at once, and a read made
// with syscall.RawSyscall does not wake the runtime's monitor thread
// (sysmon), asleep while the process idles, as syscall.Syscall does. The
// exposing side of a connection idles between completion notifications;
// waking that thread cost about 3 µs of CPU and a wake-up per notification
// (docs/benchmarks.md, "Small transfers on cma"). The wait for data is
// the poller's, as c.Read's, with the same deadlines and errors. (Under
// the race detector it reads with syscall.Read: see rawRead.) A file
// descriptor a peer attaches (SCM_RIGHTS) is discarded by the kernel, as
// with c.Read: this side expects none.
func readQuiet(c *net.UnixConn, p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int
	var errno syscall.Errno
	err = rc.Read(func(fd uintptr) bool {
		for {
			r, e := rawRead(fd, p)
			if e == syscall.EINTR {
				continue
			}
			n, errno = r, e
			return e != syscall.EAGAIN
		}
	})
	switch {
	case err != nil:
		return 0, err
	case errno != 0:
		return 0, &net.OpError{Op: "read", Net: "unix", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: os.NewSyscallError("read", errno)}
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

// rawRead is one read(2) of fd into p, which is not empty: a raw system
// call, or in a binary built with the race detector syscall.Read, whose
// annotations tell the detector that a read happens after the write(2)
// it reads. Without them, whatever a goroutine of this process did
// before writing to the peer's end looks concurrent with what the reader
// does after reading it: a false report of a race.
func rawRead(fd uintptr, p []byte) (int, syscall.Errno) {
	if raceBuild {
		n, err := syscall.Read(int(fd), p)
		var errno syscall.Errno
		if err != nil && !errors.As(err, &errno) {
			errno = syscall.EIO // not reached: its errors are Errnos
		}
		return n, errno
	}
	r, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(r), e
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
// and holds the leases it granted until the peer ends them or the
// connection closes. Its reader handles frames in order, one at a time;
// lease requests that cover device memory are staged on a goroutine of the
// connection's own (stager), in order, so that a request waiting for
// staging buffers never holds up the ends that free them.
type server struct {
	b       *Backend
	c       *net.UnixConn
	pass    *serve.Pass // through Backend.gate, until the handshake arrived
	peer    uuid.UUID
	link    agent.Link // this connection, as the agent sees it
	pid     int
	ptracer bool // pid is named in the Yama ptracer exception
	staged  bool // the dialler takes staged grants (capStaged)
	device  bool // the dialler maps device shares (capDevice)
	shm     bool // the dialler maps shared segments (capShm)
	sh      shmServe

	// Device allocations shared on the connection (capDevice), under
	// shareMu, which also orders tShare, tGrant and tUnshare frames: a
	// grant follows the shares it names, a share's end follows its
	// grants. One watcher per exposure key takes the key's shares back
	// when the exposure is gone, or ends with the connection (done).
	shareMu sync.Mutex
	exports map[uint64]*exported
	byKey   map[agent.Key][]*exported
	watched map[agent.Key]bool
	done    chan struct{}
	watchWG sync.WaitGroup

	// mu guards the leases and their renewal, the read deadline, and the
	// stager's queue: the reader and the stager share them.
	mu      sync.Mutex
	leases  map[uint64]held
	renewAt time.Time // no lease is due for renewal before; zero: none held
	readBy  time.Time // the read deadline in force

	// The stager: lease requests with device memory, staged in order off
	// the reader. Under mu, but wake and stopped, which the reader sets
	// before the stager runs and reads after it ended.
	queue    []*queued
	pending  map[uint64]*queued // lease requests queued or being staged, by id
	live     int                // pending requests the copier has not ended
	stopping bool               // the connection is over: grant nothing more
	stageErr error              // a grant the stager could not write
	wake     chan struct{}      // nil until the stager runs
	stopped  chan struct{}      // closed when the stager returned

	wmu sync.Mutex // one answer written at a time
	out []byte     // under wmu
}

// held is a lease the server granted, with what renews it.
type held struct {
	lease agent.Lease
	key   agent.Key
	acc   agent.Access
	since time.Time // granted or last renewed
}

// queued is a lease request for the stager, its lease opened.
type queued struct {
	id    uint64
	lease agent.Lease
	key   agent.Key
	acc   agent.Access
	table []byte // the request's ranges; nil once ended
	count int
	ended bool // the copier ended the request before its grant; under mu
}

// maxPending bounds the lease requests a connection may have queued for
// the stager, ended ones included (their ranges are dropped): the copier
// keeps at most maxLeases unended, and one that ends requests faster than
// they are staged is hostile.
const maxPending = 2 * maxLeases

// errRevoking ends a connection that holds a lease on an exposure being
// revoked (or an agent closing) for longer than the timeout.
var errRevoking = errors.New("cma: a lease held past the timeout is being revoked")

// renewDue renews the leases, if any is due.
func (s *server) renewDue() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.renewAt.IsZero() {
		return nil
	}
	if now := time.Now(); !now.Before(s.renewAt) {
		return s.renew(now)
	}
	return nil
}

// armRead sets the read deadline to the earlier of frameBy (zero: none)
// and the leases' next renewal; once the stager failed, the deadline it
// set stays, in the past.
func (s *server) armRead(frameBy time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stageErr != nil {
		return
	}
	d := frameBy
	if !s.renewAt.IsZero() && (d.IsZero() || s.renewAt.Before(d)) {
		d = s.renewAt
	}
	if !d.Equal(s.readBy) {
		_ = s.c.SetReadDeadline(d)
		s.readBy = d
	}
}

// hold records a granted lease. A reader waiting for the next frame wakes
// up for its renewal: the stager grants while the reader waits. The caller
// holds mu.
func (s *server) hold(id uint64, h held) {
	s.leases[id] = h
	if !s.renewAt.IsZero() {
		return
	}
	s.renewAt = h.since.Add(s.b.cfg.timeout)
	if s.readBy.IsZero() || s.renewAt.Before(s.readBy) {
		_ = s.c.SetReadDeadline(s.renewAt)
		s.readBy = s.renewAt
	}
}

// renew checks each lease held for the timeout against revocation, as tcp
// renews a frame's: a fresh lease is asked for and released at once, and
// the lease held is kept, since the copier may be copying at the staging
// buffers it holds (a lease released while copies may run would hand them
// to another lease). An exposure being revoked, or an agent closing,
// grants none: revocation has then waited on this connection for up to the
// timeout, so the connection is dropped (errRevoking) and serve releases
// its leases once the copier closed its end, or after another timeout
// (drain). Revoke therefore waits at most about twice WithTimeout for a
// connection, whatever its peer does or withholds, plus the staging of a
// lease request of device memory under way (bounded by the agent's wait
// for a staging buffer). Reads between frames and grant writes wake up for
// renewal (frameReader, answer). The caller holds mu.
func (s *server) renew(now time.Time) error {
	timeout := s.b.cfg.timeout
	var next time.Time
	for id, h := range s.leases {
		if now.Sub(h.since) >= timeout {
			l, err := s.b.host.Open(s.link, h.key, h.acc)
			if err != nil {
				return fmt.Errorf("%w: lease %d, held since %v: %w", errRevoking, id, now.Sub(h.since).Round(time.Millisecond), err)
			}
			l.Release()
			h.since = now
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
	s := &server{b: b, c: c, pid: pid, pass: pass, leases: map[uint64]held{}, done: make(chan struct{})}
	s.sh.fd = -1
	defer s.stopShm()
	defer s.closeTableFD()
	defer s.watchWG.Wait()
	defer close(s.done)
	if err := s.handshake(); err != nil {
		if !b.stopping() && !errors.Is(err, serve.ErrEvicted) && b.dropped(err, true, "pid", pid) {
			b.host.Refused()
		}
		return
	}
	if s.ptracer {
		defer b.ptracers.release(s.pid)
	}
	var err error
	if s.shm {
		err = s.startShm()
	}
	if err == nil {
		err = s.loop()
	}
	if closedByPeer(err) {
		s.sh.peerGone.Store(true) // no copy of the peer's runs in its mappings
	}
	if serr := s.stopStager(); serr != nil {
		err = serr
	}
	stopping := b.stopping()
	if !stopping && b.dropped(err, false, "peer", s.peer, "pid", pid) && errors.Is(err, errProtocol) {
		b.host.Refused()
	}
	if len(s.leases) > 0 && !closedByPeer(err) {
		s.drain()
	}
	for _, h := range s.leases { // a peer gone mid-copy touches nothing more
		h.lease.Release() // unflushed: a WRITE not ended as written is incomplete
	}
	if stopping {
		return
	}
	// The connection's loss reaches only the exposures whose keys it
	// presented, after every notification it carried was delivered: a
	// probe, or a stranger claiming a peer's ID, reports nothing.
	if s.link != (agent.Link{}) {
		s.bindShm() // exposures the copier used through shared memory hear of it too
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
		// Zero to a dialler that announced nothing: it reads the leases
		// field as a u32 that covers caps.
		out.caps = in.caps & capStaged
		if in.caps&capStaged != 0 {
			out.caps |= b.agreeDevice(in.caps)
		}
	}
	if err == nil && b.scope == 1 {
		// Before the answer: the peer probes as soon as it has it. The
		// exception is withdrawn when this connection closes (serve).
		out.ptracer = s.nameTracer(in)
	}
	// Shared memory, only to a peer that may read this process's memory
	// with cma: same user (or root), and under Yama mode 1 named ptracer
	// for a key it presented.
	if err == nil && in.caps&capShm != 0 && b.cfg.shm && sameUser(s.c) && (b.scope <= 0 || out.ptracer == ptrNamed) {
		if terr := s.makeTable(); terr != nil {
			b.log.Warn("cma: no lease table for shared memory; leases serve it", "pid", pid, "err", terr)
		} else {
			out.caps |= capShm
		}
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
	s.staged = out.caps&capStaged != 0
	s.device = out.caps&capDevice != 0
	s.shm = out.caps&capShm != 0
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
	lim := s.b.lim
	lim.shm = s.shm
	for {
		if err := fr.begin(br); err != nil {
			return err
		}
		if err := readFrame(br, hdr[:], &buf, lim, &f); err != nil {
			return err
		}
		var err error
		switch f.typ {
		case tBegin:
			err = s.begin(&f)
		case tEnd:
			err = s.end(&f)
		case tUse:
			// A large copy through shared memory begins: the exposure
			// hears of this connection's loss, as through a lease. A key
			// refused is counted as a lease would be.
			if l, err := s.b.host.Open(s.link, f.key, agent.Access(f.status)); err == nil {
				l.Release()
			}
		case tNotify:
			// Delivered at once, also while lease requests are being
			// staged: the ends read before it are handled (a WRITE's
			// bytes are in the device), and a request still being staged
			// holds nothing written.
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
// range are checked; a lease is granted for all of them or none. A request
// that covers device memory goes to the stager.
func (s *server) begin(f *frame) error {
	s.mu.Lock()
	_, dup := s.leases[f.id]
	if _, queued := s.pending[f.id]; queued {
		dup = true
	}
	n, waiting := len(s.leases)+s.live, len(s.pending)
	s.mu.Unlock()
	if dup {
		return fmt.Errorf("%w: lease %d requested twice", errProtocol, f.id)
	}
	if n >= maxLeases {
		return fmt.Errorf("%w: more than %d leases held at once", errLimit, maxLeases)
	}
	if waiting >= maxPending {
		return fmt.Errorf("%w: more than %d lease requests waiting to be staged, ended ones included", errLimit, maxPending)
	}
	acc := agent.Access(f.status)
	lease, err := s.b.host.Open(s.link, f.key, acc)
	if errors.Is(err, agent.ErrRemoteLost) {
		return s.answer(tGrant, f.id, stLost, err, nil) // this agent is closing
	}
	if err != nil {
		s.b.stats.Deny()
		return s.answer(tGrant, f.id, stDenied, err, nil)
	}
	for i := range int(f.count) {
		r, ok := lease.Region(f.rangeAt(i))
		if !ok || r.Kind == agent.KindDRAM {
			continue // Slice says why it is refused
		}
		if s.device {
			if handled, err := s.grantDevice(f, lease, acc); handled {
				return err
			}
		}
		if !s.staged {
			lease.Release()
			s.b.stats.Deny()
			return s.answer(tGrant, f.id, stDenied, fmt.Errorf("range %d: %w: %v memory, which the copying agent's cma cannot reach (it predates staged grants)", i, agent.ErrAccessDenied, r.Kind), nil)
		}
		s.enqueue(&queued{id: f.id, lease: lease, key: f.key, acc: acc, table: bytes.Clone(f.table), count: int(f.count)})
		return nil
	}
	addrs, err := s.slices(&lease, f.table, int(f.count))
	if err != nil {
		lease.Release()
		s.b.stats.Deny()
		return s.answer(tGrant, f.id, stDenied, err, nil)
	}
	s.mu.Lock()
	s.hold(f.id, held{lease: lease, key: f.key, acc: acc, since: time.Now()})
	s.mu.Unlock()
	return s.answer(tGrant, f.id, stOK, nil, addrs) // on failure serve releases the lease
}

// slices checks every range of a lease request through lease, which stages
// those of device memory, and returns where the copier must copy them: nil
// if at the ranges' own addresses.
func (s *server) slices(lease *agent.Lease, table []byte, count int) ([]uint64, error) {
	// Device memory is staged whole for the lease: one buffer, and for a
	// READ one wait for the copies out of the device (Ready, below).
	var total uint64
	for i := range count {
		_, n := rangeAt(table, i)
		total += n
	}
	if err := lease.Prepare(total); err != nil {
		return nil, err
	}
	var addrs []uint64
	for i := range count {
		addr, n := rangeAt(table, i)
		mem, err := lease.Slice(addr, n)
		if err == nil && mem == nil {
			err = fmt.Errorf("%w: device memory the agent does not stage for cma", agent.ErrAccessDenied)
		}
		if err != nil {
			return nil, fmt.Errorf("range %d: %w", i, err)
		}
		at := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(mem))))
		if at != addr && addrs == nil {
			if !s.staged {
				return nil, fmt.Errorf("range %d: %w: staged device memory, which the copying agent's cma cannot reach (it predates staged grants)", i, agent.ErrAccessDenied)
			}
			addrs = make([]uint64, count)
			for j := range i {
				addrs[j], _ = rangeAt(table, j)
			}
		}
		if addrs != nil {
			addrs[i] = at
		}
	}
	if err := lease.Ready(); err != nil {
		return nil, err
	}
	return addrs, nil
}

// end releases the lease the copier ended (f). A WRITE's staging buffers
// are copied into the device first if the copier wrote every byte
// (endWritten), before the next frame is read: a notification that follows
// the end on the connection is delivered after that copy, and if it failed
// carries the failure (agent.Event.Err). With endAck the copier hears the
// outcome (tFlushed). An end of a request still being staged is the
// stager's to release.
func (s *server) end(f *frame) error {
	id := f.id
	s.mu.Lock()
	h, ok := s.leases[id]
	if ok {
		delete(s.leases, id)
		if len(s.leases) == 0 {
			s.renewAt = time.Time{}
		}
	} else if q := s.pending[id]; q != nil && !q.ended {
		q.ended, q.table = true, nil
		s.live--
	}
	s.mu.Unlock()
	var err error
	if ok {
		if h.acc == agent.AccessWrite && f.status&endWritten != 0 {
			err = h.lease.Flush()
		}
		h.lease.Release()
	} else {
		// Ended before its grant, or refused: nothing was written.
		err = fmt.Errorf("%w: lease %d ended, which was never granted", agent.ErrAccessDenied, id)
	}
	if f.status&endAck == 0 {
		if ok && err != nil {
			s.b.log.Warn("cma: a peer's WRITE did not reach GPU memory; the exposure's next notification carries the error", "peer", s.peer, "lease", id, "err", err)
		}
		return nil
	}
	status := uint8(stOK)
	if err != nil {
		status = stFailed
	}
	return s.answer(tFlushed, id, status, err, nil)
}

// enqueue hands the lease request q to the stager, starting it if need be.
func (s *server) enqueue(q *queued) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pending == nil {
		s.pending = map[uint64]*queued{}
	}
	s.pending[q.id] = q
	s.live++
	s.queue = append(s.queue, q)
	if s.wake == nil {
		s.wake, s.stopped = make(chan struct{}, 1), make(chan struct{})
		go s.stager()
	}
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// stager stages the queued lease requests in order until the connection
// is over.
func (s *server) stager() {
	defer close(s.stopped)
	s.mu.Lock()
	for {
		for len(s.queue) == 0 {
			if s.stopping {
				s.mu.Unlock()
				return
			}
			s.mu.Unlock()
			<-s.wake
			s.mu.Lock()
		}
		q := s.queue[0]
		s.queue[0] = nil
		s.queue = s.queue[1:]
		if len(s.queue) == 0 {
			s.queue = nil // let a burst's backing array go
		}
		s.mu.Unlock()
		s.stage(q)
		s.mu.Lock()
	}
}

// stage grants or refuses a lease request of device memory; its lease was
// opened by the reader. A request the copier ended meanwhile is released
// and answered with a refusal (the copier drops it), one left when the
// connection ends is released unanswered.
func (s *server) stage(q *queued) {
	s.mu.Lock()
	ended, stopping, table := q.ended, s.stopping, q.table
	s.mu.Unlock()
	var addrs []uint64
	var err error
	switch {
	case stopping, ended:
	default:
		// Queued for a while, maybe: a revoked exposure or a closing agent
		// grants nothing more.
		if err = q.lease.Renew(); err == nil {
			addrs, err = s.slices(&q.lease, table, q.count)
		}
	}
	s.mu.Lock()
	delete(s.pending, q.id)
	if !q.ended {
		s.live--
	}
	ended, stopping = q.ended, s.stopping
	granted := err == nil && !ended && !stopping
	if granted {
		s.hold(q.id, held{lease: q.lease, key: q.key, acc: q.acc, since: time.Now()})
	}
	s.mu.Unlock()
	if !granted {
		q.lease.Release() // unflushed: nothing was written; after a failed Renew, released already
	}
	switch {
	case stopping:
		return
	case granted:
		err = s.answer(tGrant, q.id, stOK, nil, addrs)
	case ended:
		err = s.answer(tGrant, q.id, stDenied, errors.New("cma: lease ended before it was granted"), nil)
	case errors.Is(err, agent.ErrRemoteLost):
		err = s.answer(tGrant, q.id, stLost, err, nil)
	default:
		s.b.stats.Deny()
		err = s.answer(tGrant, q.id, stDenied, err, nil)
	}
	if err != nil {
		s.abort(err)
	}
}

// abort ends the connection from the stager, for err: the reader, woken by
// a read deadline in the past, returns err (aborted), and serve ends the
// connection as for a failure of its own, draining the copier's end if
// leases are held.
func (s *server) abort(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stageErr != nil || s.stopping {
		return
	}
	s.stageErr = err
	s.readBy = time.Unix(1, 0)
	_ = s.c.SetReadDeadline(s.readBy)
}

// aborted returns what ended the connection on the stager's side, if
// anything did.
func (s *server) aborted() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stageErr
}

// stopStager stops the stager, once the reader returned, and waits for
// it: a grant being written gives up, and the requests still queued are
// released unanswered. It returns what ended the connection on the
// stager's side, if anything did.
func (s *server) stopStager() error {
	if s.wake == nil {
		return nil // never ran: set by the reader only
	}
	_ = s.c.CloseWrite()
	s.mu.Lock()
	s.stopping = true
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
	<-s.stopped
	return s.aborted()
}

// answer writes a lease's grant or refusal (typ tGrant), or the outcome of
// a WRITE's copy into the device (tFlushed): on a grant, the addresses to
// copy at if some ranges were staged (addrs); on a failure, why.
func (s *server) answer(typ uint8, id uint64, status uint8, why error, addrs []uint64) error {
	var msg string
	if why != nil {
		msg = why.Error()
		if len(msg) > maxErrMsg {
			msg = msg[:maxErrMsg]
		}
	}
	s.wmu.Lock()
	defer s.wmu.Unlock()
	n := hdrSize + len(addrs)*addrSize + len(msg)
	b := s.out[:0]
	if cap(b) < n {
		b = make([]byte, 0, max(n, hdrSize+maxErrMsg))
	}
	b = b[:hdrSize]
	(&header{typ: typ, status: status, count: uint32(len(addrs)), id: id, length: uint32(len(msg))}).put(b)
	for _, a := range addrs {
		b = binary.LittleEndian.AppendUint64(b, a)
		if s.device {
			b = binary.LittleEndian.AppendUint64(b, 0) // host memory: no share
		}
	}
	b = append(b, msg...)
	if cap(b) <= 64<<10 {
		s.out = b
	}
	return s.writeLocked(b, nil)
}

// write writes one frame, b, with oob attached to its first byte if set
// (a file descriptor, SCM_RIGHTS).
func (s *server) write(b, oob []byte) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	return s.writeLocked(b, oob)
}

// writeLocked is write for a caller that holds s.wmu.
func (s *server) writeLocked(b, oob []byte) error {
	// The write may wait for the peer to read for the timeout, and no
	// longer than leases stay unrenewed.
	writeBy := time.Now().Add(s.b.cfg.timeout)
	for {
		d := writeBy
		s.mu.Lock()
		if !s.renewAt.IsZero() && s.renewAt.Before(d) {
			d = s.renewAt
		}
		s.mu.Unlock()
		_ = s.c.SetWriteDeadline(d)
		var n int
		var err error
		if oob != nil {
			n, _, err = s.c.WriteMsgUnix(b, oob, nil)
			if n > 0 {
				oob = nil // went with the first byte
			}
		} else {
			n, err = s.c.Write(b)
		}
		b = b[n:]
		var ne net.Error
		if err != nil && errors.As(err, &ne) && ne.Timeout() && time.Now().Before(writeBy) {
			if err := s.renewDue(); err != nil {
				return err
			}
			continue // renewal's deadline, not the write's
		}
		if err == nil && len(b) > 0 {
			continue
		}
		return err
	}
}
