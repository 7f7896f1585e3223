package serve

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// logRecorder is a slog.Handler that keeps what is logged.
type logRecorder struct {
	mu      sync.Mutex
	records []slog.Record
}

func (h *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (h *logRecorder) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.records = append(h.records, r.Clone())
	return nil
}
func (h *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *logRecorder) WithGroup(string) slog.Handler      { return h }

func (h *logRecorder) all() []slog.Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]slog.Record(nil), h.records...)
}

func attrs(r slog.Record) map[string]slog.Value {
	m := map[string]slog.Value{}
	r.Attrs(func(a slog.Attr) bool {
		m[a.Key] = a.Value
		return true
	})
	return m
}

// run starts Accept on a goroutine and returns a channel closed when it
// returns.
func run(ctx context.Context, ln net.Listener, log *slog.Logger, handle func(net.Conn) bool) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		Accept(ctx, ln, log, handle)
	}()
	return done
}

func returned(done <-chan struct{}) bool {
	select {
	case <-done:
		return true
	default:
		return false
	}
}

func TestNextBackoff(t *testing.T) {
	var got []time.Duration
	for d := time.Duration(0); len(got) < 11; {
		d = nextBackoff(d)
		got = append(got, d)
	}
	ms := time.Millisecond
	assert.Equal(t, []time.Duration{5 * ms, 10 * ms, 20 * ms, 40 * ms, 80 * ms, 160 * ms, 320 * ms, 640 * ms, time.Second, time.Second, time.Second}, got)
}

// Failed Accepts are retried after 5 ms, doubling to 1 s, each logged once;
// a success starts the backoff over.
func TestAcceptBacksOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ln := newFakeListener(64)
		emfile := &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", syscall.EMFILE)}
		for range 10 {
			ln.next <- accepted{err: emfile}
		}
		c := &closeConn{}
		ln.next <- accepted{c: c}
		ln.next <- accepted{err: errors.New("something else")}
		ln.next <- accepted{err: errors.New("and again")}

		rec := &logRecorder{}
		ctx, cancel := context.WithCancel(t.Context())
		var handled []net.Conn
		done := run(ctx, ln, slog.New(rec), func(c net.Conn) bool {
			handled = append(handled, c)
			return true
		})
		time.Sleep(time.Minute) // every scripted result taken, Accept blocked on the next
		require.False(t, returned(done))

		calls := ln.acceptTimes()
		require.Len(t, calls, 14)
		var gaps []time.Duration
		for i := 1; i < len(calls); i++ {
			gaps = append(gaps, calls[i].Sub(calls[i-1]))
		}
		ms := time.Millisecond
		assert.Equal(t, []time.Duration{
			5 * ms, 10 * ms, 20 * ms, 40 * ms, 80 * ms, 160 * ms, 320 * ms, 640 * ms, time.Second, time.Second, // ten failures
			0,      // the success: the next Accept at once
			5 * ms, // the backoff started over
			10 * ms,
		}, gaps)
		assert.Equal(t, []net.Conn{c}, handled)

		logs := rec.all()
		require.Len(t, logs, 12, "one line per backoff")
		for i, r := range logs {
			assert.Equal(t, slog.LevelWarn, r.Level)
			a := attrs(r)
			assert.Contains(t, a, "err")
			assert.Contains(t, a, "addr")
			want := gaps[i]
			if i >= 10 {
				want = gaps[i+1]
			}
			assert.Equal(t, want, a["retry_in"].Duration(), "line %d", i)
		}
		assert.ErrorIs(t, attrs(logs[0])["err"].Any().(error), syscall.EMFILE)

		cancel()
		synctest.Wait()
		assert.True(t, returned(done))
		assert.True(t, ln.isClosed())
	})
}

// Accept ends at once when its context is done: blocked in Accept, or in a
// backoff.
func TestAcceptEndsOnCancel(t *testing.T) {
	t.Run("accepting", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			ln := newFakeListener(0)
			ctx, cancel := context.WithCancel(t.Context())
			done := run(ctx, ln, slog.New(&logRecorder{}), func(net.Conn) bool { t.Error("handled"); return true })
			synctest.Wait()
			require.False(t, returned(done))
			cancel()
			synctest.Wait()
			assert.True(t, returned(done))
			assert.True(t, ln.isClosed(), "the listener is closed")
		})
	})
	t.Run("backing off", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			ln := newFakeListener(16)
			for range 12 {
				ln.next <- accepted{err: errors.New("no")}
			}
			ctx, cancel := context.WithCancel(t.Context())
			rec := &logRecorder{}
			done := run(ctx, ln, slog.New(rec), func(net.Conn) bool { return true })
			time.Sleep(2500 * time.Millisecond) // into the 1 s backoffs
			require.False(t, returned(done))
			n := len(ln.acceptTimes())
			start := time.Now()
			cancel()
			synctest.Wait()
			assert.True(t, returned(done))
			assert.Zero(t, time.Since(start), "the backoff ended with the context")
			assert.Equal(t, n, len(ln.acceptTimes()), "no Accept after the cancellation")
			assert.Len(t, rec.all(), n)
		})
	})
	t.Run("context done already", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			ln := newFakeListener(1)
			c := &closeConn{}
			ln.next <- accepted{c: c}
			ctx, cancel := context.WithCancel(t.Context())
			cancel()
			Accept(ctx, ln, slog.New(&logRecorder{}), func(net.Conn) bool { t.Error("handled"); return true })
			assert.True(t, ln.isClosed())
		})
	})
}

// A connection accepted as the context ends is closed, not handed over.
func TestAcceptClosesConnAfterCancel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ln := newFakeListener(1)
		ctx, cancel := context.WithCancel(t.Context())
		ln.hook = cancel
		c := &closeConn{}
		ln.next <- accepted{c: c}
		Accept(ctx, ln, slog.New(&logRecorder{}), func(net.Conn) bool { t.Error("handled after the cancellation"); return true })
		assert.Equal(t, 1, c.closes())
		assert.True(t, ln.isClosed())
	})
}

// Accept ends quietly when its listener is closed under it, as a backend's
// Close does.
func TestAcceptEndsOnListenerClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ln := newFakeListener(0)
		rec := &logRecorder{}
		done := run(t.Context(), ln, slog.New(rec), func(net.Conn) bool { return true })
		synctest.Wait()
		require.NoError(t, ln.Close())
		synctest.Wait()
		assert.True(t, returned(done))
		assert.Empty(t, rec.all(), "a closed listener is no failure")
		assert.ErrorIs(t, ln.Close(), net.ErrClosed, "closed once, by its owner")
	})
}

// handle ends the loop by returning false; the listener is closed.
func TestAcceptEndsWhenHandleSaysSo(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ln := newFakeListener(3)
		a, b, c := &closeConn{}, &closeConn{}, &closeConn{}
		for _, x := range []net.Conn{a, b, c} {
			ln.next <- accepted{c: x}
		}
		var handled []net.Conn
		Accept(t.Context(), ln, nil, func(c net.Conn) bool {
			handled = append(handled, c)
			return len(handled) < 2
		})
		assert.Equal(t, []net.Conn{a, b}, handled)
		assert.True(t, ln.isClosed())
		assert.Zero(t, c.closes(), "what Accept did not accept is not its to close")
	})
}

// Accept works on real listeners of both kinds the backends use.
func TestAcceptRealListeners(t *testing.T) {
	for _, tc := range []struct {
		network string
		addr    func(t *testing.T) string
	}{
		{"tcp", func(*testing.T) string { return "127.0.0.1:0" }},
		{"unix", func(t *testing.T) string {
			dir, err := os.MkdirTemp("", "serve")
			require.NoError(t, err)
			t.Cleanup(func() { _ = os.RemoveAll(dir) })
			return filepath.Join(dir, "s")
		}},
	} {
		t.Run(tc.network, func(t *testing.T) {
			ln, err := net.Listen(tc.network, tc.addr(t))
			if err != nil {
				t.Skipf("no %s listener here: %v", tc.network, err)
			}
			ctx, cancel := context.WithCancel(t.Context())
			got := make(chan net.Conn, 3)
			done := run(ctx, ln, slog.New(&logRecorder{}), func(c net.Conn) bool {
				got <- c
				return true
			})
			for range 3 {
				c, err := net.Dial(tc.network, ln.Addr().String())
				require.NoError(t, err)
				_, err = c.Write([]byte{42})
				require.NoError(t, err)
				s := <-got
				var b [1]byte
				_, err = s.Read(b[:])
				require.NoError(t, err)
				assert.Equal(t, byte(42), b[0])
				_ = s.Close()
				_ = c.Close()
			}
			cancel()
			<-done
			_, err = ln.Accept()
			assert.ErrorIs(t, err, net.ErrClosed)
		})
	}
}
