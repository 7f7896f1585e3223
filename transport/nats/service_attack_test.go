package nats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// Attacks on a Service's workers (its handlers run on the goroutines that
// take requests from a synchronous subscription): what a handler, a flood
// of requesters or the server can do to them.

// A handler that ends its goroutine with runtime.Goexit (as t.FailNow and
// friends do) takes no worker with it: its requester is answered with a
// handler error, and the Service serves on with its one worker.
func TestServiceSurvivesAHandlerThatCallsGoexit(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	var log lockedBuffer
	serve(t, dial(t, srv), "goexit", func(_ context.Context, req *ServiceRequest) (*Reply, error) {
		switch string(req.Data) {
		case "exit":
			runtime.Goexit()
		case "panic":
			panic("attack")
		}
		return &Reply{Metadata: md}, nil
	}, WithConcurrency(1), log.logger(slog.LevelWarn))
	nc := dial(t, srv)
	for _, data := range []string{"exit", "panic", "exit"} {
		ctx, cancel := context.WithTimeout(guarded(t), 5*time.Second)
		_, err := Request(ctx, nc, "goexit", []byte(data))
		cancel()
		var he *HandlerError
		require.ErrorAs(t, err, &he, "request %q", data)
		assert.Equal(t, codeHandler, he.Code)
		ctx, cancel = context.WithTimeout(guarded(t), 5*time.Second)
		_, err = Request(ctx, nc, "goexit", []byte("after "+data))
		cancel()
		require.NoError(t, err, "a request after a handler's %q", data)
	}
	assert.Contains(t, log.String(), "Goexit")
	assert.Contains(t, log.String(), "handler panicked")
}

// A flood past the pending limits (a slow consumer) is logged once, not
// once per request taken while it lasts, and the Service serves on.
func TestServiceLogsASustainedSlowConsumerOnce(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	var log lockedBuffer
	var handled atomic.Int32
	quiet := nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})
	serve(t, dial(t, srv, nats.SyncQueueLen(2), quiet), "flooded", func(context.Context, *ServiceRequest) (*Reply, error) {
		handled.Add(1)
		time.Sleep(2 * time.Millisecond)
		return &Reply{Metadata: md}, nil
	}, WithConcurrency(1), log.logger(slog.LevelWarn))
	// Requests whose replies nobody waits for, far faster than the one
	// worker takes them, for half a second.
	flood := dial(t, srv)
	for end := time.Now().Add(500 * time.Millisecond); time.Now().Before(end); {
		for range 20 {
			require.NoError(t, flood.PublishRequest("flooded", "nobody.listens", nil))
		}
		require.NoError(t, flood.Flush())
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(guarded(t), 10*time.Second)
	defer cancel()
	_, err := Request(ctx, dial(t, srv), "flooded", nil, WithRetry(20), WithAttemptTimeout(time.Second))
	require.NoError(t, err, "after the flood")
	lines := strings.Count(log.String(), "requests lost")
	t.Logf("%d requests handled during the flood, %d log lines", handled.Load(), lines)
	assert.GreaterOrEqual(t, lines, 1)
	assert.LessOrEqual(t, lines, 2, "a line per request taken:\n%s", log.String())
}

// permissionServer starts a server where user "w" may not subscribe to
// "forbidden"; other users may do anything.
func permissionServer(t *testing.T) *natsserver.Server {
	return startServer(t, natsserver.WithServerOptions(func(o *server.Options) {
		o.Users = []*server.User{
			{Username: "w", Password: "w", Permissions: &server.Permissions{Subscribe: &server.SubjectPermission{Deny: []string{"forbidden"}}}},
			{Username: "c", Password: "c"},
		}
	}))
}

// A subscription the server refuses (reported by NextMsg with
// nats.PermissionErrOnSubscribe) is logged once, not every 100 ms retry,
// and Close stops the retries at once.
func TestServiceRefusedSubscriptionLogsOnceAndCloses(t *testing.T) {
	srv := permissionServer(t)
	var log lockedBuffer
	nc := dial(t, srv, nats.UserInfo("w", "w"), nats.PermissionErrOnSubscribe(true),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	s, err := Serve(nc, "forbidden", func(context.Context, *ServiceRequest) (*Reply, error) {
		return nil, errors.New("never called")
	}, log.logger(slog.LevelWarn))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return strings.Contains(log.String(), "Permissions Violation") }, hangGuard, time.Millisecond)
	time.Sleep(600 * time.Millisecond)
	lines := strings.Count(log.String(), "requests lost")
	assert.Equal(t, 1, lines, "a line per retry:\n%s", log.String())
	start := time.Now()
	require.NoError(t, s.Close())
	assert.Less(t, time.Since(start), 2*time.Second)
}

// Close while workers run handlers that wait for their ctx and requests
// wait behind them: the handlers see the cancellation, the requests
// pending are answered "unavailable", and Close returns once all is done.
func TestServiceCloseAnswersPendingRequestsUnavailable(t *testing.T) {
	srv := startServer(t)
	var running atomic.Int32
	s, err := Serve(dial(t, srv), "blocked", func(ctx context.Context, _ *ServiceRequest) (*Reply, error) {
		running.Add(1)
		<-ctx.Done()
		return nil, ctx.Err()
	}, WithConcurrency(2), WithLogger(quietLog))
	require.NoError(t, err)
	nc := dial(t, srv)
	const n = 6
	errs := make(chan error, n)
	for range n {
		go func() {
			_, err := Request(guarded(t), nc, "blocked", nil)
			errs <- err
		}()
	}
	require.Eventually(t, func() bool {
		p, _, _ := s.sub.Pending()
		return running.Load() == 2 && p == n-2
	}, hangGuard, time.Millisecond)
	require.NoError(t, s.Close())
	codes := map[string]int{}
	for range n {
		var he *HandlerError
		require.ErrorAs(t, <-errs, &he)
		codes[he.Code]++
	}
	assert.Equal(t, map[string]int{codeHandler: 2, codeUnavailable: n - 2}, codes)
	assert.Equal(t, int32(2), running.Load(), "a handler ran after Close")
}

// Under a flood of concurrent requests no more than WithConcurrency
// handlers run at once, and every request is answered.
func TestServiceBoundHoldsUnderAFlood(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	var running, peak atomic.Int32
	serve(t, dial(t, srv), "crowd", func(context.Context, *ServiceRequest) (*Reply, error) {
		n := running.Add(1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		time.Sleep(time.Millisecond)
		running.Add(-1)
		return &Reply{Metadata: md}, nil
	}, WithConcurrency(3))
	nc := dial(t, srv)
	var wg sync.WaitGroup
	var failed atomic.Int32
	for i := range 200 {
		wg.Go(func() {
			if _, err := Request(guarded(t), nc, "crowd", fmt.Appendf(nil, "%d", i)); err != nil {
				failed.Add(1)
			}
		})
	}
	wg.Wait()
	assert.Zero(t, failed.Load())
	assert.LessOrEqual(t, peak.Load(), int32(3))
	t.Logf("peak %d handlers at once", peak.Load())
}

// A server that refuses the Service's subscription when the connection
// comes back (its permissions changed across a restart), while requests
// taken before are still pending in the subscription: NextMsg reports the
// refusal, not them, so the subscription never drains. Close must still
// return (their requesters time out, as with any lost request).
func TestServiceClosesWhenRefusedWithRequestsPending(t *testing.T) {
	var deny atomic.Bool
	srv := startServer(t, natsserver.WithServerOptions(func(o *server.Options) {
		p := &server.Permissions{}
		if deny.Load() {
			p.Subscribe = &server.SubjectPermission{Deny: []string{"revoked"}}
		}
		o.Users = []*server.User{{Username: "w", Password: "w", Permissions: p}, {Username: "c", Password: "c"}}
	}))
	md := testToken(t)
	refused := make(chan struct{})
	var once sync.Once
	nc := dial(t, srv, append(resilient, nats.UserInfo("w", "w"), nats.PermissionErrOnSubscribe(true),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if errors.Is(err, nats.ErrPermissionViolation) {
				once.Do(func() { close(refused) })
			}
		}))...)
	held := make(chan struct{}, 1)
	release := make(chan struct{})
	s, err := Serve(nc, "revoked", func(context.Context, *ServiceRequest) (*Reply, error) {
		select {
		case held <- struct{}{}:
			<-release
		default:
		}
		return &Reply{Metadata: md}, nil
	}, WithConcurrency(1), WithLogger(quietLog))
	require.NoError(t, err)
	client := dial(t, srv, append(resilient, nats.UserInfo("c", "c"))...)
	for range 4 {
		require.NoError(t, client.PublishRequest("revoked", "nobody.listens", nil))
	}
	require.NoError(t, client.Flush())
	<-held
	require.Eventually(t, func() bool { p, _, _ := s.sub.Pending(); return p == 3 }, hangGuard, time.Millisecond)
	deny.Store(true)
	require.NoError(t, srv.Restart())
	select {
	case <-refused:
	case <-time.After(hangGuard):
		t.Fatal("the server did not refuse the subscription after its restart")
	}
	close(release)
	requireClosesWithin(t, s, 5*time.Second, "with requests pending on a refused subscription")
}

// Close while the connection is down (reconnecting) returns once the
// handlers have, not after a drain that waits for the server: nothing
// pending can be answered before the connection is back.
func TestServiceClosesPromptlyWhileDisconnected(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv, resilient...)
	started := make(chan struct{}, 1)
	s, err := Serve(nc, "offline", func(ctx context.Context, _ *ServiceRequest) (*Reply, error) {
		started <- struct{}{}
		<-ctx.Done()
		return nil, ctx.Err()
	}, WithLogger(quietLog))
	require.NoError(t, err)
	requester := dial(t, srv, resilient...)
	go func() { _, _ = Request(guarded(t), requester, "offline", nil) }()
	<-started
	srv.Shutdown()
	require.Eventually(t, func() bool { return !nc.IsConnected() }, hangGuard, time.Millisecond)
	start := time.Now()
	require.NoError(t, s.Close())
	assert.Less(t, time.Since(start), 2*time.Second, "Close while disconnected")
}

// WithQueue still picks the queue group of a Service's synchronous
// subscription: Services in two groups on one subject both get each
// request, two in one group share them.
func TestServiceWithQueueGroups(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	var a, b, c atomic.Int32
	count := func(n *atomic.Int32) Handler {
		return func(context.Context, *ServiceRequest) (*Reply, error) {
			n.Add(1)
			return &Reply{Metadata: md}, nil
		}
	}
	serve(t, dial(t, srv), "grouped", count(&a), WithQueue("a"))
	serve(t, dial(t, srv), "grouped", count(&b), WithQueue("b"))
	serve(t, dial(t, srv), "grouped", count(&c), WithQueue("b"))
	nc := dial(t, srv)
	const n = 20
	for range n {
		_, err := Request(guarded(t), nc, "grouped", nil)
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return a.Load() == n && b.Load()+c.Load() == n }, hangGuard, time.Millisecond)
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, int32(n), a.Load())
	assert.Equal(t, int32(n), b.Load()+c.Load())
}
