package serve

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"time"
)

// The accept loop's backoff after a failed Accept: MinBackoff after the
// first failure in a row, doubling with each further one up to MaxBackoff.
// A successful Accept starts over. These are net/http's Server.Serve's.
const (
	MinBackoff = 5 * time.Millisecond
	MaxBackoff = time.Second
)

// Accept accepts connections on ln and hands each to handle, one at a
// time, on the calling goroutine, until ctx is done, ln is closed, or
// handle returns false. It returns only then, and closes ln before it
// returns: the caller's own ln.Close, if any, then reports net.ErrClosed.
//
// handle owns the connection it is given (it must close it, or hand it to
// something that will) and must not block: the next connection waits for
// it. Once ctx is done no further connection is handed to handle; one
// accepted meanwhile is closed.
//
// An Accept that fails for any reason other than a closed listener is
// retried after a backoff (MinBackoff, doubling to MaxBackoff; reset by the
// next success), with one log line at level Warn on log (slog.Default() if
// nil) for each: EMFILE, ENFILE, ENOBUFS and the like pass once other
// connections close, and a listener that fails for good is logged at most
// once a second instead of going quiet. The backoff ends early when ctx is
// done.
//
// The backoff waits on a time.Timer and ctx, and closing ln on ctx is
// context.AfterFunc's: with a listener that blocks on channels, Accept runs
// inside a testing/synctest bubble.
func Accept(ctx context.Context, ln net.Listener, log *slog.Logger, handle func(net.Conn) bool) {
	if log == nil {
		log = slog.Default()
	}
	watched := make(chan struct{})
	unwatch := context.AfterFunc(ctx, func() {
		defer close(watched)
		_ = ln.Close()
	})
	defer func() {
		if !unwatch() {
			<-watched // the close on ctx ran or runs: it ends before Accept does
		}
		_ = ln.Close()
	}()
	var delay time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || ctx.Err() != nil {
				return
			}
			delay = nextBackoff(delay)
			log.Warn("accept failed; retrying", "addr", ln.Addr(), "err", err, "retry_in", delay)
			t := time.NewTimer(delay)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			continue
		}
		delay = 0
		if ctx.Err() != nil {
			_ = c.Close()
			return
		}
		if !handle(c) {
			return
		}
	}
}

// nextBackoff returns the delay after a failure that follows one delayed
// by d (0 after a success).
func nextBackoff(d time.Duration) time.Duration {
	if d == 0 {
		return MinBackoff
	}
	return min(2*d, MaxBackoff)
}
