//go:build ucx

package ucx

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
)

// spinFor is how long the progress thread keeps polling after the last
// progress while a transfer waits for an answer, before it arms the
// worker and parks: answers that come quickly are served without a
// wake-up. Polling holds a P, so with GOMAXPROCS=1 the thread does not.
const spinFor = 100 * time.Microsecond

// leaseDepth is how many leases of one transfer are requested or in flight
// at once: the next is granted while the current one's bytes move.
const leaseDepth = 2

// maxLeases bounds the leases one connection may hold at once.
const maxLeases = 1024

// maxRkeys bounds the unpacked remote keys kept per peer; unused ones are
// dropped beyond it.
const maxRkeys = 8192

// loop is the progress thread's state. Only the progress thread touches it.
type loop struct {
	b    *Backend
	n    *native
	wake int // eventfd that submit writes
	ep   int // epoll instance: wake and the worker's event fd
	// xfers counts the transfers started and not finished.
	xfers int

	seq     uint64
	outs    map[uuid.UUID][]*outPeer // by the peer's agent ID
	outCID  map[cid]*outPeer
	ins     map[cid]*inPeer
	ops     map[uint64]*window // flushes in flight
	closes  map[uint64]endpoint
	epErr   map[uint64]any // endpoint error ids: *outPeer or *inPeer
	dying   []*outPeer     // failed, their endpoints closing
	dyingIn []*inPeer
	seen    map[*mapping]uint16

	closing  bool
	leases   int  // held by peers: transports UCX emulates in software need this side's progress
	pollBusy bool // poll, rather than sleep, while bytes move (see serve); false over tcp (and self) only
	lastTick time.Time
	cmds     []command
	evs      []event
	batch    rmaBatch
	out      []byte
	keys     []grantKey
	idx      []uint16
	mems     [][]byte
}

func (l *loop) next() uint64 { l.seq++; return l.seq }

// run is the progress thread. It creates the context and worker, reports
// the outcome on ready, then serves until Close.
func (l *loop) run(ready chan<- error) {
	lockThread()
	b := l.b
	defer close(b.done)
	n, err := newNative(b.cfg.ucxSettings())
	if err == nil {
		b.self.addr, err = n.address()
		if err != nil {
			n.close()
		}
	}
	if err == nil {
		l.ep, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC)
		if err == nil {
			for _, fd := range []int{l.wake, n.efd} {
				if err == nil {
					err = unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)})
				}
			}
			if err != nil {
				_ = unix.Close(l.ep)
				err = fmt.Errorf("ucx: epoll: %w", err)
			}
		} else {
			err = fmt.Errorf("ucx: epoll: %w", err)
		}
		if err != nil {
			n.close()
		}
	}
	if err != nil {
		ready <- err
		return
	}
	l.n, b.n = n, n
	l.pollBusy = !socketsOnly(b.cfg.effectiveTLS())
	l.outs, l.outCID, l.ins = map[uuid.UUID][]*outPeer{}, map[cid]*outPeer{}, map[cid]*inPeer{}
	l.ops, l.closes, l.epErr = map[uint64]*window{}, map[uint64]endpoint{}, map[uint64]any{}
	l.seen = map[*mapping]uint16{}
	ready <- nil
	l.serve()
	l.shutdown()
	_ = unix.Close(l.ep)
}

// serve runs until a close command has been handled. It steps while
// there is work; polls while operations are in flight or a peer holds a
// lease (see below; over tcp alone only for spinFor after the last
// progress), and for spinFor after the last progress while a transfer
// waits for an answer; and otherwise arms the worker and sleeps in
// epoll_wait on the worker's event fd and the wake-up eventfd. With
// GOMAXPROCS=1 it yields the P between polls, or other goroutines would
// wait for the runtime's sysmon to preempt it (milliseconds).
func (l *loop) serve() {
	var evs [2]unix.EpollEvent
	spin := runtime.GOMAXPROCS(0) > 1
	lastBusy := time.Now()
	for !l.closing {
		busy := l.step()
		now := time.Now()
		if busy {
			lastBusy = now
			continue
		}
		if (len(l.ops) > 0 || l.leases > 0) && (l.pollBusy || now.Sub(lastBusy) < spinFor) {
			// Operations in flight, or a peer moving bytes through a
			// lease: UCX emulates RMA over tcp and shared memory with
			// both sides' progress, and a send it queued for want of
			// room (a full shared-memory FIFO) signals nothing when
			// room appears. Poll; alone on one P, let others run.
			// Over tcp alone every event wakes an armed worker (a
			// socket readable, or writable again): polling there only
			// takes the two sides' and the kernel's CPU from each other
			// (medians of 9 interleaved runs on 2 cores, 64 MiB:
			// 0.67 -> 0.95 GB/s READ, 0.63 -> 0.96 WRITE).
			if !spin {
				runtime.Gosched()
			}
			continue
		}
		if spin && l.xfers > 0 && now.Sub(lastBusy) < spinFor {
			continue // an answer is due
		}
		l.tick(now)
		if !l.n.arm() {
			lastBusy = now // events arrived meanwhile
			continue
		}
		timeout := -1
		if len(l.outCID)+len(l.ins) > 0 {
			timeout = int(l.b.cfg.timeout / 16 / time.Millisecond)
		}
		_, err := unix.EpollWait(l.ep, evs[:], timeout)
		if err != nil && !errors.Is(err, unix.EINTR) {
			time.Sleep(time.Millisecond) // never spin on a broken epoll
		}
		var buf [8]byte
		_, _ = unix.Read(l.wake, buf[:])
		lastBusy = time.Now()
	}
}

// step runs queued commands, progresses the worker and handles its
// events. It reports whether anything happened.
func (l *loop) step() bool {
	l.cmds = l.b.takeCommands(l.cmds[:0])
	for i := range l.cmds {
		l.command(l.cmds[i])
		l.cmds[i] = command{}
	}
	busy := len(l.cmds) > 0
	if l.n.progress() > 0 {
		busy = true
	}
	var lost int
	l.evs, lost = l.n.take(l.evs[:0])
	if lost > 0 {
		// Events were dropped for want of memory: nothing can be trusted.
		for _, p := range l.allOuts() {
			l.failOut(p, fmt.Errorf("ucx: %d native events lost (out of memory): %w", lost, agent.ErrRemoteLost))
		}
	}
	for i := range l.evs {
		l.event(&l.evs[i])
		l.evs[i] = event{}
	}
	if len(l.evs) > 0 {
		busy = true
	}
	if now := time.Now(); now.Sub(l.lastTick) > l.b.cfg.timeout/16 {
		l.tick(now)
	}
	return busy
}

func (l *loop) command(c command) {
	switch {
	case c.close:
		l.closing = true
	case c.post != nil:
		l.startXfer(c.post)
	case c.cancel != nil:
		l.cancel(c.cancel)
	case c.overdue != nil:
		l.overdue(c.overdue)
	case c.run != nil:
		c.run(l)
	case c.depart != nil:
		for _, p := range slices.Clone(l.outs[c.depart.id]) {
			// Not reported: the agent tells its exposures itself.
			l.failOut(p, fmt.Errorf("ucx: peer %s departed: %w", p.id, c.depart.cause))
		}
	case c.notify != nil:
		p, err := l.outFor(c.notify.peer)
		if err != nil {
			return // best effort
		}
		if p.ready {
			l.sendNotify(p, c.notify.key, c.notify.msg)
		} else {
			p.notes = append(p.notes, c.notify)
		}
	}
}

func (l *loop) event(e *event) {
	switch e.kind {
	case evAM:
		if e.rndv {
			l.badMessage()
			return
		}
		m, err := parseMsg(e.msg, l.b.lim)
		if err != nil {
			if errors.Is(err, errLimit) {
				l.b.stats.limit.Add(1)
			} else {
				l.b.stats.protocol.Add(1)
			}
			l.b.host.Refused()
			return
		}
		l.message(&m)
	case evDone:
		if w := l.ops[e.id]; w != nil {
			delete(l.ops, e.id)
			var err error
			if e.status != 0 {
				err = status(e.status)
			}
			l.flushed(w, err)
			return
		}
		if ep, ok := l.closes[e.id]; ok {
			delete(l.closes, e.id)
			freeEP(ep) // the close completed: no callback names ep any more
			l.closed(ep)
		}
	case evEPErr:
		switch p := l.epErr[e.id].(type) {
		case *outPeer:
			l.failOut(p, fmt.Errorf("ucx: endpoint to peer %s failed: %w: %w", p.id, agent.ErrRemoteLost, status(e.status)))
		case *inPeer:
			l.failIn(p, fmt.Errorf("ucx: endpoint to peer %s failed: %w: %w", p.peer, agent.ErrRemoteLost, status(e.status)), true)
		}
	}
}

func (l *loop) message(m *msg) {
	switch m.typ {
	case tHello:
		l.onHello(m)
		return
	case tBye:
		if p := l.outCID[m.dst]; p != nil {
			l.failOut(p, fmt.Errorf("ucx: peer %s is closing: %w", p.id, agent.ErrRemoteLost))
		} else if p := l.ins[m.dst]; p != nil {
			l.failIn(p, fmt.Errorf("ucx: peer %s closed: %w", p.peer, agent.ErrRemoteLost), true)
		}
		return
	}
	if p := l.outCID[m.dst]; p != nil {
		p.lastRecv = time.Now()
		switch m.typ {
		case tWelcome:
			l.onWelcome(p, m)
		case tGrant:
			l.onGrant(p, m)
		case tPong:
		default:
			l.badMessage()
		}
		return
	}
	if p := l.ins[m.dst]; p != nil {
		p.lastRecv = time.Now()
		switch m.typ {
		case tOpen:
			l.onOpen(p, m)
		case tRelease:
			l.onRelease(p, m.lease)
		case tNotify:
			p.used = true
			msg := append([]byte(nil), m.body...)
			l.b.host.Deliver(p.link, m.key, msg)
		case tPing:
			l.send(p.ep, l.frame(tPong, 0, 0, p.remote))
		default:
			l.badMessage()
		}
		return
	}
	l.badMessage() // no such connection: forged, or from a connection since failed
}

// tick runs the timers: handshake and lease deadlines, heartbeats.
func (l *loop) tick(now time.Time) {
	l.lastTick = now
	to := l.b.cfg.timeout
	for _, p := range l.allOuts() {
		switch {
		case !p.ready && now.After(p.deadline):
			l.b.stats.drop(&l.b.stats.timeouts)
			l.failOut(p, fmt.Errorf("ucx: peer %s did not answer the connection request within %v: %w", p.id, to, agent.ErrRemoteLost))
		case p.ready && now.Sub(p.lastRecv) > to:
			l.b.stats.drop(&l.b.stats.timeouts)
			l.failOut(p, fmt.Errorf("ucx: no word from peer %s for %v: %w", p.id, to, agent.ErrRemoteLost))
		case p.ready:
			if p.unanswered(now) {
				l.b.stats.drop(&l.b.stats.timeouts)
				l.failOut(p, fmt.Errorf("ucx: peer %s left a lease request unanswered for %v: %w", p.id, to, agent.ErrRemoteLost))
			}
			if p.ready && now.Sub(p.lastPing) >= to/4 {
				p.lastPing = now
				l.send(p.ep, l.frame(tPing, 0, 0, p.remote))
			}
		}
	}
	for _, p := range l.ins {
		if now.Sub(p.lastRecv) > to {
			l.b.stats.drop(&l.b.stats.timeouts)
			l.failIn(p, fmt.Errorf("ucx: no word from peer %s for %v: %w", p.peer, to, agent.ErrRemoteLost), true)
		}
	}
}

// unanswered reports whether p left a lease request unanswered past its
// deadline, one of a cancelled transfer included. A READ the peer writes
// is granted when written: its heartbeats say it is alive meanwhile.
func (p *outPeer) unanswered(now time.Time) bool {
	for _, w := range p.wins {
		if !w.granted && !w.remotePut && now.After(w.deadline) {
			return true
		}
	}
	for _, a := range p.abandoned {
		if now.After(a.deadline) {
			return true
		}
	}
	return false
}

// badMessage counts a message dropped as malformed or out of place, the
// connection kept, and tells the agent (Host.Refused).
func (l *loop) badMessage() {
	l.b.stats.protocol.Add(1)
	l.b.host.Refused()
}

// logDrop logs, at Debug, a connection dropped or a connection request
// refused; the connections this backend's own Close ends are not worth a
// line.
func (l *loop) logDrop(what string, peer uuid.UUID, err error) {
	if !l.closing {
		l.b.log.Debug(what, "peer", peer, "err", err)
	}
}

// frame starts a message in the loop's reusable buffer.
func (l *loop) frame(typ, st uint8, count uint32, dst cid) []byte {
	l.out = header(l.out[:0], typ, st, count, dst)
	return l.out
}

// send sends a message; a failure shows as the endpoint's error.
func (l *loop) send(ep endpoint, b []byte) error {
	l.out = b[:0]
	return l.n.send(ep, b)
}

// closeEP closes ep; force drops what is queued on it.
func (l *loop) closeEP(ep endpoint, id uint64, force bool) {
	delete(l.epErr, id)
	cid := l.next()
	if l.n.closeEP(ep, force, cid) {
		l.closes[cid] = ep
	} else {
		l.closed(ep)
	}
}

// closed runs once an endpoint is gone: no operation of it is in flight.
func (l *loop) closed(ep endpoint) {
	for _, p := range l.dying {
		if p.ep == ep {
			l.buried(p)
			return
		}
	}
	for _, p := range l.dyingIn {
		if p.ep == ep {
			l.buriedIn(p)
			return
		}
	}
}

// shutdown says goodbye to every peer, fails what is in flight, closes the
// endpoints and destroys the worker and context.
func (l *loop) shutdown() {
	var eps []endpoint
	for _, p := range l.allOuts() {
		if p.ready {
			_ = l.send(p.ep, l.frame(tBye, 0, 0, p.remote))
		}
		eps = append(eps, p.ep)
	}
	for _, p := range l.ins {
		_ = l.send(p.ep, l.frame(tBye, 0, 0, p.remote))
		eps = append(eps, p.ep)
	}
	// Let the goodbyes go out, within bounds: a peer that is gone may
	// never acknowledge them.
	deadline := time.Now().Add(min(l.b.cfg.timeout/4, time.Second))
	var flushes []uint64
	for _, ep := range eps {
		id := l.next()
		flushes = append(flushes, id)
		l.batch.reset()
		_ = l.n.rma(ep, false, &l.batch, id)
		l.ops[id] = &window{flushOnly: true}
	}
	for time.Now().Before(deadline) && l.pending(flushes) {
		l.step()
	}
	for _, id := range flushes {
		delete(l.ops, id)
	}
	err := fmt.Errorf("ucx: backend closing: %w", agent.ErrClosed)
	for _, p := range l.allOuts() {
		l.failOut(p, err)
	}
	for _, p := range l.ins {
		l.failIn(p, err, false)
	}
	deadline = time.Now().Add(l.b.cfg.timeout)
	for time.Now().Before(deadline) && (len(l.closes) > 0 || len(l.dying) > 0 || len(l.dyingIn) > 0) {
		l.step()
	}
	for _, p := range l.dying { // endpoints UCX never finished closing
		l.buried(p)
	}
	for _, p := range l.dyingIn {
		l.buriedIn(p)
	}
	cmds := l.b.takeCommands(nil)
	for _, c := range cmds {
		if c.post != nil {
			c.post.x.Finish(fmt.Errorf("ucx: backend closed: %w", agent.ErrClosed))
		}
	}
	l.b.unmapAll()
	l.n.close()
	for id, ep := range l.closes { // closes the worker's destruction ended
		delete(l.closes, id)
		freeEP(ep)
	}
}

func (l *loop) pending(ids []uint64) bool {
	for _, id := range ids {
		if _, ok := l.ops[id]; ok {
			return true
		}
	}
	return false
}
