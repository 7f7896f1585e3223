package nats

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/pattern"
)

// kvWorker is a prefill worker: each request names a seed; it exposes a
// block filled with that seed's pattern and answers with the token, then
// closes the operation once the reader is done.
type kvWorker struct {
	c    *connect.Connector
	size int
	wg   sync.WaitGroup
	errs chan error
}

func newKVWorker(t *testing.T, size int) *kvWorker {
	w := &kvWorker{c: newConnector(t), size: size, errs: make(chan error, 64)}
	t.Cleanup(func() {
		w.wg.Wait()
		close(w.errs)
		for err := range w.errs {
			t.Errorf("worker: %v", err)
		}
	})
	return w
}

func (w *kvWorker) handle(ctx context.Context, req *ServiceRequest) (*Reply, error) {
	var seed uint64
	if _, err := fmt.Sscan(string(req.Data), &seed); err != nil {
		return nil, &HandlerError{Code: "bad-request", Message: fmt.Sprintf("want a seed, found %q", req.Data)}
	}
	block := make([]byte, w.size)
	pattern.Fill(block, seed, 0, 0)
	op, err := w.c.CreateReadable(ctx, connect.NewDescriptor(block))
	if err != nil {
		return nil, err
	}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
		defer cancel()
		if err := op.Wait(ctx); err != nil {
			w.errs <- err
		}
		if err := op.Close(); err != nil {
			w.errs <- err
		}
	}()
	return &Reply{Metadata: op.Metadata(), Data: []byte("seed " + string(req.Data)), Header: nats.Header{"Worker": []string{"w1"}}}, nil
}

func TestRequestCarriesATokenEndToEnd(t *testing.T) {
	ctx := guarded(t)
	srv := startServer(t)
	worker := newKVWorker(t, 1<<20+3)
	serve(t, dial(t, srv), "prefill.kv", worker.handle)
	nc := dial(t, srv)
	decode := newConnector(t)

	for i := range 3 {
		seed := pattern.NextSeed()
		rep, err := Request(ctx, nc, "prefill.kv", fmt.Append(nil, seed), WithHeader(nats.Header{"Trace": []string{fmt.Sprint(i)}}))
		require.NoError(t, err)
		assert.Equal(t, "seed "+fmt.Sprint(seed), string(rep.Data))
		assert.Equal(t, "w1", rep.Header.Get("Worker"))
		for k := range rep.Header {
			assert.False(t, strings.HasPrefix(k, "Goxfer-"), "reply header %q", k)
		}
		require.Equal(t, connect.KindRead, rep.Metadata.Kind())
		require.Equal(t, []int{worker.size}, rep.Metadata.Sizes())
		readPattern(t, ctx, decode, rep.Metadata, seed)
	}
}

func TestRequestSeesTheRequestersHeadersAndDeadline(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	srv := startServer(t)
	md := testToken(t)
	got := make(chan *ServiceRequest, 1)
	deadlines := make(chan time.Time, 1)
	serve(t, dial(t, srv), "echo", func(ctx context.Context, req *ServiceRequest) (*Reply, error) {
		d, _ := ctx.Deadline()
		deadlines <- d
		got <- req
		return &Reply{Metadata: md}, nil
	})
	_, err := Request(ctx, dial(t, srv), "echo", []byte("hi"), WithHeader(nats.Header{"App": {"1"}, "Goxfer-Error": {"forged"}}))
	require.NoError(t, err)
	req := <-got
	assert.Equal(t, "echo", req.Subject)
	assert.Equal(t, "hi", string(req.Data))
	assert.Equal(t, nats.Header{"App": {"1"}}, req.Header)
	want, _ := ctx.Deadline()
	assert.WithinDuration(t, want, <-deadlines, time.Millisecond)
}

// A Handler's ctx carries the requester's deadline when the request has
// one (a goxfer Request) and none otherwise (a plain NATS request), and
// ends, cancelled, once the Handler returned; the Service's Close ends a
// running one.
func TestHandlerContextLife(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	worker, nc := dial(t, srv), dial(t, srv)
	kept := make(chan context.Context, 1)
	serve(t, worker, "ctx", func(ctx context.Context, _ *ServiceRequest) (*Reply, error) {
		assert.NoError(t, ctx.Err(), "the handler's ctx ended before it returned")
		kept <- ctx
		return &Reply{Metadata: md}, nil
	})
	for _, tc := range []struct {
		name     string
		request  func() error
		deadline bool
	}{
		{"goxfer request", func() error {
			_, err := Request(guarded(t), nc, "ctx", nil)
			return err
		}, true},
		{"plain NATS request", func() error {
			m, err := nc.Request("ctx", nil, hangGuard)
			if err == nil {
				_, err = decodeReply("ctx", m)
			}
			return err
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, tc.request())
			ctx := <-kept
			_, ok := ctx.Deadline()
			assert.Equal(t, tc.deadline, ok, "deadline")
			select {
			case <-ctx.Done():
			case <-time.After(hangGuard):
				t.Fatal("the handler's ctx did not end after it returned")
			}
			assert.ErrorIs(t, ctx.Err(), context.Canceled)
		})
	}

	running := make(chan context.Context, 1)
	svc, err := Serve(worker, "held", func(ctx context.Context, _ *ServiceRequest) (*Reply, error) {
		running <- ctx
		<-ctx.Done()
		return nil, ctx.Err()
	}, WithLogger(quietLog))
	require.NoError(t, err)
	answered := make(chan error, 1)
	go func() {
		_, err := Request(guarded(t), nc, "held", nil)
		answered <- err
	}()
	ctx := <-running
	require.NoError(t, svc.Close())
	assert.ErrorIs(t, ctx.Err(), context.Canceled)
	assert.ErrorIs(t, <-answered, ErrHandler)
}

func TestRequestToASubjectNobodyServes(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	for _, attempts := range []int{1, 3} {
		_, err := Request(guarded(t), nc, "prefill.kv", nil, WithRetry(attempts))
		require.ErrorIs(t, err, ErrNoResponders)
		require.ErrorIs(t, err, nats.ErrNoResponders)
		assert.Contains(t, err.Error(), `no worker serves subject "prefill.kv"`)
	}
}

// Retries that find nobody until ctx ends say so, not "no reply".
func TestRequestRetriedUntilTheDeadlineToASubjectNobodyServes(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	ctx, cancel := context.WithTimeout(guarded(t), time.Second)
	defer cancel()
	_, err := Request(ctx, nc, "prefill.kv", nil, WithRetry(1000))
	require.ErrorIs(t, err, ErrNoResponders)
	require.ErrorIs(t, err, nats.ErrNoResponders)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Regexp(t, `^goxfer/nats: no worker serves subject "prefill.kv": no responders in \d+ attempts over \S+, then context deadline exceeded$`, err.Error())
	assert.NotContains(t, err.Error(), "no reply")
}

func TestRequestTooLargeIsNotSent(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	var calls atomic.Int32
	serve(t, dial(t, srv), "prefill.kv", func(context.Context, *ServiceRequest) (*Reply, error) {
		calls.Add(1)
		return nil, errors.New("unreachable")
	})
	data := make([]byte, nc.MaxPayload())
	_, err := Request(guarded(t), nc, "prefill.kv", data)
	var tl *PayloadTooLargeError
	require.ErrorAs(t, err, &tl)
	require.ErrorIs(t, err, ErrPayloadTooLarge)
	assert.Equal(t, "prefill.kv", tl.Subject)
	assert.Equal(t, nc.MaxPayload(), tl.Max)
	assert.Greater(t, tl.Size, tl.Max)
	assert.Contains(t, err.Error(), fmt.Sprintf("of %d bytes exceeds the server's max payload of %d bytes (subject \"prefill.kv\")", tl.Size, tl.Max))
	// The server is still fine and the worker never saw the request.
	_, err = Request(guarded(t), nc, "prefill.kv", nil)
	require.ErrorIs(t, err, ErrHandler)
	assert.Equal(t, int32(1), calls.Load())
}

func TestReplyTooLargeComesBackAsAHandlerError(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	md := testToken(t)
	serve(t, dial(t, srv), "big", func(context.Context, *ServiceRequest) (*Reply, error) {
		return &Reply{Metadata: md, Data: make([]byte, nc.MaxPayload())}, nil
	})
	_, err := Request(guarded(t), nc, "big", nil)
	var he *HandlerError
	require.ErrorAs(t, err, &he)
	assert.Contains(t, he.Message, "exceeds the server's max payload")
}

func TestRequestHandlerErrors(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	serve(t, dial(t, srv), "fail", func(ctx context.Context, req *ServiceRequest) (*Reply, error) {
		switch string(req.Data) {
		case "plain":
			return nil, errors.New("out of KV blocks")
		case "typed":
			return nil, fmt.Errorf("wrapped: %w", &HandlerError{Code: "bad-request", Message: "no such prompt"})
		case "panic":
			panic("boom")
		case "nil":
			return nil, nil
		case "deadline":
			<-ctx.Done()
			return nil, ctx.Err()
		}
		return nil, nil
	})
	cases := []struct{ data, code, msg string }{
		{"plain", "handler", "out of KV blocks"},
		{"typed", "bad-request", "no such prompt"},
		{"panic", "handler", "handler panicked"},
		{"nil", "handler", "the handler returned no token (Reply.Metadata is zero)"},
	}
	for _, tc := range cases {
		t.Run(tc.data, func(t *testing.T) {
			_, err := Request(guarded(t), nc, "fail", []byte(tc.data))
			require.ErrorIs(t, err, ErrHandler)
			var he *HandlerError
			require.ErrorAs(t, err, &he)
			assert.Equal(t, HandlerError{Subject: "fail", Code: tc.code, Message: tc.msg}, *he)
			assert.Contains(t, err.Error(), `subject "fail"`)
		})
	}
	// The service survived the panic.
	_, err := Request(guarded(t), nc, "fail", []byte("plain"))
	require.ErrorIs(t, err, ErrHandler)
}

func TestRequestDeadlineAndCancel(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	handlerDone := make(chan error, 2)
	serve(t, dial(t, srv), "slow", func(ctx context.Context, req *ServiceRequest) (*Reply, error) {
		<-ctx.Done() // the requester's deadline reaches the handler
		handlerDone <- ctx.Err()
		return nil, ctx.Err()
	})

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err := Request(ctx, nc, "slow", nil)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), `request to subject "slow": no reply after`)
	assert.ErrorIs(t, <-handlerDone, context.DeadlineExceeded)

	_, err = Request(context.Background(), nc, "slow", nil, WithTimeout(100*time.Millisecond))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.ErrorIs(t, <-handlerDone, context.DeadlineExceeded)

	ctx, cancel = context.WithCancel(context.Background())
	cancel()
	_, err = Request(ctx, nc, "slow", nil)
	require.ErrorIs(t, err, context.Canceled)
}

func TestRequestRejectsAReplyThatIsNoToken(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	sub, err := nc.Subscribe("foreign", func(m *nats.Msg) { _ = m.Respond([]byte("not a token")) })
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	_, err = Request(guarded(t), nc, "foreign", nil)
	require.ErrorIs(t, err, connect.ErrInvalidMetadata)
	assert.Contains(t, err.Error(), `reply from subject "foreign"`)
}

func TestServeSharesRequestsInAQueueGroup(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	var a, b atomic.Int32
	serve(t, dial(t, srv), "pool", func(context.Context, *ServiceRequest) (*Reply, error) { a.Add(1); return &Reply{Metadata: md}, nil })
	serve(t, dial(t, srv), "pool", func(context.Context, *ServiceRequest) (*Reply, error) { b.Add(1); return &Reply{Metadata: md}, nil })
	nc := dial(t, srv)
	const n = 40
	for range n {
		_, err := Request(guarded(t), nc, "pool", nil)
		require.NoError(t, err)
	}
	assert.Equal(t, int32(n), a.Load()+b.Load(), "each request handled exactly once")
	assert.Positive(t, a.Load())
	assert.Positive(t, b.Load())
}

func TestServeBoundsConcurrency(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	var running, peak atomic.Int32
	release := make(chan struct{})
	serve(t, dial(t, srv), "bounded", func(context.Context, *ServiceRequest) (*Reply, error) {
		n := running.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		<-release
		running.Add(-1)
		return &Reply{Metadata: md}, nil
	}, WithConcurrency(2))
	nc := dial(t, srv)
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for range 6 {
		wg.Go(func() {
			_, err := Request(guarded(t), nc, "bounded", nil)
			errs <- err
		})
	}
	require.Eventually(t, func() bool { return running.Load() == 2 }, hangGuard, time.Millisecond)
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	assert.Equal(t, int32(2), peak.Load())
}

func TestServiceCloseCancelsHandlersAndIsIdempotent(t *testing.T) {
	srv := startServer(t)
	started := make(chan struct{})
	var sawCancel atomic.Bool
	s, err := Serve(dial(t, srv), "closing", func(ctx context.Context, _ *ServiceRequest) (*Reply, error) {
		close(started)
		<-ctx.Done()
		sawCancel.Store(true)
		return nil, ctx.Err()
	}, WithLogger(quietLog))
	require.NoError(t, err)
	assert.Equal(t, "closing", s.Subject())
	done := make(chan error, 1)
	go func() {
		_, err := Request(guarded(t), dial(t, srv), "closing", nil)
		done <- err
	}()
	<-started
	require.NoError(t, s.Close())
	assert.True(t, sawCancel.Load(), "Close returned before the handler")
	require.NoError(t, s.Close())
	err = <-done
	require.ErrorIs(t, err, ErrHandler)
}

// A restart of the server in the middle of a stream of requests loses
// none: each either succeeds (retried if need be) or would fail loudly.
func TestRequestSurvivesAServerRestart(t *testing.T) {
	srv := startServer(t)
	worker := dial(t, srv, resilient...)
	md := testToken(t)
	var handled atomic.Int32
	serve(t, worker, "echo", func(_ context.Context, req *ServiceRequest) (*Reply, error) {
		handled.Add(1)
		return &Reply{Metadata: md, Data: req.Data}, nil
	})
	nc := dial(t, srv, resilient...)

	restarted := make(chan error, 1)
	go func() { restarted <- srv.Restart() }()
	// Requests run back to back through the outage and for a while after.
	var sent int
	after := -1
	for after < 10 {
		want := fmt.Appendf(nil, "request %d", sent)
		rep, err := Request(guarded(t), nc, "echo", want, WithRetry(50), WithAttemptTimeout(500*time.Millisecond))
		require.NoError(t, err, "request %d", sent)
		require.True(t, bytes.Equal(want, rep.Data), "request %d got %q", sent, rep.Data)
		require.Equal(t, md.Text(), rep.Metadata.Text())
		sent++
		if after >= 0 {
			after++
			continue
		}
		select {
		case err := <-restarted:
			require.NoError(t, err)
			after = 0
		default:
		}
	}
	t.Logf("%d requests through the restart, %d handler calls", sent, handled.Load())
	assert.GreaterOrEqual(t, handled.Load(), int32(sent))
}

// A Service whose connection was closed first still closes, at once: its
// subscription is closed already, and no status will come.
func TestServiceCloseAfterConnectionClosed(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	s, err := Serve(nc, "svc.closed-conn", func(ctx context.Context, req *ServiceRequest) (*Reply, error) { return &Reply{}, nil })
	require.NoError(t, err)
	nc.Close()
	requireClosesWithin(t, s, 5*time.Second, "after its connection was closed")
}

// requireClosesWithin calls s.Close and fails t unless it returns nil
// within d.
func requireClosesWithin(t *testing.T, s *Service, d time.Duration, when string) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- s.Close() }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(d):
		t.Fatalf("Service.Close still running %v after it was called %s", d, when)
	}
}

// Requests dropped because the worker's connection held too many
// (nats.ErrSlowConsumer) are logged and lost, as with any subscription,
// and the Service goes on serving: the one still pending, then new ones.
func TestServiceServesOnAfterASlowConsumer(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	var log lockedBuffer
	release := make(chan struct{})
	held := make(chan struct{}, 1)
	quiet := nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}) // the Service logs it
	svc := serve(t, dial(t, srv, nats.SyncQueueLen(1), quiet), "narrow", func(_ context.Context, req *ServiceRequest) (*Reply, error) {
		if string(req.Data) == "hold" {
			held <- struct{}{}
			<-release
		}
		return &Reply{Metadata: md}, nil
	}, WithConcurrency(1), log.logger(slog.LevelWarn))
	nc := dial(t, srv)
	send := func(ctx context.Context, data string) <-chan error {
		done := make(chan error, 1)
		go func() {
			_, err := Request(ctx, nc, "narrow", []byte(data))
			done <- err
		}()
		return done
	}
	first := send(guarded(t), "hold")
	<-held // the only worker is busy
	second := send(guarded(t), "pending")
	require.Eventually(t, func() bool { n, _, _ := svc.sub.Pending(); return n == 1 }, hangGuard, time.Millisecond)
	// The pending buffer holds one request: these are dropped.
	for range 2 {
		ctx, cancel := context.WithTimeout(guarded(t), 200*time.Millisecond)
		require.ErrorIs(t, <-send(ctx, "dropped"), context.DeadlineExceeded)
		cancel()
	}
	close(release)
	require.NoError(t, <-first)
	require.NoError(t, <-second)
	require.NoError(t, <-send(guarded(t), "after"))
	assert.Contains(t, log.String(), "requests lost")
	assert.Contains(t, log.String(), nats.ErrSlowConsumer.Error())
}
