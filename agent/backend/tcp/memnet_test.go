package tcp

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
)

// The tests' networks. Most timing tests run inside a testing/synctest
// bubble, in fake time, over memNet, an in-memory network; those where
// the kernel's sockets matter (full socket buffers, a second loopback
// address, half-closed connections) run over loopback.

// network is where a test's agents and fake peers listen and dial. As an
// Option it puts a Backend on it.
type network interface {
	Option
	listen(addr string) (net.Listener, error)
	dial(ctx context.Context, addr string) (net.Conn, error)
}

// loopback is the real network: TCP over the loopback interface.
var loopback network = tcpNet{}

type tcpNet struct{}

func (tcpNet) apply(*config) error { return nil }

func (tcpNet) listen(addr string) (net.Listener, error) { return net.Listen("tcp", addr) }

func (tcpNet) dial(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "tcp", addr)
}

// bubble runs f inside a testing/synctest bubble, with a fresh in-memory
// network: time is fake, and passes only when every goroutine of the
// bubble is blocked, so a test that waits out keepalive timeouts takes
// no longer than its work. Everything f starts must end before it
// returns (its cleanups run inside the bubble).
func bubble(t *testing.T, f func(t *testing.T, nw *memNet)) {
	synctest.Test(t, func(t *testing.T) { f(t, newMemNet()) })
}

// background runs f on a goroutine of its own, which must return once c is
// closed; the test's cleanup closes c and waits for it. A bubble's fake
// clock stops once its test returns: a goroutine still sleeping then
// would never wake.
func background(t testing.TB, c net.Conn, f func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	t.Cleanup(func() {
		_ = c.Close()
		<-done
	})
}

// pinger writes a keepalive on c every gap, until c is closed, in the
// background.
func pinger(t testing.TB, c net.Conn, gap time.Duration) {
	background(t, c, func() {
		var ping [hdrSize]byte
		(&header{typ: tPing}).put(ping[:])
		for {
			if _, err := c.Write(ping[:]); err != nil {
				return
			}
			time.Sleep(gap)
		}
	})
}

// dialBackend connects to b over b's network, closing the connection with
// the test.
func dialBackend(t testing.TB, b *Backend) net.Conn {
	t.Helper()
	var c net.Conn
	var err error
	if b.cfg.testDial != nil {
		c, err = b.cfg.testDial(context.Background(), b.Addr().String())
	} else {
		c, err = net.Dial("tcp", b.Addr().String())
	}
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// memNet is an in-memory network of stream connections that behave, as far
// as the backend can tell, like TCP over loopback: buffered in each
// direction (memBuf bytes unless set otherwise), with read and write
// deadlines, addresses that are *net.TCPAddr, refused dials to addresses
// nobody listens on. Everything blocks on channels and timers, so it runs
// inside a synctest bubble; create it there. Safe for concurrent use.
type memNet struct {
	mu    sync.Mutex
	lns   map[string]*memListener
	ports int
}

// memBuf is what each direction of a memNet connection buffers: about
// what a loopback socket pair holds before its autotuning grows it.
const memBuf = 256 << 10

func newMemNet() *memNet { return &memNet{lns: map[string]*memListener{}, ports: 20000} }

func (n *memNet) apply(c *config) error {
	c.testListen, c.testDial = n.listen, n.dial
	return nil
}

// listen listens on addr, host:port, where port 0 picks a free one.
func (n *memNet) listen(addr string) (net.Listener, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, fmt.Errorf("memnet: listen on %q: %w", addr, err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if ap.Port() == 0 {
		n.ports++
		ap = netip.AddrPortFrom(ap.Addr(), uint16(n.ports))
	}
	if n.lns[ap.String()] != nil {
		return nil, &net.OpError{Op: "listen", Net: "tcp", Err: syscall.EADDRINUSE}
	}
	l := &memListener{n: n, addr: net.TCPAddrFromAddrPort(ap), backlog: make(chan *memConn, 512), done: make(chan struct{})}
	n.lns[ap.String()] = l
	return l, nil
}

// dial connects to addr from 127.0.0.1.
func (n *memNet) dial(ctx context.Context, addr string) (net.Conn, error) {
	return n.dialFrom(ctx, netip.MustParseAddr("127.0.0.1"), addr)
}

// dialFrom connects to addr from the address from.
func (n *memNet) dialFrom(ctx context.Context, from netip.Addr, addr string) (net.Conn, error) {
	n.mu.Lock()
	l := n.lns[addr]
	n.ports++
	local := net.TCPAddrFromAddrPort(netip.AddrPortFrom(from, uint16(n.ports)))
	n.mu.Unlock()
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	if l == nil {
		return nil, refused
	}
	ab, ba := newMemPipe(), newMemPipe()
	pr := &memPair{l: l}
	c := newMemConn(ba, ab, local, l.addr, pr)
	s := newMemConn(ab, ba, l.addr, local, pr)
	select {
	case l.backlog <- s:
		l.open.Add(1)
		l.peak.Store(max(l.peak.Load(), l.open.Load()))
		return c, nil
	case <-l.done:
		return nil, refused
	case <-ctx.Done():
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: ctx.Err()}
	}
}

// memListener is a listener of a memNet. It counts the connections made
// to it that are open, neither end closed yet: exactly, unlike a count
// its server could keep, which lags behind the closes it has yet to read.
type memListener struct {
	n       *memNet
	addr    *net.TCPAddr
	backlog chan *memConn
	done    chan struct{}
	once    sync.Once

	open, peak atomic.Int64
}

func (l *memListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.backlog:
		return c, nil
	case <-l.done:
		return nil, &net.OpError{Op: "accept", Net: "tcp", Addr: l.addr, Err: net.ErrClosed}
	}
}

func (l *memListener) Close() error {
	err := net.ErrClosed
	l.once.Do(func() {
		err = nil
		close(l.done)
		l.n.mu.Lock()
		delete(l.n.lns, l.addr.String())
		l.n.mu.Unlock()
		for {
			select {
			case c := <-l.backlog:
				_ = c.Close()
				continue
			default:
			}
			break
		}
	})
	return err
}

func (l *memListener) Addr() net.Addr { return l.addr }

// memPair is the two ends of one connection.
type memPair struct {
	l    *memListener
	once sync.Once
}

// closed notes that one end closed: the connection no longer counts as open.
func (p *memPair) closed() { p.once.Do(func() { p.l.open.Add(-1) }) }

// memPipe is one direction of a connection: what its writer wrote and its
// reader has not read yet, at most size bytes.
type memPipe struct {
	mu     sync.Mutex
	buf    []byte
	off    int // buf[off:] is unread
	size   int
	eof    bool          // the writer closed: reads drain buf, then io.EOF
	broken bool          // the reader closed: writes fail, but for one
	reset  bool          // a write went to a closed reader: the rest fail
	wake   chan struct{} // closed, and replaced, at every change
}

func newMemPipe() *memPipe { return &memPipe{size: memBuf, wake: make(chan struct{})} }

// changed wakes whoever waits on p. Callers hold p.mu.
func (p *memPipe) changed() {
	close(p.wake)
	p.wake = make(chan struct{})
}

// memDeadline is a connection's read or write deadline: a channel closed
// when it passes, by a timer that synctest's fake clock drives.
type memDeadline struct {
	mu  sync.Mutex
	gen int
	t   *time.Timer
	c   chan struct{}
}

func (d *memDeadline) set(at time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.gen++
	if d.t != nil {
		d.t.Stop()
		d.t = nil
	}
	select {
	case <-d.c: // passed: a new deadline needs a new channel
		d.c = make(chan struct{})
	default:
	}
	if at.IsZero() {
		return
	}
	wait := time.Until(at)
	if wait <= 0 {
		close(d.c)
		return
	}
	gen := d.gen
	d.t = time.AfterFunc(wait, func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		if d.gen == gen { // not set again meanwhile
			close(d.c)
		}
	})
}

// passed returns the channel closed when the deadline passes.
func (d *memDeadline) passed() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.c
}

// memConn is one end of a memNet connection.
type memConn struct {
	rx, tx        *memPipe
	rd, wd        memDeadline
	local, remote *net.TCPAddr
	pair          *memPair
	done          chan struct{}
	once          sync.Once
}

func newMemConn(rx, tx *memPipe, local, remote *net.TCPAddr, pair *memPair) *memConn {
	c := &memConn{rx: rx, tx: tx, local: local, remote: remote, pair: pair, done: make(chan struct{})}
	c.rd.c, c.wd.c = make(chan struct{}), make(chan struct{})
	return c
}

func (c *memConn) opErr(op string, err error) error {
	return &net.OpError{Op: op, Net: "tcp", Source: c.local, Addr: c.remote, Err: err}
}

// Read reads what the peer wrote. Like a socket's, it fails at once once
// its deadline passed, even with bytes waiting.
func (c *memConn) Read(b []byte) (int, error) {
	p := c.rx
	for {
		dl := c.rd.passed()
		select {
		case <-c.done:
			return 0, c.opErr("read", net.ErrClosed)
		case <-dl:
			return 0, c.opErr("read", os.ErrDeadlineExceeded)
		default:
		}
		p.mu.Lock()
		if p.off < len(p.buf) || len(b) == 0 {
			n := copy(b, p.buf[p.off:])
			if p.off += n; p.off == len(p.buf) {
				p.buf, p.off = p.buf[:0], 0
			}
			p.changed()
			p.mu.Unlock()
			return n, nil
		}
		if p.eof {
			p.mu.Unlock()
			return 0, io.EOF
		}
		c.await(p, dl)
	}
}

// Write writes b as the peer's buffer takes it, waiting for room.
func (c *memConn) Write(b []byte) (int, error) {
	p := c.tx
	n := 0
	for {
		dl := c.wd.passed()
		select {
		case <-c.done:
			return n, c.opErr("write", net.ErrClosed)
		case <-dl:
			return n, c.opErr("write", os.ErrDeadlineExceeded)
		default:
		}
		p.mu.Lock()
		switch {
		case p.broken && p.reset:
			p.mu.Unlock()
			return n, c.opErr("write", syscall.EPIPE)
		case p.broken:
			// As TCP's: the first write to a peer that closed goes out,
			// and is answered by a reset, which fails the next.
			p.reset = true
			p.mu.Unlock()
			return len(b), nil
		case p.eof:
			p.mu.Unlock()
			return n, c.opErr("write", net.ErrClosed) // CloseWrite
		case n == len(b):
			p.mu.Unlock()
			return n, nil
		}
		if room := p.size - (len(p.buf) - p.off); room > 0 {
			if p.off > 0 {
				p.buf, p.off = p.buf[:copy(p.buf, p.buf[p.off:])], 0
			}
			k := min(room, len(b)-n)
			p.buf = append(p.buf, b[n:n+k]...)
			n += k
			p.changed()
			p.mu.Unlock()
			continue
		}
		c.await(p, dl)
	}
}

// await unlocks p, which the caller locked, and waits until p changes, the
// deadline dl passes, or c is closed.
func (c *memConn) await(p *memPipe, dl <-chan struct{}) {
	wake := p.wake
	p.mu.Unlock()
	select {
	case <-wake:
	case <-dl:
	case <-c.done:
	}
}

// Close closes both directions: the peer reads what is buffered, then
// io.EOF, and its writes fail from the second on.
func (c *memConn) Close() error {
	err := c.opErr("close", net.ErrClosed)
	c.once.Do(func() {
		err = nil
		close(c.done)
		c.tx.mu.Lock()
		c.tx.eof = true
		c.tx.changed()
		c.tx.mu.Unlock()
		c.rx.mu.Lock()
		c.rx.broken, c.rx.buf, c.rx.off = true, nil, 0
		c.rx.changed()
		c.rx.mu.Unlock()
		c.pair.closed()
	})
	return err
}

// CloseWrite closes the writing direction: the peer reads io.EOF once it
// read what is buffered.
func (c *memConn) CloseWrite() error {
	c.tx.mu.Lock()
	defer c.tx.mu.Unlock()
	c.tx.eof = true
	c.tx.changed()
	return nil
}

// setReadBuffer sets how many bytes the peer may write ahead of this end's
// reads, as SO_RCVBUF does for a socket.
func (c *memConn) setReadBuffer(n int) {
	c.rx.mu.Lock()
	defer c.rx.mu.Unlock()
	c.rx.size = n
	c.rx.changed()
}

func (c *memConn) LocalAddr() net.Addr  { return c.local }
func (c *memConn) RemoteAddr() net.Addr { return c.remote }

func (c *memConn) SetDeadline(t time.Time) error {
	c.rd.set(t)
	c.wd.set(t)
	return nil
}

func (c *memConn) SetReadDeadline(t time.Time) error  { c.rd.set(t); return nil }
func (c *memConn) SetWriteDeadline(t time.Time) error { c.wd.set(t); return nil }
