//go:build linux

package cma

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
)

// peer is the copying side's state for one remote agent: its control
// connection and the verdict of the permission probe.
type peer struct {
	b   *Backend
	id  uuid.UUID
	raw []byte
	ci  connInfo
	// The key the handshake presents, if the probe was asked for one, and
	// its access: under Yama mode 1 the peer names a ptracer only for a key.
	key agent.Key
	acc agent.Access

	ready   chan struct{} // closed once connect has set verdict and failed
	verdict error         // nil: connected and permitted
	failed  time.Time     // when a failed verdict was reached
	dead    chan struct{} // closed when the connection failed
	c       *net.UnixConn

	// Frames go out through a queue and a writer goroutine, so that no
	// goroutine that must go on reading (the reader, a Post) ever waits for
	// the socket to drain: the exposing side may be blocked writing grants.
	qmu   sync.Mutex
	q     []byte        // frames queued for the writer
	qwake chan struct{} // one token: q may hold frames
	// Notification bytes queued or being written, of which qnew are in q:
	// Notify waits for room under maxQueuedNotify (queueNotify). qroom is
	// closed when the writer sent some.
	qnote, qnew int
	qroom       chan struct{}

	// departed is set, under b.mu, when PeerDeparted names the peer while
	// its probe runs: the connection is failed as soon as it is up.
	departed error

	seq     atomic.Uint64
	mu      sync.Mutex
	waiting map[uint64]*window // lease requests awaiting their answer; nil: abandoned, answer still due
	// holding counts granted windows whose copies may still run. Once the
	// peer failed, the connection is closed only when it drops to zero:
	// the exposing side releases a connection's leases when it closes, so
	// closing it earlier would let a copy touch revoked memory.
	holding int
	// Lease requests sent and not yet ended, at most limit (what the
	// exposing side announced it holds per connection): windows beyond it
	// wait in parked, in order, and are requested as ends make room, so
	// that an honest copier never goes over the exposing side's limit.
	inflight int
	limit    int
	parked   []*window
	err      error
	broken   atomic.Bool // set with err: frames are no longer sent
	failOnce sync.Once
	shutOnce sync.Once
}

// connect dials the peer, checks that the process behind the socket is the
// one its metadata names, and probes permission with a trial
// process_vm_readv of bytes the peer published in its handshake answer. It
// runs on a goroutine of its own, which becomes the connection's reader. A
// failed verdict stands until it expires (peerWith), whatever the failure:
// a peer that is gone or silent would cost every transfer a timeout.
func (p *peer) connect() {
	err := p.dial()
	if err == nil {
		close(p.ready)
		p.read()
		return
	}
	select {
	case <-p.b.quit:
		err = agent.ErrClosed
	default:
	}
	p.verdict, p.failed = err, time.Now()
	if p.c != nil {
		_ = p.c.Close()
	}
	p.failOnce.Do(func() { close(p.dead) }) // fail has nothing to do
	close(p.ready)
	p.b.wg.Done() // no reader
}

// expired reports whether p holds a failed verdict older than retry. The
// caller holds p.b.mu.
func (p *peer) expired(retry time.Duration) bool {
	select {
	case <-p.ready:
		return p.verdict != nil && time.Since(p.failed) >= retry
	default:
		return false // probing
	}
}

// keyMayHelp reports whether p's probe failed for want of a valid key and
// key, which it did not present, might pass.
func (p *peer) keyMayHelp(key agent.Key) bool {
	select {
	case <-p.ready:
		return key != (agent.Key{}) && key != p.key && errors.Is(p.verdict, errNeedKey)
	default:
		return false
	}
}

// errNotPermitted marks a peer this process may not read: the probe failed.
var errNotPermitted = errors.New("cross-memory attach not permitted")

// errNeedKey marks a probe that failed, under Yama mode 1, because the
// handshake presented no key, or one the peer refused: a probe with
// another key may pass.
var errNeedKey = errors.New("the peer names a ptracer only for a key of its exposures")

func (p *peer) dial() error {
	b := p.b
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.timeout)
	defer cancel()
	stopped := make(chan struct{})
	defer close(stopped)
	go func() { // Close must not wait a whole timeout for a probe
		select {
		case <-b.quit:
			cancel()
		case <-stopped:
		}
	}()
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", "@"+p.ci.sock)
	if err != nil {
		return fmt.Errorf("connect to peer %s (pid %d): %w: %w", p.id, p.ci.pid, agent.ErrRemoteLost, err)
	}
	p.c = c.(*net.UnixConn)
	// The handshake's I/O ends with ctx too: at the timeout, or at Close.
	unbound := context.AfterFunc(ctx, func() { _ = p.c.SetDeadline(time.Unix(1, 0)) })
	pid, err := peerCred(p.c)
	if err != nil {
		return fmt.Errorf("credentials of peer %s: %w", p.id, err)
	}
	if pid != int(p.ci.pid) {
		return fmt.Errorf("%w: the socket of peer %s belongs to process %d, its metadata names process %d", errNotPermitted, p.id, pid, p.ci.pid)
	}
	deadline, _ := ctx.Deadline()
	_ = p.c.SetDeadline(deadline)
	var hs [hsSize]byte
	(&handshake{self: b.id, expect: p.id, pid: uint32(b.pid), status: uint8(p.acc), nonce: p.key}).put(hs[:])
	if _, err := p.c.Write(hs[:]); err != nil {
		return fmt.Errorf("handshake with peer %s: %w: %w", p.id, agent.ErrRemoteLost, err)
	}
	if _, err := io.ReadFull(p.c, hs[:]); err != nil {
		return fmt.Errorf("handshake with peer %s: %w: %w", p.id, agent.ErrRemoteLost, err)
	}
	in, err := getHandshake(hs[:])
	if err != nil {
		return fmt.Errorf("handshake with peer %s: %w", p.id, err)
	}
	if in.status != stOK || in.self != p.id || in.pid != p.ci.pid {
		return fmt.Errorf("the socket of peer %s (pid %d) answers as agent %s of pid %d, status %d: %w", p.id, p.ci.pid, in.self, in.pid, in.status, agent.ErrRemoteLost)
	}
	p.limit = int(in.leases)
	if p.limit == 0 {
		p.limit = maxLeases // an agent that predates the field holds that many
	}
	if err := b.probePeer(int(p.ci.pid), in); err != nil {
		return fmt.Errorf("peer %s: %w", p.id, err)
	}
	if !unbound() {
		return fmt.Errorf("peer %s: %w: %w", p.id, agent.ErrRemoteLost, context.Cause(ctx))
	}
	_ = p.c.SetDeadline(time.Time{})
	if !b.track(p.c) {
		return agent.ErrClosed
	}
	return nil
}

// probePeer tries the access every transfer will need: reading the peer's
// memory from this process.
func (b *Backend) probePeer(pid int, in handshake) error {
	var got [16]byte
	l := []unix.Iovec{{Base: &got[0], Len: uint64(len(got))}}
	r := []unix.RemoteIovec{{Base: uintptr(in.probe), Len: len(got)}}
	n, err := b.readv(pid, l, r)
	switch {
	case errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES):
		err = fmt.Errorf("%w: a trial process_vm_readv of process %d failed: %v; %s", errNotPermitted, pid, err, scopeHint(in.scope, in.ptracer))
		if in.scope == 1 && (in.ptracer == ptrNoKey || in.ptracer == ptrRefused) {
			err = fmt.Errorf("%w (%w)", err, errNeedKey)
		}
		return err
	case errors.Is(err, unix.ENOSYS):
		return fmt.Errorf("%w: process_vm_readv is not available (%v)", errNotPermitted, err)
	case err != nil:
		return fmt.Errorf("%w: a trial process_vm_readv of process %d failed: %v", errNotPermitted, pid, err)
	case n != len(got) || got != in.nonce:
		return fmt.Errorf("%w: a trial process_vm_readv of process %d read %d bytes %x, its handshake promised %x", errNotPermitted, pid, n, got[:n], in.nonce)
	}
	return nil
}

func processVMReadv(pid int, l []unix.Iovec, r []unix.RemoteIovec) (int, error) {
	return unix.ProcessVMReadv(pid, l, r, 0)
}

// scopeHint explains a denied probe from the host's Yama mode and the
// peer's ptracer answer, as the peer reported them.
func scopeHint(scope, ptracer uint8) string {
	switch scope {
	case 1:
		switch ptracer {
		case ptrNoKey:
			return "kernel.yama.ptrace_scope is 1 and the peer names as its ptracer only a process that presents a key of one of its exposures; this one presented none"
		case ptrRefused:
			return "kernel.yama.ptrace_scope is 1 and the peer refused the key presented for its ptracer exception (unknown, revoked, or exposed for the other access)"
		case ptrHeld:
			return "kernel.yama.ptrace_scope is 1 and the peer's one ptracer exception is held by another process connected to it"
		case ptrNamed:
			return "kernel.yama.ptrace_scope is 1; the peer named this process its ptracer, yet the kernel refused"
		}
		return "kernel.yama.ptrace_scope is 1 and the peer has not named this process as its ptracer (it runs with cma.WithPtracer(false))"
	case 2:
		return "kernel.yama.ptrace_scope is 2: only processes with CAP_SYS_PTRACE may attach"
	case 3:
		return "kernel.yama.ptrace_scope is 3: attaching is disabled on this host"
	}
	return "the processes run as different users, or the peer is not dumpable, and this process lacks CAP_SYS_PTRACE"
}

// read is the connection's reader goroutine: it hands lease answers to the
// transfers waiting for them. When the connection ends it fails the peer.
// It starts the connection's writer.
func (p *peer) read() {
	b := p.b
	defer b.wg.Done()
	// Close does not close this connection under copies in flight: it
	// fails the peer, which closes it once they returned (shut).
	b.mu.Lock()
	delete(b.conns, p.c)
	closed, departed := b.closed, p.departed
	if !closed {
		if b.live == nil {
			b.live = map[*peer]struct{}{}
		}
		b.live[p] = struct{}{}
	}
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		delete(b.live, p)
		b.mu.Unlock()
	}()
	switch {
	case closed:
		p.fail(agent.ErrClosed)
	case departed != nil:
		// Departed while probed: listed nowhere a transfer or a departure
		// finds it, so nothing would ever close it.
		p.fail(fmt.Errorf("cma: peer %s departed while it was probed: %w", p.id, departed))
	}
	b.wg.Add(1)
	go p.writer()
	err := p.loop()
	select {
	case <-b.stop:
		err = agent.ErrClosed
	default:
		if p.broken.Load() {
			break // failed already; the socket closed after its copies
		}
		if b.stats.dropped(err, false) && errors.Is(err, errProtocol) {
			b.host.Refused()
		}
		err = fmt.Errorf("cma: connection to peer %s: %w: %w", p.id, agent.ErrRemoteLost, err)
	}
	p.fail(err)
}

var errBye = errors.New("peer said goodbye")

func (p *peer) loop() error {
	br := bufio.NewReaderSize(p.c, 4<<10)
	var hdr [hdrSize]byte
	var buf []byte
	var f frame
	for {
		if err := readFrame(br, hdr[:], &buf, p.b.lim, &f); err != nil {
			return err
		}
		switch f.typ {
		case tGrant:
		case tBye:
			return errBye
		default:
			return fmt.Errorf("%w: frame type %d from the exposing side", errProtocol, f.typ)
		}
		var err error
		switch f.status {
		case stOK:
		case stLost:
			err = fmt.Errorf("cma: peer %s is closing: %w (%s)", p.id, agent.ErrRemoteLost, f.payload)
		default:
			err = fmt.Errorf("cma: peer %s refused: %w (%s)", p.id, agent.ErrAccessDenied, f.payload)
		}
		p.mu.Lock()
		w, ok := p.waiting[f.id]
		if !ok {
			failed := p.waiting == nil
			p.mu.Unlock()
			if failed {
				continue // answers to requests the failure gave up on; the socket closes after the copies
			}
			return fmt.Errorf("%w: an answer to lease %d, which awaits none", errProtocol, f.id)
		}
		delete(p.waiting, f.id)
		if w != nil && err == nil {
			w.held = true
			p.holding++
		}
		p.watch()
		p.mu.Unlock()
		if w != nil {
			w.answer(err)
		}
	}
}

// watch bounds how long the reader waits while lease requests are
// unanswered: a peer that hangs is lost after the timeout. The caller holds
// p.mu.
func (p *peer) watch() {
	if len(p.waiting) > 0 {
		_ = p.c.SetReadDeadline(time.Now().Add(p.b.cfg.timeout))
	} else {
		_ = p.c.SetReadDeadline(time.Time{})
	}
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
	w.dispatch(uint64(w.st.b.cfg.chunk))
}

// fail marks the peer failed once: waiting transfers give up, copies not
// yet begun are skipped, nothing more is sent, and a later transfer
// connects afresh. It never waits: the connection closes once the copies
// in flight under its leases returned (shut), not before, since closing it
// is what lets the exposing side release those leases.
// An outgoing channel presents no key to this agent, so its failure is no
// loss for this agent's exposures: only the channels a peer used to reach
// them report that (agent.Link).
func (p *peer) fail(err error) {
	p.failOnce.Do(func() {
		p.mu.Lock()
		p.err = err
		p.broken.Store(true)
		waiting := p.waiting
		p.waiting = nil
		parked := p.parked
		p.parked = nil
		for i, w := range parked {
			if !w.parked {
				parked[i] = nil // given up by its owner
			}
			w.parked = false
		}
		idle := p.holding == 0
		p.mu.Unlock()
		select {
		case <-p.dead: // never connected
			return
		default:
		}
		close(p.dead)
		p.b.forget(p)
		_ = p.c.SetWriteDeadline(time.Unix(1, 0)) // a write in progress gives up
		for _, w := range waiting {
			if w != nil {
				w.answer(err)
			}
		}
		for _, w := range parked {
			if w != nil {
				w.answer(err) // never requested: holds nothing
			}
		}
		if idle {
			p.shut()
		}
	})
}

// shut closes the connection of a failed peer once no copy under its
// leases can run; the exposing side then releases them.
func (p *peer) shut() { p.shutOnce.Do(func() { _ = p.c.Close() }) }

func (p *peer) failure() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return p.err
	}
	return fmt.Errorf("cma: peer %s: %w", p.id, agent.ErrRemoteLost)
}

// send queues one frame for the writer: header, table, payload. It never
// waits for the socket. Frames of a failed peer are dropped: the end of
// the connection says what they would have.
func (p *peer) send(h *header, table func(b []byte) []byte, payload []byte) {
	p.qmu.Lock()
	defer p.qmu.Unlock()
	if p.broken.Load() {
		return
	}
	p.enqueue(h, table, payload)
}

// enqueue appends a frame to the queue and wakes the writer. The caller
// holds p.qmu.
func (p *peer) enqueue(h *header, table func(b []byte) []byte, payload []byte) {
	n := len(p.q)
	p.q = slices.Grow(p.q, hdrSize+len(payload))[:n+hdrSize]
	h.put(p.q[n:])
	if table != nil {
		p.q = table(p.q)
	}
	p.q = append(p.q, payload...)
	if p.qwake == nil {
		p.qwake = make(chan struct{}, 1)
	}
	select {
	case p.qwake <- struct{}{}:
	default:
	}
}

// writer sends the queued frames, in order, until the peer fails. The
// queue holds at most a request and an end per lease request in flight
// (limit), the notifications of finished transfers, and at most
// maxQueuedNotify bytes of Notify's.
func (p *peer) writer() {
	defer p.b.wg.Done()
	p.qmu.Lock()
	if p.qwake == nil {
		p.qwake = make(chan struct{}, 1)
	}
	wake := p.qwake
	p.qmu.Unlock()
	var out []byte
	for {
		select {
		case <-wake:
		case <-p.dead:
			return
		}
		p.qmu.Lock()
		out, p.q = p.q, out[:0]
		notes := p.qnew
		p.qnew = 0
		p.qmu.Unlock()
		if len(out) == 0 {
			continue
		}
		_ = p.c.SetWriteDeadline(time.Now().Add(p.b.cfg.timeout))
		if p.broken.Load() { // after the deadline: fail's wins
			return
		}
		if _, err := p.c.Write(out); err != nil {
			if !p.broken.Load() {
				p.b.stats.dropped(err, false)
			}
			p.fail(fmt.Errorf("cma: write to peer %s: %w: %w", p.id, agent.ErrRemoteLost, err))
			return
		}
		if notes > 0 {
			p.qmu.Lock()
			p.qnote -= notes
			if p.qroom != nil {
				close(p.qroom)
				p.qroom = nil
			}
			p.qmu.Unlock()
		}
		if cap(out) > 1<<20 {
			out = nil // a burst passed; do not keep its buffer
		}
	}
}

// maxQueuedNotify bounds the bytes of notifications Notify queues for one
// peer's connection: a peer that stops reading does not grow this process
// without bound. A transfer's own notification is queued past it (it is
// bounded by the transfers in flight, and the goroutine finishing a
// transfer may be the connection's reader, which must never wait).
const maxQueuedNotify = 4 << 20

// notify queues a transfer's notification, without waiting.
func (p *peer) notify(key agent.Key, msg []byte) error {
	return p.queueNotify(key, msg, false)
}

// queueNotify queues a notification. If wait, it first waits, for at most
// the timeout, until the notifications already queued leave room for it
// under maxQueuedNotify.
func (p *peer) queueNotify(key agent.Key, msg []byte, wait bool) error {
	if len(msg) > p.b.cfg.maxNotify {
		return fmt.Errorf("%w: notification of %d bytes, at most %d", agent.ErrInvalid, len(msg), p.b.cfg.maxNotify)
	}
	var timer *time.Timer
	for {
		p.qmu.Lock()
		if p.broken.Load() {
			p.qmu.Unlock()
			return p.failure()
		}
		if !wait || p.qnote == 0 || p.qnote+len(msg) <= maxQueuedNotify {
			// Queued after the ends of the transfer's leases: the exposing
			// side handles frames in order, so the notification never
			// overtakes them.
			p.enqueue(&header{typ: tNotify, length: uint32(len(msg)), key: key}, nil, msg)
			p.qnote += len(msg)
			p.qnew += len(msg)
			p.qmu.Unlock()
			return nil
		}
		if p.qroom == nil {
			p.qroom = make(chan struct{})
		}
		room, queued := p.qroom, p.qnote
		p.qmu.Unlock()
		if timer == nil {
			timer = time.NewTimer(p.b.cfg.timeout)
			defer timer.Stop()
		}
		select {
		case <-room:
		case <-p.dead:
			return p.failure()
		case <-timer.C:
			return fmt.Errorf("cma: peer %s: %d bytes of notifications still queued after %v, at most %d may be: %w",
				p.id, queued, p.b.cfg.timeout, maxQueuedNotify, agent.ErrRemoteLost)
		}
	}
}

// Notify implements agent.Backend. It waits, for at most WithTimeout, while
// maxQueuedNotify bytes of notifications to the peer are still unsent.
func (b *Backend) Notify(ctx context.Context, info agent.Info, key agent.Key, msg []byte) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("cma: notify peer %s: %w", info.ID, context.Cause(ctx))
	}
	p, err := b.usable(info)
	if err != nil {
		return err
	}
	defer b.xwg.Done()
	return p.queueNotify(key, msg, true)
}

// usable returns the connected peer info names and counts a user of the
// backend in xwg, which the caller releases. The agent chose this backend
// because Reachable found the peer connected; if that connection ended
// since (the peer departed, failed) and no other is up, the transfer fails
// at once rather than wait, without the caller's context, for a new probe.
func (b *Backend) usable(info agent.Info) (*peer, error) {
	raw, _ := info.Conn(Name)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, agent.ErrClosed
	}
	var p *peer
	for _, q := range b.peers[info.ID] {
		if bytes.Equal(q.raw, raw) {
			p = q
			break
		}
	}
	if p == nil {
		return nil, fmt.Errorf("cma: peer %s: %w: its connection ended after cma was chosen", info.ID, agent.ErrRemoteLost)
	}
	select {
	case <-p.ready:
	default:
		return nil, fmt.Errorf("cma: peer %s: %w: its connection ended after cma was chosen, and a new one is being probed", info.ID, agent.ErrRemoteLost)
	}
	if p.verdict != nil {
		return nil, p.verdict
	}
	b.xwg.Add(1)
	return p, nil
}

// window is a span of a transfer covered by one lease: requested, granted,
// copied by the workers, ended.
type window struct {
	st      *xstate
	id      uint64 // set, under st.p.mu, when the request is queued; 0 before
	start   cursor
	n       uint64
	pieces  int
	granted chan error // the lease's answer, unless inline
	inline  bool       // the reader handles the answer: a one-chunk transfer
	held    bool       // granted and not yet ended; under st.p.mu
	parked  bool       // waiting in st.p.parked for room; under st.p.mu
	sent    time.Time  // when the request was queued; under st.p.mu
	tasks   atomic.Int64
}

// xstate tracks one transfer: a part for the driver plus one per window
// that holds a lease slot. The last part finishes the transfer.
type xstate struct {
	agent.Parts
	b     *Backend
	p     *peer
	x     *agent.Work
	write bool
	slots chan struct{} // one per lease requested or held
}

// Post implements agent.Backend. Post starts a driver goroutine that
// requests leases (two ahead) and hands their spans to the copy workers.
func (b *Backend) Post(x *agent.Work) error {
	p, err := b.usable(x.Peer)
	if err != nil {
		return err
	}
	st := &xstate{b: b, p: p, x: x, write: x.Op == agent.OpWrite, slots: make(chan struct{}, b.cfg.leaseDepth)}
	st.Init(x, p.notify, b.xwg.Done)
	if end, n, pieces := agent.Span(x.Segments, cursor{}, uint64(b.cfg.chunk), iovMax); end.Seg == len(x.Segments) {
		// One chunk: request the lease here and copy when it is granted.
		st.slots <- struct{}{}
		w := &window{st: st, n: n, pieces: pieces, inline: true}
		st.Add()
		if err := p.begin(w); err != nil {
			w.done(err) // never requested: no answer will come
		} else {
			b.wg.Add(1) // before xwg.Done: Close waits for it
			go w.guard()
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
	lease, chunk := uint64(b.cfg.lease), uint64(b.cfg.chunk)
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
			end, n, pieces := agent.Span(x.Segments, c, lease, b.cfg.maxRanges)
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
			w.dispatch(chunk)
		case <-x.Cancelled():
			st.Fail(x.CancelErr())
			return
		case <-timer.C:
			if left := w.unanswered(); left > 0 {
				timer.Reset(left) // parked, or sent after the timer started
				goto answer
			}
			err := fmt.Errorf("cma: peer %s left a lease request unanswered for %v: %w", p.id, b.cfg.timeout, agent.ErrRemoteLost)
			p.fail(err)
			st.Fail(err)
			return
		}
	}
}

// begin registers w for its answer and queues its lease request: every
// remote range it covers, so the exposing agent checks them all. If limit
// requests are unended already, w waits in p.parked, in order, until an end
// makes room (done); begin never waits. From then on whoever takes w out of
// p.waiting or p.parked (the reader, fail, or the owner giving it up)
// finishes it. An error means w was not registered: the peer failed, and
// the caller finishes w.
func (p *peer) begin(w *window) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.waiting == nil {
		if p.err != nil {
			return p.err
		}
		return fmt.Errorf("cma: peer %s: %w", p.id, agent.ErrRemoteLost)
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
		segs := st.x.Segments
		c, left := w.start, w.n
		for left > 0 {
			sg := &segs[c.Seg]
			take := min(sg.Local.Len-c.Off, left)
			b = binary.LittleEndian.AppendUint64(b, sg.Remote.Addr+c.Off)
			b = binary.LittleEndian.AppendUint64(b, take)
			left -= take
			if c.Off += take; c.Off == sg.Local.Len {
				c.Seg, c.Off = c.Seg+1, 0
			}
		}
		return b
	}, nil)
}

// unanswered returns how long w's request may still go unanswered before
// the peer is lost: the timeout, less the time since the request was sent.
// A parked window has not been asked for yet.
func (w *window) unanswered() time.Duration {
	p := w.st.p
	p.mu.Lock()
	defer p.mu.Unlock()
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
	if w.parked {
		w.parked = false // unpark skips it
		return true
	}
	if cur, ok := p.waiting[w.id]; ok && cur == w && w.id != 0 {
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

// guard ends an inline window whose transfer is cancelled, or whose lease
// request stays unanswered for the timeout, before the reader takes its
// answer. It only waits: the reader copies the window when granted.
func (w *window) guard() {
	st := w.st
	defer st.b.wg.Done()
	t := time.NewTimer(st.b.cfg.timeout)
	defer t.Stop()
	for {
		select {
		case <-st.x.Done():
		case <-st.x.Cancelled():
			if w.claim() {
				w.done(st.x.CancelErr())
			}
		case <-t.C:
			if left := w.unanswered(); left > 0 {
				t.Reset(left) // parked, or sent after the timer started
				continue
			}
			if w.claim() {
				err := fmt.Errorf("cma: peer %s left a lease request unanswered for %v: %w", st.p.id, st.b.cfg.timeout, agent.ErrRemoteLost)
				st.p.fail(err)
				w.done(err)
			}
		}
		return
	}
}

// done ends w's lease and releases its slot and reference. It is called
// once per window, by whoever took it out of p.waiting or p.parked or never
// put it there. The end is queued before the request's room is given to a
// parked window: the exposing side, which handles frames in order, has
// released the lease before it reads the next request.
func (w *window) done(err error) {
	st := w.st
	p := st.p
	// w.id no longer changes: whoever finishes w took it out under p.mu.
	requested := w.id != 0
	if requested && (err == nil || !errors.Is(err, agent.ErrAccessDenied)) {
		p.send(&header{typ: tEnd, id: w.id}, nil, nil)
	}
	p.mu.Lock()
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
	<-st.slots
	st.Done(err)
}

// dispatch cuts w into chunks of at most chunk bytes and IOV_MAX pieces.
// A span of one chunk is copied on the driver's goroutine.
func (w *window) dispatch(chunk uint64) {
	st := w.st
	segs := st.x.Segments
	end := w.start
	var t task
	w.tasks.Store(1)
	for left := w.n; left > 0; {
		t = task{w: w, start: end}
		end, t.n, t.pieces = agent.Span(segs, end, min(chunk, left), iovMax)
		left -= t.n
		if left == 0 && w.tasks.Load() == 1 {
			break // a single chunk: copy it here
		}
		w.tasks.Add(1)
		select {
		case st.b.tasks <- t:
		case <-st.b.stop:
			w.taskDone(agent.ErrClosed)
		}
		t = task{}
	}
	if t.w != nil {
		st.b.copyTask(t, nil)
	}
	w.taskDone(nil)
}

func (w *window) taskDone(err error) {
	if err != nil {
		w.st.Fail(err)
	}
	if w.tasks.Add(-1) == 0 {
		w.done(nil)
	}
}

// iovMax is the most iovecs one process_vm_readv/writev takes (IOV_MAX).
const iovMax = 1024

// task is one chunk of a window: one system call, unless it is partial.
type task struct {
	w      *window
	start  cursor
	n      uint64
	pieces int
}

// iovecs are a worker's reusable system call arguments.
type iovecs struct {
	local  [iovMax]unix.Iovec
	remote [iovMax]unix.RemoteIovec
}

func (b *Backend) worker() {
	defer b.wg.Done()
	v := new(iovecs)
	for {
		select {
		case t := <-b.tasks:
			b.copyTask(t, v)
		case <-b.stop:
			return
		}
	}
}

var driverIovecs = sync.Pool{New: func() any { return new(iovecs) }}

// copyTask copies one chunk with one system call (more if the kernel copies
// part of it) and reports it done to its window.
func (b *Backend) copyTask(t task, v *iovecs) {
	w := t.w
	st := w.st
	var err error
	select {
	case <-st.x.Cancelled():
		err = st.x.CancelErr()
	case <-st.p.dead: // stop before the next chunk: the connection waits for this one
		err = st.p.failure()
	default:
		if st.Failed() {
			break
		}
		if v == nil {
			v = driverIovecs.Get().(*iovecs)
			defer driverIovecs.Put(v)
		}
		err = st.copyChunk(t, v)
	}
	w.taskDone(err)
}

func (st *xstate) copyChunk(t task, v *iovecs) error {
	segs := st.x.Segments
	l, r := v.local[:t.pieces], v.remote[:t.pieces]
	c, left := t.start, t.n
	for i := range t.pieces {
		sg := &segs[c.Seg]
		take := min(sg.Local.Len-c.Off, left)
		l[i] = unix.Iovec{Base: &sg.Local.Mem[c.Off]}
		l[i].SetLen(int(take))
		r[i] = unix.RemoteIovec{Base: uintptr(sg.Remote.Addr + c.Off), Len: int(take)}
		left -= take
		if c.Off += take; c.Off == sg.Local.Len {
			c.Seg, c.Off = c.Seg+1, 0
		}
	}
	err := vmCopy(int(st.p.ci.pid), st.write, l, r, t.n)
	clear(l) // hold no reference to local memory between chunks
	if err != nil {
		return st.copyError(err)
	}
	return nil
}

// vmCopy moves total bytes between the local and remote iovecs, resuming
// after partial copies.
func vmCopy(pid int, write bool, l []unix.Iovec, r []unix.RemoteIovec, total uint64) error {
	for total > 0 {
		var n int
		var err error
		if write {
			n, err = unix.ProcessVMWritev(pid, l, r, 0)
		} else {
			n, err = unix.ProcessVMReadv(pid, l, r, 0)
		}
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n <= 0 {
			return fmt.Errorf("copied 0 of %d bytes", total)
		}
		total -= uint64(n)
		if total > 0 {
			l, r = skipLocal(l, n), skipRemote(r, n)
		}
	}
	return nil
}

func skipLocal(l []unix.Iovec, n int) []unix.Iovec {
	for n > 0 && len(l) > 0 {
		if int(l[0].Len) > n {
			l[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(l[0].Base), n))
			l[0].Len -= uint64(n)
			return l
		}
		n -= int(l[0].Len)
		l = l[1:]
	}
	return l
}

func skipRemote(r []unix.RemoteIovec, n int) []unix.RemoteIovec {
	for n > 0 && len(r) > 0 {
		if r[0].Len > n {
			r[0].Base += uintptr(n)
			r[0].Len -= n
			return r
		}
		n -= r[0].Len
		r = r[1:]
	}
	return r
}

// copyError classifies a failed copy: a vanished process or address space
// is a lost peer; a refused one means permission was withdrawn after the
// probe, and the peer's verdict is dropped so the next transfer probes (and
// may fall back) afresh.
func (st *xstate) copyError(err error) error {
	p := st.p
	var errno syscall.Errno
	errors.As(err, &errno)
	switch errno {
	case unix.ESRCH, unix.EFAULT, unix.ENOMEM:
		return fmt.Errorf("cma: %v of process %d: %w: %w", st.x.Op, p.ci.pid, agent.ErrRemoteLost, err)
	case unix.EPERM, unix.EACCES:
		perr := fmt.Errorf("cma: %v of process %d: %w: permission withdrawn after the probe: %w", st.x.Op, p.ci.pid, agent.ErrAccessDenied, err)
		p.fail(perr)
		return perr
	}
	return fmt.Errorf("cma: %v of process %d: %w", st.x.Op, p.ci.pid, err)
}
