package backendtest

import (
	"errors"
	"io"
	"net"
	"sync"
	"time"
)

// DialFlood dials with dial from workers goroutines as fast as it can
// until the returned stop is called; stop waits for them and returns every
// connection that was made. A dial that fails is retried.
func DialFlood(workers int, dial func() (net.Conn, error)) (stop func() []net.Conn) {
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				c, err := dial()
				if err != nil {
					continue
				}
				mu.Lock()
				conns = append(conns, c)
				mu.Unlock()
			}
		})
	}
	return func() []net.Conn {
		close(done)
		wg.Wait()
		return conns
	}
}

// LeftOpen reads each of conns until the far end closes it or within
// passes, closes it, and returns how many were still open: connections
// a closed server left behind, served by nobody.
func LeftOpen(conns []net.Conn, within time.Duration) int {
	var wg sync.WaitGroup
	var mu sync.Mutex
	left := 0
	for _, c := range conns {
		wg.Go(func() {
			defer c.Close()
			_ = c.SetReadDeadline(time.Now().Add(within))
			_, err := io.Copy(io.Discard, c)
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				mu.Lock()
				left++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return left
}
