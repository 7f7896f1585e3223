package tcp

import (
	"errors"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// minProgress is the fewest bytes a frame in flight must move per keepalive
// timeout. A frame is not held to one deadline as a whole: on a slow but
// live link a 2 MiB chunk may take longer than the timeout to cross, and
// cutting it would declare a working peer lost. Instead a read or write
// that times out is given another timeout whenever at least minProgress
// bytes moved since the last one. A peer trickling bytes slower than that
// (slow-loris) is still cut within one timeout of falling behind, and a
// stalled one within one timeout. At the default 4 s timeout the floor is
// 16 KiB/s per connection. A frame that holds a lease renews it at each
// extension, so revoking the exposure waits for at most one timeout.
const minProgress = 64 << 10

func isTimeout(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }

var (
	// errFenced ends a read or write interrupted because the transfer whose
	// memory it touched was cancelled.
	errFenced = errors.New("tcp: transfer cancelled under the frame")
	// errRevoked ends a frame whose exposure was revoked while it moved.
	errRevoked = errors.New("tcp: exposure revoked under the frame")
)

// fence lets another goroutine stop a connection's reader or writer from
// touching memory it no longer may: raising it sets a deadline in the past,
// which interrupts a blocked read or write at once, and keeps the owner
// from setting a later deadline until it lowers the fence.
type fence struct {
	mu     sync.Mutex
	raised bool
}

func (f *fence) raise(set func(time.Time) error) {
	f.mu.Lock()
	f.raised = true
	_ = set(time.Unix(1, 0))
	f.mu.Unlock()
}

func (f *fence) lower() {
	f.mu.Lock()
	f.raised = false
	f.mu.Unlock()
}

// deadline sets d with set unless the fence is raised, and reports whether
// it is.
func (f *fence) deadline(set func(time.Time) error, d time.Time) (raised bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.raised {
		_ = set(d)
	}
	return f.raised
}

func (f *fence) isRaised() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.raised
}

// patientConn is the reading side of a connection, under its bufio.Reader:
// reads time out only when a whole timeout passes with fewer than
// minProgress bytes read since the connection was last armed or extended.
// It is used by one reading goroutine; fence may be raised by others.
type patientConn struct {
	c       net.Conn
	rx      *atomic.Uint64 // the connection's bytes read, for keepalives
	timeout time.Duration
	moved   int
	fence   fence
	// renew, if set, is asked at each extension whether the frame may go
	// on; false fails the read with errRevoked.
	renew func() bool
	// Latency mode: a read within spin of the end of the last READ or
	// WRITE frame the connection carried (busy) polls the socket until
	// then before it blocks. Notifications and keepalives do not count:
	// a connection carrying only those never polls.
	spin time.Duration
	last time.Time
}

// arm gives the next frame a fresh timeout.
func (p *patientConn) arm() {
	p.moved = 0
	p.fence.deadline(p.c.SetReadDeadline, time.Now().Add(p.timeout))
}

func (p *patientConn) Read(b []byte) (int, error) {
	if p.spin > 0 {
		n, err := p.poll(b)
		if n > 0 || err != nil {
			p.moved += n
			p.rx.Add(uint64(n))
			return n, err
		}
	}
	for {
		n, err := p.c.Read(b)
		p.moved += n
		p.rx.Add(uint64(n))
		if err == nil || !isTimeout(err) {
			return n, err
		}
		if p.fence.isRaised() {
			return n, errFenced
		}
		if p.moved < minProgress {
			return n, err
		}
		if p.renew != nil && !p.renew() {
			return n, errRevoked
		}
		p.arm()
		if n > 0 {
			return n, nil
		}
	}
}

// busy records that a READ or WRITE frame just ended: in latency mode the
// next reads poll.
func (p *patientConn) busy() {
	if p.spin > 0 {
		p.last = time.Now()
	}
}

// poll reads what the socket holds, polling it until spin after the end of
// the last frame (busy): (0, nil) if nothing came by then, or if polling is
// not possible (a deadline passed, a fence is up, an error: the blocking
// read reports them).
func (p *patientConn) poll(b []byte) (int, error) {
	if p.last.IsZero() {
		return 0, nil
	}
	// At most GOMAXPROCS-1 readers poll at once, so that one processor is
	// left to the rest: pollers hold theirs, and a goroutine waiting on the
	// network is woken only by a processor with nothing else to do.
	if spinners.Add(1) > int32(runtime.GOMAXPROCS(0)-1) {
		spinners.Add(-1)
		return 0, nil
	}
	defer spinners.Add(-1)
	// Goroutines this one readied (a transfer's waiter) run first; then it
	// keeps its processor while it polls: yielding it on every poll would
	// keep the others busy taking it up, and none would be left to wait on
	// the network for the goroutines that do not poll. Between polls it
	// yields the core to the threads waiting for it (yieldThread): on a
	// machine with few cores the peer's, which must run to answer.
	runtime.Gosched()
	until := p.last.Add(p.spin)
	for {
		n, err, ok := tryRead(p.c, b)
		if !ok {
			return 0, nil
		}
		if n > 0 || err != nil {
			return n, err
		}
		if !time.Now().Before(until) {
			p.last = time.Time{}
			return 0, nil
		}
		yieldThread()
	}
}

// spinners counts the readers polling (patientConn.poll) in this process.
var spinners atomic.Int32

// errLater ends a write the socket did not take at once (writeSoon).
var errLater = errors.New("tcp: socket full")

// inlineWait is the longest Post waits for the socket to take a small
// transfer's frame, written on the caller's goroutine; a goroutine writes
// the rest.
const inlineWait = time.Millisecond

// writeSoon writes out to w, whose write lock the caller holds, for at most
// inlineWait. It returns errLater, leaving the rest in out, if the socket
// did not take it all by then.
func writeSoon(w *wconn, out *net.Buffers, f *fence) error {
	if f.deadline(w.c.SetWriteDeadline, time.Now().Add(inlineWait)) {
		return errFenced
	}
	n, err := out.WriteTo(w.c)
	w.tx.Add(uint64(n))
	switch {
	case err == nil:
		return nil
	case !isTimeout(err):
		return err
	case f.isRaised():
		return errFenced
	default:
		return errLater
	}
}

// writeFrame writes out to w, whose write lock the caller holds, under the
// same rule: each timeout that passes with at least minProgress bytes
// written grants another, if renew (when set) allows it. The first ends at
// first if set, else a timeout from now. It returns once out is written,
// the peer fell behind, or f (when set) was raised.
func writeFrame(w *wconn, out *net.Buffers, timeout time.Duration, f *fence, renew func() bool, first time.Time) error {
	for {
		d := first
		if d.IsZero() {
			d = time.Now().Add(timeout)
		}
		first = time.Time{}
		if f == nil {
			_ = w.c.SetWriteDeadline(d)
		} else if f.deadline(w.c.SetWriteDeadline, d) {
			return errFenced
		}
		n, err := out.WriteTo(w.c) // consumes what it wrote
		w.tx.Add(uint64(n))
		if err == nil || !isTimeout(err) {
			return err
		}
		if f != nil && f.isRaised() {
			return errFenced
		}
		if n < minProgress {
			return err
		}
		if renew != nil && !renew() {
			return errRevoked
		}
	}
}
