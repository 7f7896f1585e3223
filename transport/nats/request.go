package nats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/connect"
)

// Handler answers one request to a [Service]: typically it exposes memory
// ([connect.Connector.CreateReadable] or [connect.Connector.CreateWritable])
// and returns the operation's token in the [Reply]. ctx is cancelled when
// the handler returns or the Service closes, and expires at the
// requester's deadline (sent as an absolute time: the clocks of the two
// machines should roughly agree). An error becomes a [*HandlerError] at the
// requester: return a *HandlerError yourself to choose its Code. A Handler
// runs on a goroutine of its own and must be safe for concurrent use; with
// [WithRetry] at the requester it may see the same request twice, so it
// should be idempotent. The Service reads the Reply it returns, and does
// not keep it.
type Handler func(ctx context.Context, req *ServiceRequest) (*Reply, error)

// ServiceRequest is a request as a [Handler] sees it. The Handler owns it
// and may keep Data and Header. (It cannot be named Request, which is the
// function that sends one: [Request].)
type ServiceRequest struct {
	Subject string      // the subject the request was sent to
	Data    []byte      // the requester's payload; the handler may keep it
	Header  nats.Header // the requester's headers (goxfer's own removed); may be nil
}

// Reply is a [Handler]'s answer, and what [Request] returns to the
// requester, who then owns it. Metadata is required on success.
type Reply struct {
	Metadata connect.Metadata // required on success
	Data     []byte           // optional application payload
	Header   nats.Header      // optional application headers ("Goxfer-" ones are dropped)
}

// Service answers requests on a subject with a [Handler]; see [Serve]. It
// is safe for concurrent use. It owns the goroutines that run its handlers:
// one more than the most requests it has handled at once, at most
// [WithConcurrency], kept until [Service.Close], which waits for them. The
// connection stays the caller's.
type Service struct {
	subject string
	nc      *nats.Conn
	h       Handler
	log     *slog.Logger
	sub     *nats.Subscription
	limit   int // workers at most: the concurrency

	mu      sync.Mutex
	workers int       // goroutines that serve (see work)
	idle    int       // those waiting for a request
	lostAt  time.Time // when "requests lost" was last logged (see lost)
	unsaid  int       // the losses since, not logged

	ctx    context.Context // cancelled by Close; the handlers' parent
	cancel context.CancelFunc
	wg     sync.WaitGroup // the workers

	closeOnce sync.Once
	closeErr  error
}

// Serve answers requests on subject with h until [Service.Close]. It
// subscribes in a queue group ([WithQueue], default "goxfer"), so a pool of
// workers serving the same subject shares its requests, each request going
// to one worker. Each request runs h on a goroutine of its own, at most
// [WithConcurrency] (default 64) at once; further requests wait in the
// subscription's pending buffer, a synchronous subscription's (up to the
// connection's [nats.SyncQueueLen], 64 Ki requests by default, and 64
// MiB; requests past that are dropped and logged, and their requesters
// time out). A Handler error is sent back as Goxfer-Error headers and
// reaches the requester as a [*HandlerError]; a panic in h is logged
// ([WithLogger]) and answered with "handler panicked", and the Service
// continues, as it does after a handler that calls [runtime.Goexit]
// (answered with a handler error). Lost requests are logged once, then at
// most once every 10 s. A reply too large for the server's max payload is
// answered with an error naming both sizes.
//
// Serve uses nc, which stays the caller's: it never dials, and closing nc
// stops the Service (Close must still be called to wait for handlers).
// Options honoured: WithQueue, WithConcurrency, WithLogger.
func Serve(nc *nats.Conn, subject string, h Handler, opts ...ServeOption) (*Service, error) {
	o, err := connOptions("Serve", nc, opts, ServeOption.applyServe)
	if err != nil {
		return nil, err
	}
	if h == nil {
		return nil, fmt.Errorf("%w: Serve needs a handler", ErrInvalidOption)
	}
	queue := defaultQueue
	if o.queue != nil {
		queue = *o.queue
	}
	s := &Service{subject: subject, nc: nc, h: h, log: o.logger, limit: o.concurrency}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.sub, err = nc.QueueSubscribeSync(subject, queue)
	if err != nil {
		s.cancel()
		return nil, fmt.Errorf("goxfer/nats: serve subject %q (queue %q): %w", subject, queue, err)
	}
	// Unlike Subscribe, a Service is no use unless the server has its
	// interest before Serve returns.
	if err := nc.Flush(); err != nil && !errors.Is(err, nats.ErrConnectionReconnecting) {
		_ = s.sub.Unsubscribe()
		s.cancel()
		return nil, fmt.Errorf("goxfer/nats: serve subject %q: %w", subject, err)
	}
	s.workers, s.idle = 1, 1
	s.wg.Add(1)
	go s.work()
	return s, nil
}

// Subject returns the subject the Service answers. Safe for concurrent use.
func (s *Service) Subject() string { return s.subject }

// Close stops taking requests (the subscription is drained: requests
// already delivered are answered "unavailable", so that requesters with
// [WithRetry] go to another worker; while the connection is down they
// are dropped instead), cancels the ctx of running handlers and waits for
// them to return. The connection stays open. Close is
// idempotent and safe for concurrent use; every call returns the first
// call's result. A handler must not call it: Close waits for handlers.
func (s *Service) Close() error {
	s.closeOnce.Do(func() {
		s.cancel()
		closed := s.sub.StatusChanged(nats.SubscriptionClosed)
		// Drained only while connected; otherwise drop what is pending.
		// (A drain while the connection is down waits for the server,
		// up to the client's 10 s flush timeout, to answer what no
		// requester can hear before the connection is back.)
		var err error = nats.ErrConnectionReconnecting
		if s.nc.IsConnected() {
			err = s.sub.Drain()
		}
		if err != nil {
			if err := s.sub.Unsubscribe(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) && !errors.Is(err, nats.ErrBadSubscription) {
				s.closeErr = fmt.Errorf("goxfer/nats: close service on subject %q: %w", s.subject, err)
			}
		}
		// The channel hears of the subscription's close only if it comes
		// after it was asked for: one closed already (its connection was
		// closed first) sends nothing, so its status is checked too.
		for {
			if !s.sub.IsValid() {
				break
			}
			timer := time.NewTimer(50 * time.Millisecond)
			select {
			case _, ok := <-closed:
				if !ok {
					timer.Stop()
					goto drained
				}
			case <-timer.C:
			}
			timer.Stop()
		}
	drained:
		s.wg.Wait()
	})
	return s.closeErr
}

// work answers the subscription's requests, one at a time, each on the
// goroutine that took it from the subscription: no goroutine is started
// or handed a request per request (that cost about a third of what goxfer
// adds to a token request over NATS; docs/benchmarks.md). Every worker
// waits on the subscription; one that takes a request when no other waits
// starts another, up to the concurrency, so that a running handler holds
// up no other request, and with every worker busy further requests wait
// in the subscription. Once the Service is closing, workers answer what
// is left "unavailable" until the subscription closes.
func (s *Service) work() {
	// handling is the request whose handler runs. A handler that ends
	// this goroutine (runtime.Goexit, as t.FailNow does; a panic is
	// recovered in call) leaves it set: its requester is answered, and
	// another goroutine takes this one's place, and its count in s.wg, so
	// that the Service keeps its workers.
	var handling *nats.Msg
	defer func() {
		if handling == nil {
			s.wg.Done()
			return
		}
		s.log.Error("goxfer/nats: handler ended its goroutine (runtime.Goexit)", "subject", handling.Subject)
		s.respondError(handling, codeHandler, "handler ended its goroutine (runtime.Goexit)")
		s.mu.Lock()
		s.idle++
		s.mu.Unlock()
		go s.work()
	}()
	for {
		m, err := s.sub.NextMsgWithContext(context.Background())
		s.mu.Lock()
		s.idle--
		grow := err == nil && s.idle == 0 && s.workers < s.limit && s.ctx.Err() == nil
		if grow {
			s.workers++
			s.idle++
			s.wg.Add(1)
		}
		s.mu.Unlock()
		if grow {
			go s.work()
		}
		switch {
		case err != nil:
			if s.closedBy(err) {
				return
			}
		case s.ctx.Err() != nil:
			s.respondError(m, codeUnavailable, "the service is closing; the request was not handled")
		default:
			handling = m
			s.handle(m)
			handling = nil
		}
		s.mu.Lock()
		s.idle++
		s.mu.Unlock()
	}
}

// closedBy reports whether err, from the subscription's NextMsg, means the
// worker should stop: the subscription closed. Otherwise requests were
// dropped (nats.ErrSlowConsumer: the client's pending limits), or the
// server refused the subscription until the next reconnect (with
// nats.PermissionErrOnSubscribe): their requesters time out or retry, as
// with any subscription. closedBy logs that ([Service.lost]), and after a
// refusal waits a little before the next try, or stops the worker if the
// Service closes.
func (s *Service) closedBy(err error) bool {
	if errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrBadSubscription) || !s.sub.IsValid() {
		return true
	}
	s.lost(err)
	if errors.Is(err, nats.ErrSlowConsumer) {
		return false
	}
	t := time.NewTimer(100 * time.Millisecond)
	defer t.Stop()
	select {
	case <-t.C:
		return false
	case <-s.ctx.Done():
		// While refused, NextMsg reports the refusal, never a request
		// still pending from before it: such a subscription cannot drain,
		// and Close would wait for it forever. It ends here, dropping
		// them (their requesters time out or retry).
		if err := s.sub.Unsubscribe(); err != nil && !errors.Is(err, nats.ErrBadSubscription) && !errors.Is(err, nats.ErrConnectionClosed) {
			s.log.Warn("goxfer/nats: close refused subscription", "subject", s.subject, "err", err)
		}
		return true
	}
}

// lostLogEvery is how often at most a Service logs "requests lost".
const lostLogEvery = 10 * time.Second

// lost logs err, a loss that closedBy reports: the first at once, then at
// most one line every lostLogEvery, saying how many came since the last
// line. A flood past the pending limits makes each request taken report
// one (NextMsg says so once per drop it saw), a refused subscription each
// retry: a line for each would flood the log as well.
func (s *Service) lost(err error) {
	s.mu.Lock()
	now := time.Now()
	say := s.lostAt.IsZero() || now.Sub(s.lostAt) >= lostLogEvery
	unsaid := s.unsaid
	if say {
		s.lostAt, s.unsaid = now, 0
	} else {
		s.unsaid++
	}
	s.mu.Unlock()
	if say {
		s.log.Warn("goxfer/nats: requests lost", "subject", s.subject, "err", err, "unlogged_since_last", unsaid)
	}
}

// handle answers m.
func (s *Service) handle(m *nats.Msg) {
	// One context, not a deadline below a cancellable one: each is an
	// allocation, a registration with its parent and a cancellation.
	var (
		ctx    context.Context
		cancel context.CancelFunc
	)
	if t, ok := requestDeadline(m.Header); ok {
		ctx, cancel = context.WithDeadline(s.ctx, t)
	} else {
		ctx, cancel = context.WithCancel(s.ctx)
	}
	defer cancel()
	req := &ServiceRequest{Subject: m.Subject, Data: m.Data, Header: appHeader(m.Header)}
	rep, err := s.call(ctx, req)
	if err != nil {
		var he *HandlerError
		switch {
		case errors.Is(err, context.DeadlineExceeded) && errors.Is(ctx.Err(), context.DeadlineExceeded):
			// The requester's deadline passed: it has stopped listening
			// and reports its own ctx error, so an answer would only race
			// with that.
		case errors.As(err, &he):
			s.respondError(m, he.Code, he.Message)
		case errors.Is(err, context.DeadlineExceeded):
			s.respondError(m, codeTimeout, err.Error()) // the handler's own timeout
		default:
			s.respondError(m, codeHandler, err.Error())
		}
		return
	}
	if rep == nil || rep.Metadata.EncodedLen() == 0 {
		s.respondError(m, codeHandler, "the handler returned no token (Reply.Metadata is zero)")
		return
	}
	body, err := encodeMessage(rep.Metadata, rep.Data)
	if err != nil {
		s.respondError(m, codeHandler, err.Error())
		return
	}
	out := &nats.Msg{Header: mergeHeader(rep.Header), Data: body}
	if err := checkSize(s.nc, m.Subject, out.Header, body); err != nil {
		s.respondError(m, codeHandler, "reply: "+err.Error())
		return
	}
	if m.Reply != "" {
		if err := m.RespondMsg(out); err != nil {
			s.log.Warn("goxfer/nats: reply lost", "subject", m.Subject, "err", err)
		}
	}
}

// requestDeadline is the requester's deadline its headers carry, if any
// that parses.
func requestDeadline(h nats.Header) (time.Time, bool) {
	d := h.Get(hdrDeadline)
	if d == "" {
		return time.Time{}, false
	}
	t, err := time.Parse(time.RFC3339Nano, d)
	return t, err == nil
}

// call runs the Handler, turning a panic into an error.
func (s *Service) call(ctx context.Context, req *ServiceRequest) (rep *Reply, err error) {
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("goxfer/nats: handler panicked", "subject", req.Subject, "panic", p)
			rep, err = nil, &HandlerError{Code: codeHandler, Message: "handler panicked"}
		}
	}()
	return s.h(ctx, req)
}

func (s *Service) respondError(m *nats.Msg, code, msg string) {
	if m.Reply == "" {
		return
	}
	if code == "" {
		code = codeHandler
	}
	out := nats.NewMsg(m.Reply)
	out.Header.Set(hdrError, msg)
	out.Header.Set(hdrErrorCode, code)
	if err := m.RespondMsg(out); err != nil {
		s.log.Warn("goxfer/nats: error reply lost", "subject", m.Subject, "err", err)
	}
}

// Request sends data to a worker serving subject (see [Serve]) and returns
// its [Reply]: the token it answered with and its payload, which the caller
// owns. data is not retained. A ctx without a deadline gets
// [WithTimeout]'s (default 10 s). Errors:
//
//   - nobody serves subject: matches [ErrNoResponders] and
//     [nats.ErrNoResponders], and names the subject; with [WithRetry], also
//     when ctx ends after every attempt found no responders (the error
//     then says how many, and matches ctx's error too);
//   - the Handler failed: a [*HandlerError] (matches [ErrHandler]);
//   - ctx done: wraps ctx.Err(), naming the subject and the time waited;
//     with WithRetry, after workers answered "unavailable", the error
//     says how many did and is also the last such [*HandlerError];
//   - data and headers too large: a [*PayloadTooLargeError], nothing sent;
//   - the reply is no goxfer token message: matches
//     [connect.ErrInvalidMetadata], naming the subject.
//
// Request sends once unless given [WithRetry]. Then it retries, with
// backoff from 20 ms to 1 s, only when the request cannot have been handled
// or its outcome was lost: no responders, the connection disconnected or
// reconnecting, an attempt with no reply within [WithAttemptTimeout], or a
// worker answering "unavailable" because it was shutting down. Options
// honoured: WithHeader, WithTimeout, WithRetry, WithAttemptTimeout. Safe
// for concurrent use.
func Request(ctx context.Context, nc *nats.Conn, subject string, data []byte, opts ...RequestOption) (*Reply, error) {
	o, err := connOptions("Request", nc, opts, RequestOption.applyRequest)
	if err != nil {
		return nil, err
	}
	ctx, cancel := o.bound(ctx)
	defer cancel()
	hdr := mergeHeader(o.header)
	start := time.Now()
	backoff := 20 * time.Millisecond
	// unserved counts the attempts that found no responders; while it
	// equals the attempts made, a ctx that ends says so rather than "no
	// reply". Likewise, once a worker answered "unavailable" (busy is the
	// last such answer), a ctx that ends says so.
	unserved := 0
	var busy *unavailableError
	ended := func(attempts int) error {
		switch {
		case unserved > 0 && unserved == attempts:
			return &noRespondersError{subject: subject, attempts: unserved, waited: time.Since(start), cause: context.Cause(ctx)}
		case busy != nil:
			busy.attempts, busy.waited, busy.cause = attempts, time.Since(start), ctx.Err()
			return busy
		}
		return ctxError(subject, start, attempts, ctx.Err())
	}
	for attempt := 1; ; attempt++ {
		actx, cancel := ctx, context.CancelFunc(func() {})
		if o.retry > 1 {
			actx, cancel = context.WithTimeout(ctx, o.attemptTimeout)
		}
		dl, _ := actx.Deadline()
		hdr.Set(hdrDeadline, dl.UTC().Format(time.RFC3339Nano))
		if err := checkSize(nc, subject, hdr, data); err != nil {
			cancel()
			return nil, err
		}
		m, err := nc.RequestMsgWithContext(actx, &nats.Msg{Subject: subject, Header: hdr, Data: data})
		cancel()
		if err == nil {
			rep, err := decodeReply(subject, m)
			var he *HandlerError
			if err == nil || !errors.As(err, &he) || he.Code != codeUnavailable || attempt >= o.retry {
				return rep, err
			}
			if busy == nil {
				busy = &unavailableError{subject: subject}
			}
			busy.answers++
			busy.last = he
		} else {
			if ctx.Err() != nil {
				// Cut short by ctx: this attempt's outcome is unknown.
				return nil, ended(attempt - 1)
			}
			if errors.Is(err, nats.ErrNoResponders) {
				unserved++
			}
			retry, final := classify(subject, attempt, o, err)
			if !retry || attempt >= o.retry {
				return nil, final
			}
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ended(attempt)
		case <-t.C:
		}
		backoff = min(2*backoff, time.Second)
	}
}

// unavailableError reports retries that ctx ended after workers had
// answered "unavailable" (not a lack of replies): it matches ctx's error
// and the last such answer's [*HandlerError].
type unavailableError struct {
	subject  string
	attempts int           // the attempts made
	answers  int           // those answered "unavailable"
	last     *HandlerError // the last of them
	waited   time.Duration
	cause    error // ctx.Err()
}

func (e *unavailableError) Error() string {
	return fmt.Sprintf("goxfer/nats: request to subject %q: not handled after %v, %d attempts (%d answered %q, the last with %q): %v",
		e.subject, e.waited.Round(time.Millisecond), e.attempts, e.answers, codeUnavailable, e.last.Message, e.cause)
}

func (e *unavailableError) Unwrap() []error { return []error{e.last, e.cause} }

// classify says whether a failed attempt may be retried, and the error to
// return if it is the last.
func classify(subject string, attempt int, o options, err error) (retry bool, final error) {
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		return true, &noRespondersError{subject: subject, attempts: attempt}
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout):
		return true, fmt.Errorf("goxfer/nats: request to subject %q: no reply within the attempt timeout of %v (%d attempts): %w", subject, o.attemptTimeout, attempt, err)
	case errors.Is(err, nats.ErrDisconnected), errors.Is(err, nats.ErrConnectionReconnecting):
		return true, fmt.Errorf("goxfer/nats: request to subject %q (%d attempts): %w", subject, attempt, err)
	}
	return false, fmt.Errorf("goxfer/nats: request to subject %q: %w", subject, err)
}

// decodeReply turns a worker's answer into a Reply or a *HandlerError.
func decodeReply(subject string, m *nats.Msg) (*Reply, error) {
	if _, failed := m.Header[hdrError]; failed {
		code := m.Header.Get(hdrErrorCode)
		if code == "" {
			code = codeHandler
		}
		return nil, &HandlerError{Subject: subject, Code: code, Message: m.Header.Get(hdrError)}
	}
	md, payload, err := decodeMessage(m.Data)
	if err != nil {
		return nil, fmt.Errorf("goxfer/nats: reply from subject %q: %w", subject, err)
	}
	return &Reply{Metadata: md, Data: payload, Header: appHeader(m.Header)}, nil
}
