package backendtest

import (
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// ServeConns hands each connection ln accepts to handle, on a goroutine of
// its own, until the test ends: then it closes ln and every connection it
// accepted, and waits for the goroutines. handle need not close its
// connection; one that returns early leaves it open until then.
func ServeConns(t testing.TB, ln net.Listener, handle func(c net.Conn)) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() { handle(c) })
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
}

// Trickle writes b to c one byte every gap until the server drops the
// connection (what it sends, read from r, ends) or b is sent, and returns
// how long the server took to drop it, counted from the first byte. It
// fails t if the server keeps the connection 20 s after that.
func Trickle(t testing.TB, c net.Conn, r io.Reader, b []byte, gap time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	gone := make(chan struct{})
	go func() { // the server's drop shows as the end of what it sends
		defer close(gone)
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
		_, _ = io.Copy(io.Discard, r)
	}()
	for _, x := range b {
		select {
		case <-gone:
			return time.Since(start)
		case <-time.After(gap):
		}
		if _, err := c.Write([]byte{x}); err != nil {
			break
		}
	}
	select {
	case <-gone:
	case <-time.After(20 * time.Second):
		t.Fatal("the server never dropped a slow peer")
	}
	return time.Since(start)
}

// Flood is a flood of connections to a server that never handshake: each
// is dialled and left silent. Its connections are closed when the test
// ends. Safe for concurrent use.
type Flood struct {
	t     testing.TB
	dial  func() (net.Conn, error)
	mu    sync.Mutex
	conns []net.Conn
}

// NewFlood returns a flood of connections that dial makes.
func NewFlood(t testing.TB, dial func() (net.Conn, error)) *Flood {
	f := &Flood{t: t, dial: dial}
	t.Cleanup(func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		for _, c := range f.conns {
			_ = c.Close()
		}
	})
	return f
}

// Open dials n more connections, failing the test if one fails.
func (f *Flood) Open(n int) {
	for range n {
		c, err := f.dial()
		require.NoError(f.t, err)
		f.mu.Lock()
		f.conns = append(f.conns, c)
		f.mu.Unlock()
	}
}

// During runs fn while the flood goes on: one more connection every
// millisecond, until fn returns.
func (f *Flood) During(fn func()) {
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
				f.Open(1)
			}
		}
	})
	fn()
	close(stop)
	wg.Wait()
}

// Len is how many connections the flood dialled.
func (f *Flood) Len() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.conns)
}

// OldestDropped fails t unless the server closed the flood's first
// connection (waiting up to 5 s for its end).
func (f *Flood) OldestDropped(t testing.TB) {
	t.Helper()
	f.mu.Lock()
	c := f.conns[0]
	f.mu.Unlock()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := c.Read(make([]byte, 1))
	var ne net.Error
	require.Error(t, err)
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "the oldest handshake was kept")
}
