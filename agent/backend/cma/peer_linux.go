//go:build linux

package cma

import (
	"bufio"
	"context"
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
	// staged: the peer stages its device memory for us, naming where to
	// copy in its grants (capStaged); set before ready is closed.
	staged bool
	// device: the peer shares its device memory with us (capDevice): its
	// grants name shares, which its tShare frames carry. Set before ready
	// is closed, with lim (the frame limits, whose grant entries then
	// have two words).
	device bool
	lim    limits
	// shm: the peer publishes its exposures of shared host memory
	// (capShm); sh is the connection's mappings of its lease table and
	// segments.
	shm bool
	sh  shmPeer

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
	// Notification bytes (headers included) queued or being written by the
	// writer, of which qnew are in q: Notify waits for room under
	// maxQueuedNotify (queueNotify). qroom is closed when the writer sent
	// some.
	qnote, qnew int
	qroom       chan struct{}
	// writing: the writer, or a goroutine sending a notification straight
	// to an idle socket (sendNow), is writing; the other waits. Under qmu.
	writing bool
	// qidle, when not nil, is closed once qnote is back to zero (flush
	// waits for it). Under qmu.
	qidle chan struct{}

	// departed is set, under b.mu, when PeerDeparted names the peer while
	// its probe runs: the connection is failed as soon as it is up.
	departed error

	seq atomic.Uint64
	mu  sync.Mutex
	// waiting holds the lease requests awaiting their answer (nil:
	// abandoned, answer still due) and the staged WRITEs awaiting tFlushed.
	waiting map[uint64]*window
	// shares are the peer's device allocations mapped for this
	// connection, by share ID (capDevice); dropped when it fails.
	shares map[uint64]*shareRef
	// mapWarned: a share that could not be mapped was logged.
	mapWarned bool
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
	if p.b.ctx.Err() != nil {
		err = agent.ErrClosed
	}
	p.verdict, p.failed = err, time.Now()
	if p.c != nil {
		_ = p.c.Close()
	}
	p.failOnce.Do(func() { close(p.dead) }) // fail has nothing to do
	close(p.ready)
	p.b.wg.Done() // no reader
}

func (p *peer) dial() error {
	b := p.b
	// Within the backend's lifetime: Close must not wait a whole timeout
	// for a probe.
	ctx, cancel := context.WithTimeout(b.ctx, b.cfg.timeout)
	defer cancel()
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
	caps := uint16(capStaged) | b.device().caps
	if b.cfg.shm {
		caps |= capShm
	}
	(&handshake{self: b.id, expect: p.id, pid: uint32(b.pid), status: uint8(p.acc), nonce: p.key, caps: caps}).put(hs[:])
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
	p.staged = in.caps&capStaged != 0
	p.lim = b.lim
	if in.caps&capDevice != 0 {
		if in.caps&(capDevice|capSim) != caps&(capDevice|capSim) {
			return fmt.Errorf("%w: peer %s answers device caps %#x to a hello of %#x", errProtocol, p.id, in.caps, caps)
		}
		p.device, p.lim.entry = true, devEntrySize
	}
	if in.caps&capShm != 0 {
		if caps&capShm == 0 {
			return fmt.Errorf("%w: peer %s answers shared memory to a hello without it", errProtocol, p.id)
		}
		p.shm, p.lim.shm = true, true
	}
	if err := b.probePeer(int(p.ci.pid), in); err != nil {
		return fmt.Errorf("peer %s: %w", p.id, err)
	}
	if !unbound() {
		return fmt.Errorf("peer %s: %w: %w", p.id, agent.ErrRemoteLost, context.Cause(ctx))
	}
	_ = p.c.SetDeadline(time.Time{})
	if !b.conns.Add(p.c) { // until the reader starts: Close closes it
		return agent.ErrClosed
	}
	return nil
}

// read is the connection's reader goroutine: it hands lease answers to the
// transfers waiting for them. When the connection ends it fails the peer.
// It starts the connection's writer.
func (p *peer) read() {
	b := p.b
	defer b.wg.Done()
	// Close does not close this connection under copies in flight: it
	// fails the peer, which closes it once they returned (shut).
	b.conns.Remove(p.c)
	b.mu.Lock()
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
	switch {
	case b.ctx.Err() != nil:
		err = agent.ErrClosed
	case p.broken.Load():
		// failed already; the socket closed after its copies
	default:
		if b.dropped(err, false, "peer", p.id) && errors.Is(err, errProtocol) {
			b.host.Refused()
		}
		err = fmt.Errorf("cma: connection to peer %s: %w: %w", p.id, agent.ErrRemoteLost, err)
	}
	p.fail(err)
}

var errBye = errors.New("peer said goodbye")

func (p *peer) loop() error {
	rr := &rightsReader{c: p.c}
	defer rr.close()
	defer p.dropShares()
	br := bufio.NewReaderSize(rr, 4<<10)
	var hdr [hdrSize]byte
	var buf []byte
	var f frame
	for {
		if err := readFrame(br, hdr[:], &buf, p.lim, &f); err != nil {
			return err
		}
		switch f.typ {
		case tGrant:
		case tShare:
			if err := p.share(&f, rr); err != nil {
				return err
			}
			continue
		case tUnshare:
			if err := p.unshare(f.id); err != nil {
				return err
			}
			continue
		case tFlushed:
			if err := p.flushAnswer(&f); err != nil {
				return err
			}
			continue
		case tTable:
			if err := p.table(&f, rr); err != nil {
				return err
			}
			continue
		case tSeg:
			if err := p.segment(&f, rr); err != nil {
				return err
			}
			continue
		case tSegDrop:
			if err := p.segDrop(f.id); err != nil {
				return err
			}
			continue

		case tBye:
			return errBye
		default:
			return fmt.Errorf("%w: frame type %d from the exposing side", errProtocol, f.typ)
		}
		var err error
		switch f.status {
		case stOK:
		case stLost:
			err = fmt.Errorf("cma: peer %s is closing: %w (%q)", p.id, agent.ErrRemoteLost, f.payload)
		default:
			err = fmt.Errorf("cma: peer %s refused: %w (%q)", p.id, agent.ErrAccessDenied, f.payload)
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
		if w != nil && w.flushing {
			p.mu.Unlock()
			return fmt.Errorf("%w: a second answer to lease %d", errProtocol, f.id)
		}
		if w != nil && err == nil && p.device {
			// Where to copy: host addresses and mapped shares, checked
			// against the request and the shares before the window may
			// copy.
			failed, perr := p.place(w, &f)
			if perr != nil {
				p.mu.Unlock()
				return perr // fail answers w with the failure
			}
			err = failed // granted, not held: w ends the lease at once
		} else if w != nil && err == nil {
			// Where to copy, for ranges the peer staged: checked against
			// the request before the window may copy.
			addrs, serr := stagedAddrs(&f, w.pieces, w.lens())
			if serr != nil {
				p.mu.Unlock()
				return serr // fail answers w with the failure
			}
			w.addrs, w.staged = addrs, addrs != nil
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

// flushAnswer hands the peer's word on a staged WRITE's copy into its
// device (f, a tFlushed) to the window awaiting it.
func (p *peer) flushAnswer(f *frame) error {
	p.mu.Lock()
	w, ok := p.waiting[f.id]
	if !ok || w == nil || !w.flushing {
		failed := p.waiting == nil
		p.mu.Unlock()
		if failed {
			return nil // the failure finished the window
		}
		return fmt.Errorf("%w: a flush answer for lease %d, which awaits none", errProtocol, f.id)
	}
	delete(p.waiting, f.id)
	p.watch()
	p.mu.Unlock()
	var err error
	if f.status != stOK {
		err = fmt.Errorf("cma: peer %s could not copy the WRITE into its GPU memory: %w (%q)", p.id, agent.ErrStaging, f.payload)
	}
	w.flushed(err)
	return nil
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
			switch {
			case w == nil:
			case w.flushing:
				w.flushed(err) // the bytes may not be in the device
			default:
				w.answer(err)
			}
		}
		for _, w := range parked {
			if w != nil {
				w.answer(err) // never requested: holds nothing
			}
		}
		p.shmFail(err)
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
	return p.failureLocked()
}

// failureLocked is failure for a caller that holds p.mu.
func (p *peer) failureLocked() error {
	if p.err != nil {
		return p.err
	}
	return fmt.Errorf("cma: peer %s: %w", p.id, agent.ErrRemoteLost)
}
