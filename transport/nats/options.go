package nats

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
)

// ServeOption configures [Serve]: WithQueue, WithConcurrency, WithLogger.
type ServeOption interface{ applyServe(*options) error }

// RequestOption configures [Request]: WithHeader, WithTimeout, WithRetry,
// WithAttemptTimeout.
type RequestOption interface{ applyRequest(*options) error }

// PublishOption configures [Publish]: WithHeader, WithTimeout.
type PublishOption interface{ applyPublish(*options) error }

// SubscribeOption configures [Subscribe]: WithQueue.
type SubscribeOption interface{ applySubscribe(*options) error }

// RegistryOption configures [OpenRegistry]: WithBucket, WithHeartbeat,
// WithCreateBucket, WithReplicas, WithLogger.
type RegistryOption interface{ applyRegistry(*options) error }

// JoinOption configures [Registry.Join]: WithHeartbeat.
type JoinOption interface{ applyJoin(*options) error }

// QueueOption is [WithQueue]'s: it configures [Serve] and [Subscribe].
type QueueOption interface {
	ServeOption
	SubscribeOption
}

// SendOption is the option of the calls that send a message, [Request]
// and [Publish]: [WithHeader] and [WithTimeout].
type SendOption interface {
	RequestOption
	PublishOption
}

// LoggerOption is [WithLogger]'s: it configures [Serve] and
// [OpenRegistry].
type LoggerOption interface {
	ServeOption
	RegistryOption
}

// HeartbeatOption is [WithHeartbeat]'s: it configures [OpenRegistry] and
// [Registry.Join].
type HeartbeatOption interface {
	RegistryOption
	JoinOption
}

// option implements every call's interface; the type a constructor
// returns says which calls may take it.
type option func(*options) error

func (f option) applyServe(o *options) error     { return f(o) }
func (f option) applyRequest(o *options) error   { return f(o) }
func (f option) applyPublish(o *options) error   { return f(o) }
func (f option) applySubscribe(o *options) error { return f(o) }
func (f option) applyRegistry(o *options) error  { return f(o) }
func (f option) applyJoin(o *options) error      { return f(o) }

// Defaults.
const (
	defaultQueue          = "goxfer"
	defaultConcurrency    = 64
	defaultTimeout        = 10 * time.Second
	defaultAttemptTimeout = 2 * time.Second
	defaultBucket         = "goxfer_agents"
	defaultHeartbeat      = time.Second
	// minHeartbeat keeps heartbeats from flooding the server.
	minHeartbeat = 10 * time.Millisecond
	// maxHeartbeat keeps the bucket TTL (3 heartbeats) sane.
	maxHeartbeat = time.Hour
)

type options struct {
	queue          *string
	concurrency    int
	header         nats.Header
	timeout        time.Duration
	retry          int
	attemptTimeout time.Duration
	logger         *slog.Logger
	bucket         string
	heartbeat      time.Duration
	createBucket   bool
	replicas       int // 0: WithReplicas's default, chosen by whether the server is clustered
}

// connOptions applies opts, each with apply, for fn, a function that
// needs a connection: nc must not be nil.
func connOptions[O any](fn string, nc *nats.Conn, opts []O, apply func(O, *options) error) (options, error) {
	o, err := applyOptions(defaults(), opts, apply)
	if err == nil && nc == nil {
		err = fmt.Errorf("%w: %s needs a connection", ErrInvalidOption, fn)
	}
	return o, err
}

// atLeastOne is an option, named name in errors, that sets an integer n
// of at least 1 (want says so in the error).
func atLeastOne(name string, n int, want string, set func(*options)) option {
	return option(func(o *options) error {
		if n < 1 {
			return fmt.Errorf("%w: %s(%d): %s", ErrInvalidOption, name, n, want)
		}
		set(o)
		return nil
	})
}

// positive is an option, named name in errors, that sets a positive
// duration d.
func positive(name string, d time.Duration, set func(*options)) option {
	return option(func(o *options) error {
		if d <= 0 {
			return fmt.Errorf("%w: %s(%v): want a positive duration", ErrInvalidOption, name, d)
		}
		set(o)
		return nil
	})
}

// bound returns ctx bounded by WithTimeout's timeout if it has no deadline
// of its own; the caller must call cancel.
func (o options) bound(ctx context.Context) (_ context.Context, cancel context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, o.timeout)
}

// defaults are the options of a call given none.
func defaults() options {
	return options{
		concurrency:    defaultConcurrency,
		timeout:        defaultTimeout,
		retry:          1,
		attemptTimeout: defaultAttemptTimeout,
		logger:         slog.Default(),
		bucket:         defaultBucket,
		heartbeat:      defaultHeartbeat,
		createBucket:   true,
	}
}

// applyOptions applies opts to o in order, each with apply (the method
// of the call's interface, such as ServeOption.applyServe).
func applyOptions[O any](o options, opts []O, apply func(O, *options) error) (options, error) {
	for _, opt := range opts {
		if any(opt) == nil {
			return o, fmt.Errorf("%w: nil option", ErrInvalidOption)
		}
		if err := apply(opt, &o); err != nil {
			return o, err
		}
	}
	return o, nil
}

// WithQueue makes [Serve] or [Subscribe] join queue group group: each
// message goes to one member of the group. Default: "goxfer" for Serve;
// none for Subscribe (every Subscription gets every offer); group not
// empty.
func WithQueue(group string) QueueOption {
	return option(func(o *options) error {
		if group == "" {
			return fmt.Errorf("%w: WithQueue needs a queue group name", ErrInvalidOption)
		}
		o.queue = &group
		return nil
	})
}

// WithConcurrency bounds how many [Handler] calls a [Service] runs at
// once; further requests wait in the subscription's pending buffer.
// Honoured by Serve. Default: 64; n at least 1.
func WithConcurrency(n int) ServeOption {
	return atLeastOne("WithConcurrency", n, "want at least 1", func(o *options) { o.concurrency = n })
}

// WithHeader adds the application headers h to what [Request] or
// [Publish] sends; names starting with "Goxfer-" are reserved and dropped.
// Every call the option is given to reads h then, so h must not change
// while such a call runs; no call keeps it. Default: none.
func WithHeader(h nats.Header) SendOption {
	return option(func(o *options) error {
		if o.header == nil {
			o.header = nats.Header{}
		}
		addAppHeader(o.header, h)
		return nil
	})
}

// WithTimeout bounds a [Request] (retries included) or the flush of a
// [Publish] when its ctx has no deadline; a ctx deadline always wins.
// Default: 10 s; d positive.
func WithTimeout(d time.Duration) SendOption {
	return positive("WithTimeout", d, func(o *options) { o.timeout = d })
}

// WithRetry makes [Request] try up to attempts times in all, retrying only
// failures after which the request cannot have been handled or its outcome
// was lost; a Handler may then see a request twice. Default: 1 (no
// retry); attempts at least 1.
func WithRetry(attempts int) RequestOption {
	return atLeastOne("WithRetry", attempts, "want at least 1 attempt", func(o *options) { o.retry = attempts })
}

// WithAttemptTimeout bounds each attempt of a [Request] made with
// [WithRetry] above 1; without retries, ctx bounds the one attempt.
// Default: 2 s; d positive.
func WithAttemptTimeout(d time.Duration) RequestOption {
	return positive("WithAttemptTimeout", d, func(o *options) { o.attemptTimeout = d })
}

// WithLogger sets where a [Service] or a [Registry] logs. Honoured by
// [Serve] and [OpenRegistry]. Default: [slog.Default] at the call; l not
// nil.
func WithLogger(l *slog.Logger) LoggerOption {
	return option(func(o *options) error {
		if l == nil {
			return fmt.Errorf("%w: WithLogger needs a logger", ErrInvalidOption)
		}
		o.logger = l
		return nil
	})
}

// WithBucket names the presence registry's JetStream key-value bucket;
// every process sharing a registry must use the same name. Honoured by
// [OpenRegistry]. Default: "goxfer_agents"; letters, digits, '_' and '-'.
func WithBucket(name string) RegistryOption {
	return option(func(o *options) error {
		if !validBucket(name) {
			return fmt.Errorf("%w: WithBucket(%q): want a name of [A-Za-z0-9_-]", ErrInvalidOption, name)
		}
		o.bucket = name
		return nil
	})
}

// WithHeartbeat sets how often a [Member] re-puts its entry; peers declare
// it departed after two heartbeats of silence. Given to [OpenRegistry] it
// is the default of [Registry.Join] and sets the TTL of a bucket the
// registry creates (3 heartbeats); given to Join, that Member's. Default:
// 1 s; d from 10 ms to 1 h.
func WithHeartbeat(d time.Duration) HeartbeatOption {
	return option(func(o *options) error {
		if d < minHeartbeat || d > maxHeartbeat {
			return fmt.Errorf("%w: WithHeartbeat(%v): want %v to %v", ErrInvalidOption, d, minHeartbeat, maxHeartbeat)
		}
		o.heartbeat = d
		return nil
	})
}

// WithCreateBucket says whether the registry creates its bucket when it
// is missing, at [OpenRegistry] or later; with false a missing bucket is an
// error matching [ErrRegistry]. Honoured by OpenRegistry. Default: true.
func WithCreateBucket(create bool) RegistryOption {
	return option(func(o *options) error {
		o.createBucket = create
		return nil
	})
}

// WithReplicas sets how many servers of a cluster store a bucket the
// registry creates; a bucket that exists keeps its own. Honoured by
// [OpenRegistry]. Default: 3 when the server the connection is on belongs
// to a cluster ([nats.Conn.ConnectedClusterName] is not empty), so that
// the registry survives the loss of one server, and 1 otherwise; when a
// cluster has fewer than three JetStream servers online (JetStream answers
// "no suitable peers for placement" or "insufficient resources"), that
// default falls back to 1, logging a warning that names this option. n
// from 1 to 5; a given n is used as is.
func WithReplicas(n int) RegistryOption {
	return option(func(o *options) error {
		if n < 1 || n > 5 {
			return fmt.Errorf("%w: WithReplicas(%d): want 1 to 5", ErrInvalidOption, n)
		}
		o.replicas = n
		return nil
	})
}

func validBucket(name string) bool {
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		switch c := name[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}
