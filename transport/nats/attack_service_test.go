package nats

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/faultproxy"
)

// Attacks on request/reply and push offers from outside: what docs/nats.md
// and the doc comments promise about Close, deadlines, retries and
// strangers on the same server, checked against real servers.

// Many goroutines close a Service at once while its handlers run and
// requests wait behind them: every Close returns the same nil, every
// requester gets exactly one answer (its handler's or "unavailable"), and
// no goroutine the Service started outlives Close.
func TestAttackServiceConcurrentCloseMidFlight(t *testing.T) {
	srv := startServer(t)
	worker, requester := dial(t, srv), dial(t, srv)
	// The requester's reply subscription starts a goroutine of its own on
	// its first request: start it before taking the goroutine snapshot.
	_, err := Request(guarded(t), requester, "warm-up.nobody", nil)
	require.ErrorIs(t, err, ErrNoResponders)
	before := goleak.IgnoreCurrent()

	var running atomic.Int32
	s, err := Serve(worker, "attack.close", func(ctx context.Context, _ *ServiceRequest) (*Reply, error) {
		running.Add(1)
		<-ctx.Done()
		return nil, ctx.Err()
	}, WithConcurrency(4), WithLogger(quietLog))
	require.NoError(t, err)
	sentBefore := worker.Stats().OutMsgs
	const n = 10
	errs := make(chan error, n)
	for range n {
		go func() {
			_, err := Request(guarded(t), requester, "attack.close", nil)
			errs <- err
		}()
	}
	require.Eventually(t, func() bool {
		p, _, _ := s.sub.Pending()
		return running.Load() == 4 && p == n-4
	}, hangGuard, time.Millisecond)

	const closers = 32
	closed := make(chan error, closers)
	var start sync.WaitGroup
	start.Add(1)
	for range closers {
		go func() {
			start.Wait()
			closed <- s.Close()
		}()
	}
	start.Done()
	for i := range closers {
		require.NoError(t, await(t, closed, fmt.Sprintf("Close %d of %d", i+1, closers)))
	}
	codes := map[string]int{}
	for range n {
		var he *HandlerError
		require.ErrorAs(t, await(t, errs, "a requester's answer"), &he)
		codes[he.Code]++
	}
	assert.Equal(t, map[string]int{codeHandler: 4, codeUnavailable: n - 4}, codes)
	// A second answer would be dropped by the requester's client: count
	// what the worker sent instead.
	assert.Equal(t, uint64(n), worker.Stats().OutMsgs-sentBefore, "answers sent for %d requests", n)
	goleak.VerifyNone(t, before)
}

// A rolling restart: of two Services on a subject, one closes while
// requesters with WithRetry stream requests at both. Handlers that finish
// what they started (they ignore the cancellation) lose no request, and
// answer none twice: each request is handled exactly once, the ones the
// closing Service had taken but not started being answered "unavailable"
// and retried at the other.
func TestAttackServiceRollingCloseLosesNoRequest(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	var mu sync.Mutex
	handled := map[string]int{}
	h := func(_ context.Context, req *ServiceRequest) (*Reply, error) {
		time.Sleep(time.Millisecond)
		mu.Lock()
		handled[string(req.Data)]++
		mu.Unlock()
		return &Reply{Metadata: md, Data: req.Data}, nil
	}
	closing, err := Serve(dial(t, srv), "rolling", h, WithConcurrency(2), WithLogger(quietLog))
	require.NoError(t, err)
	serve(t, dial(t, srv), "rolling", h, WithConcurrency(2))
	nc := dial(t, srv)

	const requesters, each = 8, 40
	var wg sync.WaitGroup
	var failures atomic.Int32
	var sent atomic.Int32
	for r := range requesters {
		wg.Go(func() {
			for i := range each {
				id := fmt.Sprintf("%d/%d", r, i)
				rep, err := Request(guarded(t), nc, "rolling", []byte(id), WithRetry(10), WithAttemptTimeout(10*time.Second))
				sent.Add(1)
				if err != nil || string(rep.Data) != id {
					failures.Add(1)
					t.Errorf("request %s: %v", id, err)
				}
			}
		})
	}
	require.Eventually(t, func() bool { return sent.Load() >= requesters*each/4 }, hangGuard, time.Millisecond)
	require.NoError(t, closing.Close())
	wg.Wait()
	assert.Zero(t, failures.Load())
	mu.Lock()
	defer mu.Unlock()
	assert.Len(t, handled, requesters*each)
	for id, k := range handled {
		assert.Equal(t, 1, k, "request %s handled %d times", id, k)
	}
}

// A Service whose connection the client still believes up while the
// server hears nothing (a black-holed link): Close cannot learn that the
// pending requests' answers or its unsubscription arrived. It must still
// return, within the client's flush timeout (10 s, which it takes: the
// drain's flush), not hang.
func TestAttackServiceCloseOverABlackHoledLink(t *testing.T) {
	srv := startServer(t)
	nc, p := proxied(t, srv)
	held := make(chan struct{}, 1)
	s, err := Serve(nc, "blackhole", func(ctx context.Context, _ *ServiceRequest) (*Reply, error) {
		held <- struct{}{}
		<-ctx.Done()
		return nil, ctx.Err()
	}, WithConcurrency(1), WithLogger(quietLog))
	require.NoError(t, err)
	client := dial(t, srv)
	for range 3 {
		require.NoError(t, client.PublishRequest("blackhole", "nobody.listens", nil))
	}
	require.NoError(t, client.Flush())
	<-held
	require.Eventually(t, func() bool { n, _, _ := s.sub.Pending(); return n == 2 }, hangGuard, time.Millisecond)
	p.Stall(faultproxy.Both)
	start := time.Now()
	requireClosesWithin(t, s, 15*time.Second, "over a black-holed link")
	t.Logf("Close over a black-holed link took %v", time.Since(start).Round(time.Millisecond))
	p.Resume(faultproxy.Both)
}

// Strangers on the server publish to a Service's subject whatever they
// like: no reply subject, an unparsable or past Goxfer-Deadline, forged
// goxfer error headers, the subject itself as reply subject, an empty
// message. None of it kills a worker or makes the Service answer anything
// twice, and a real request is served after each; the Service closes.
func TestAttackServiceStrangerRequests(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	var calls atomic.Int32
	var sawDeadline sync.Map
	s, err := Serve(dial(t, srv), "strange", func(ctx context.Context, req *ServiceRequest) (*Reply, error) {
		calls.Add(1)
		_, has := ctx.Deadline()
		sawDeadline.Store(string(req.Data), has)
		if _, ok := req.Header[hdrError]; ok {
			return nil, errors.New("goxfer headers reached the handler")
		}
		return &Reply{Metadata: md, Data: req.Data}, nil
	}, WithConcurrency(2), WithLogger(quietLog))
	require.NoError(t, err)
	stranger, nc := dial(t, srv), dial(t, srv)
	inbox := nats.NewInbox()
	answers, err := stranger.SubscribeSync(inbox)
	require.NoError(t, err)
	send := func(name string, m *nats.Msg) {
		m.Subject = "strange"
		if m.Data == nil {
			m.Data = []byte(name)
		}
		require.NoError(t, stranger.PublishMsg(m), name)
		require.NoError(t, stranger.Flush())
	}
	hdr := func(kv ...string) nats.Header {
		h := nats.Header{}
		for i := 0; i < len(kv); i += 2 {
			h.Set(kv[i], kv[i+1])
		}
		return h
	}
	cases := []struct {
		name  string
		msg   *nats.Msg
		reply bool // the stranger should get exactly one answer on its inbox
	}{
		{"no reply subject", &nats.Msg{}, false},
		{"garbage deadline", &nats.Msg{Reply: inbox, Header: hdr(hdrDeadline, "yesterday")}, true},
		{"past deadline", &nats.Msg{Reply: inbox, Header: hdr(hdrDeadline, time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano))}, true},
		{"forged error headers", &nats.Msg{Reply: inbox, Header: hdr(hdrError, "forged", hdrErrorCode, codeUnavailable)}, true},
		{"reply to the subject itself", &nats.Msg{Reply: "strange"}, false},
		{"empty", &nats.Msg{Reply: inbox, Data: []byte{}}, true},
	}
	for _, c := range cases {
		send(c.name, c.msg)
		if c.reply {
			m, err := answers.NextMsg(hangGuard)
			require.NoError(t, err, c.name)
			_, failed := m.Header[hdrError]
			assert.False(t, failed, "%s: answered %q", c.name, m.Header.Get(hdrError))
		}
		ctx, cancel := context.WithTimeout(guarded(t), 5*time.Second)
		rep, err := Request(ctx, nc, "strange", []byte("after "+c.name))
		cancel()
		require.NoError(t, err, "a real request after a stranger's %q", c.name)
		assert.Equal(t, "after "+c.name, string(rep.Data))
	}
	_, err = answers.NextMsg(200 * time.Millisecond)
	require.ErrorIs(t, err, nats.ErrTimeout, "a second answer to the stranger")
	has, _ := sawDeadline.Load("garbage deadline")
	assert.Equal(t, false, has, "an unparsable deadline gave the handler one")
	requireClosesWithin(t, s, 10*time.Second, "after strangers' requests")
}

// A stranger subscribed to a Service's subject (outside its queue group)
// sees every request with its reply subject and can answer first. A
// malformed answer fails the request with an error that says what was
// expected and what was found; a well-formed one is accepted (NATS
// permissions, not goxfer, keep strangers off subjects and inboxes).
func TestAttackRequestStrangerAnswersFirst(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	release := make(chan struct{})
	serve(t, dial(t, srv), "contested", func(ctx context.Context, _ *ServiceRequest) (*Reply, error) {
		select {
		case <-release: // let the stranger answer first
		case <-ctx.Done():
		}
		return &Reply{Metadata: md, Data: []byte("worker")}, nil
	})
	defer close(release)
	stranger := dial(t, srv)
	var answer atomic.Value
	_, err := stranger.Subscribe("contested", func(m *nats.Msg) { _ = m.Respond(answer.Load().([]byte)) })
	require.NoError(t, err)
	require.NoError(t, stranger.Flush())
	nc := dial(t, srv)

	for _, body := range [][]byte{nil, []byte("gxt"), []byte("gxt\x02"), []byte("gxt\x01\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"), []byte("gxt\x01\x05ab"), []byte("gxt\x01\x02ab")} {
		answer.Store(body)
		ctx, cancel := context.WithTimeout(guarded(t), 5*time.Second)
		_, err := Request(ctx, nc, "contested", nil, WithRetry(3))
		cancel()
		require.ErrorIs(t, err, connect.ErrInvalidMetadata, "answer %q", body)
		assert.Contains(t, err.Error(), `subject "contested"`, "answer %q", body)
		t.Logf("answer %q: %v", body, err)
	}
	forged, err := encodeMessage(testToken(t), []byte("stranger"))
	require.NoError(t, err)
	answer.Store(forged)
	rep, err := Request(guarded(t), nc, "contested", nil)
	require.NoError(t, err)
	assert.Equal(t, "stranger", string(rep.Data), "NATS delivers the first answer")
}

// Request returns by its ctx's deadline whatever the other side does:
// a handler that never answers (attempt timeout far beyond the deadline),
// a server gone (the connection reconnecting), a stranger in the queue
// group that takes requests and never answers. The error wraps the ctx's
// and names the subject.
func TestAttackRequestBoundedByItsDeadline(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	stuck := make(chan struct{})
	defer close(stuck)
	serve(t, dial(t, srv), "stuck", func(context.Context, *ServiceRequest) (*Reply, error) {
		<-stuck // ignores its ctx
		return &Reply{Metadata: md}, nil
	}, WithConcurrency(1))
	// A stranger in the default queue group that never answers.
	stranger := dial(t, srv)
	_, err := stranger.QueueSubscribe("silent", defaultQueue, func(*nats.Msg) {})
	require.NoError(t, err)
	require.NoError(t, stranger.Flush())

	const deadline = 300 * time.Millisecond
	bounded := func(nc *nats.Conn, subject string, opts ...RequestOption) {
		t.Helper()
		ctx, cancel := context.WithTimeout(guarded(t), deadline)
		defer cancel()
		start := time.Now()
		_, err := Request(ctx, nc, subject, nil, opts...)
		took := time.Since(start)
		require.ErrorIs(t, err, context.DeadlineExceeded, subject)
		assert.Contains(t, err.Error(), fmt.Sprintf("subject %q", subject))
		assert.Less(t, took, deadline+2*time.Second, "%s: Request past its deadline", subject)
	}
	nc := dial(t, srv, resilient...)
	for _, opts := range [][]RequestOption{nil, {WithRetry(100), WithAttemptTimeout(time.Hour)}, {WithRetry(100), WithAttemptTimeout(50 * time.Millisecond)}} {
		bounded(nc, "stuck", opts...)
		bounded(nc, "silent", opts...)
	}
	srv.Shutdown()
	require.Eventually(t, func() bool { return !nc.IsConnected() }, hangGuard, time.Millisecond)
	bounded(nc, "stuck")
	bounded(nc, "stuck", WithRetry(100), WithAttemptTimeout(50*time.Millisecond))
}

// Request on a connection that is closed, or draining (nc.Drain), fails
// at once, naming the subject, instead of waiting for its deadline.
func TestAttackRequestOnAClosedOrDrainingConnection(t *testing.T) {
	srv := startServer(t)
	md := testToken(t)
	serve(t, dial(t, srv), "gone", func(context.Context, *ServiceRequest) (*Reply, error) {
		return &Reply{Metadata: md}, nil
	})
	for _, how := range []string{"closed", "drained"} {
		nc := dial(t, srv)
		_, err := Request(guarded(t), nc, "gone", nil) // its reply subscription exists
		require.NoError(t, err)
		if how == "closed" {
			nc.Close()
		} else {
			require.NoError(t, nc.Drain())
			require.Eventually(t, nc.IsClosed, hangGuard, time.Millisecond)
		}
		start := time.Now()
		_, err = Request(guarded(t), nc, "gone", nil, WithRetry(5))
		require.ErrorIs(t, err, nats.ErrConnectionClosed, how)
		assert.Contains(t, err.Error(), `subject "gone"`)
		assert.Less(t, time.Since(start), 2*time.Second, how)
	}
}

// Strangers publish every kind of malformed message to an offer subject:
// each is reported by Next as connect.ErrInvalidMetadata naming the
// subject and saying what was expected, and the Subscription goes on to
// the good offer behind them.
func TestAttackSubscriptionSurvivesMalformedOffers(t *testing.T) {
	ctx := guarded(t)
	srv := startServer(t)
	md := testToken(t)
	s := subscribe(t, dial(t, srv), "offers.>")
	stranger := dial(t, srv)
	tok, err := md.MarshalBinary()
	require.NoError(t, err)
	bodies := [][]byte{
		nil,
		[]byte("g"),
		[]byte("gxt"),
		[]byte("GXT\x01"),
		[]byte("gxt\x00"),
		[]byte("gxt\x01"),
		[]byte("gxt\x01\x80"),
		[]byte("gxt\x01\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"),
		[]byte("gxt\x01\x80\x80\x80\x20"), // 64 MiB + a token that is not there
		append([]byte("gxt\x01\x05"), tok...),
		append(binary.AppendUvarint([]byte("gxt\x01"), uint64(len(tok))), tok[:len(tok)-1]...),
		append(binary.AppendUvarint([]byte("gxt\x01"), uint64(len(tok))), make([]byte, len(tok))...),
	}
	for i, b := range bodies {
		require.NoError(t, stranger.PublishMsg(&nats.Msg{Subject: fmt.Sprintf("offers.bad.%d", i), Data: b, Header: nats.Header{"Goxfer-Error": {"x"}}}))
	}
	require.NoError(t, Publish(ctx, stranger, "offers.good", md, []byte("good")))
	for i, b := range bodies {
		_, err := s.Next(ctx)
		require.ErrorIs(t, err, connect.ErrInvalidMetadata, "message %d %q", i, b)
		assert.Contains(t, err.Error(), fmt.Sprintf(`subject "offers.bad.%d"`, i))
		t.Logf("%q: %v", b, err)
	}
	o, err := s.Next(ctx)
	require.NoError(t, err)
	assert.Equal(t, "good", string(o.Data))
	assert.Equal(t, "offers.good", o.Subject)
}

// Many goroutines close a Subscription at once while Next waits: Next
// returns ErrClosed, every Close returns nil, and after Close returns the
// subscription is gone from the server (an offer published then reaches
// nobody: Publish's flush confirms and no other subscriber exists).
func TestAttackSubscriptionConcurrentClose(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	s, err := Subscribe(nc, "offers.close")
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	next := make(chan error, 1)
	go func() {
		_, err := s.Next(guarded(t))
		next <- err
	}()
	const closers = 32
	closed := make(chan error, closers)
	var start sync.WaitGroup
	start.Add(1)
	for range closers {
		go func() {
			start.Wait()
			closed <- s.Close()
		}()
	}
	start.Done()
	for i := range closers {
		require.NoError(t, await(t, closed, fmt.Sprintf("Close %d of %d", i+1, closers)))
	}
	require.ErrorIs(t, await(t, next, "Next"), ErrClosed)
	_, err = s.Next(guarded(t))
	require.ErrorIs(t, err, ErrClosed)
}

// A Subscription closed while its connection drains (nc.Drain, as
// docs/nats.md allows after closing goxfer's objects): Close says what
// happened, and the draining connection still ends the subscription.
func TestAttackSubscriptionCloseWhileTheConnectionDrains(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	s, err := Subscribe(nc, "offers.drain")
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	require.NoError(t, nc.Drain())
	err = s.Close()
	t.Logf("Close during nc.Drain: %v", err)
	if err != nil {
		assert.ErrorIs(t, err, nats.ErrConnectionDraining)
		assert.Contains(t, err.Error(), `subject "offers.drain"`)
	}
	require.Eventually(t, nc.IsClosed, hangGuard, time.Millisecond)
	_, err = s.Next(guarded(t))
	require.ErrorIs(t, err, ErrClosed)
}

// A Service closes while a handler that finishes its work (ignoring the
// cancellation) holds the drain open, and the server restarts meanwhile:
// the client re-subscribes every subscription it still has on reconnect,
// the draining one among them, after its UNSUB went to the old server.
// Once the drain ends the Service has no subscription, and the server must
// not keep its interest: a request then finds no responders at once rather
// than going to a subscription nobody reads.
//
// Defect: it does keep it. nats.go (v1.55.0) re-sends a SUB for every
// subscription it holds on reconnect (resendSubscriptions), the draining
// one too, and removes it locally once drained without a new UNSUB: the
// server keeps routing the subject's requests to the closed Service's
// connection (its connz shows the subscription, its msgs counting), which
// drops them. Behind a queue group that is a share of the pool's requests
// lost, each costing its requester an attempt timeout or the request,
// until that connection closes. Not fixable inside Close with nats.go's
// API once the drain has removed the subscription: it needs nats.go to
// skip draining subscriptions on reconnect (or UNSUB them), or Close to
// drain without Subscription.Drain.
func TestAttackServiceCloseAcrossAServerRestartLeavesNoInterest(t *testing.T) {
	t.Skip("defect: a Service closed while its drain spans a reconnect leaves its subscription on the server (nats.go re-sends draining subscriptions, then drops them locally without UNSUB); requests routed to it are lost")
	srv := startServer(t)
	md := testToken(t)
	nc := dial(t, srv, resilient...)
	held := make(chan struct{}, 1)
	release := make(chan struct{})
	s, err := Serve(nc, "ghost", func(_ context.Context, req *ServiceRequest) (*Reply, error) {
		if string(req.Data) == "hold" {
			held <- struct{}{}
			<-release // finishes its work whatever the ctx says
		}
		return &Reply{Metadata: md}, nil
	}, WithConcurrency(1), WithLogger(quietLog))
	require.NoError(t, err)
	client := dial(t, srv, resilient...)
	require.NoError(t, client.PublishRequest("ghost", "nobody.listens", []byte("hold")))
	for range 2 {
		require.NoError(t, client.PublishRequest("ghost", "nobody.listens", []byte("pending")))
	}
	require.NoError(t, client.Flush())
	<-held
	require.Eventually(t, func() bool { n, _, _ := s.sub.Pending(); return n == 2 }, hangGuard, time.Millisecond)
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	// The UNSUB reaches the server and the drain waits for the handler.
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(guarded(t), time.Second)
		defer cancel()
		_, err := Request(ctx, client, "ghost", nil)
		return errors.Is(err, ErrNoResponders)
	}, hangGuard, 10*time.Millisecond)
	require.NoError(t, srv.Restart())
	require.Eventually(t, func() bool { return nc.IsConnected() && client.IsConnected() }, hangGuard, time.Millisecond)
	require.NoError(t, nc.Flush()) // the re-subscriptions have reached the server
	close(release)
	require.NoError(t, await(t, closed, "Close"))
	require.Zero(t, nc.NumSubscriptions(), "the client still has the subscription")
	ctx, cancel := context.WithTimeout(guarded(t), 3*time.Second)
	defer cancel()
	_, err = Request(ctx, client, "ghost", nil)
	require.ErrorIs(t, err, ErrNoResponders, "a closed Service's subscription is still on the server")
}

// Workers that answer every attempt "unavailable" (a handler's own "not
// now, try another worker") until the requester's ctx ends: the error must
// say what the attempts found, not that nobody replied.
func TestAttackRequestRetriedUnavailableUntilTheDeadlineSaysSo(t *testing.T) {
	srv := startServer(t)
	serve(t, dial(t, srv), "busy", func(context.Context, *ServiceRequest) (*Reply, error) {
		return nil, &HandlerError{Code: codeUnavailable, Message: "all slots taken"}
	})
	ctx, cancel := context.WithTimeout(guarded(t), 500*time.Millisecond)
	defer cancel()
	_, err := Request(ctx, dial(t, srv), "busy", nil, WithRetry(100))
	t.Logf("%v", err)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	var he *HandlerError
	require.ErrorAs(t, err, &he, "the error hides the workers' answers")
	assert.Equal(t, codeUnavailable, he.Code)
	assert.Contains(t, err.Error(), "all slots taken")
	assert.NotContains(t, err.Error(), "no reply")
}
