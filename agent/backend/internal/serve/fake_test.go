package serve

import (
	"net"
	"sync"
	"time"
)

// pipeAddr is a made-up remote address.
type pipeAddr string

func (a pipeAddr) Network() string { return "pipe" }
func (a pipeAddr) String() string  { return string(a) }

// addrConn is one end of a net.Pipe that claims a remote address.
type addrConn struct {
	net.Conn
	remote net.Addr
}

func (c *addrConn) RemoteAddr() net.Addr { return c.remote }

// accepted is what one Accept of a fakeListener returns.
type accepted struct {
	c   net.Conn
	err error
}

// fakeListener is a net.Listener whose Accept takes its results from a
// channel and blocks on channels only: it runs inside a synctest bubble.
type fakeListener struct {
	next   chan accepted
	closed chan struct{}
	once   sync.Once

	mu     sync.Mutex
	calls  []time.Time // when each Accept began
	closes int
	// hook runs in Accept just before it returns a result; tests use it to
	// race a cancellation against an accepted connection.
	hook func()
}

func newFakeListener(buffered int) *fakeListener {
	return &fakeListener{next: make(chan accepted, buffered), closed: make(chan struct{})}
}

func (l *fakeListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	l.calls = append(l.calls, time.Now())
	hook := l.hook
	l.mu.Unlock()
	select {
	case <-l.closed:
		return nil, &net.OpError{Op: "accept", Net: "pipe", Err: net.ErrClosed}
	default:
	}
	select {
	case a := <-l.next:
		if hook != nil {
			hook()
		}
		return a.c, a.err
	case <-l.closed:
		return nil, &net.OpError{Op: "accept", Net: "pipe", Err: net.ErrClosed}
	}
}

func (l *fakeListener) Close() error {
	l.mu.Lock()
	l.closes++
	l.mu.Unlock()
	err := net.ErrClosed
	l.once.Do(func() {
		close(l.closed)
		err = nil
	})
	return err
}

func (l *fakeListener) Addr() net.Addr { return pipeAddr("listener") }

func (l *fakeListener) isClosed() bool {
	select {
	case <-l.closed:
		return true
	default:
		return false
	}
}

func (l *fakeListener) acceptTimes() []time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]time.Time(nil), l.calls...)
}

// dial connects to l from remote: it returns the client's end of a pipe
// whose other end l's Accept hands out.
func (l *fakeListener) dial(remote string) net.Conn {
	client, server := net.Pipe()
	l.next <- accepted{c: &addrConn{Conn: server, remote: pipeAddr(remote)}}
	return client
}

// closeConn is a net.Conn that only records being closed.
type closeConn struct {
	net.Conn // nil: any other method panics
	mu       sync.Mutex
	n        int
}

func (c *closeConn) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n++
	return nil
}

func (c *closeConn) closes() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}
