package nats

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
)

// Option configures a call of this package. There is one Option type for
// every function; each function documents which options it honours and
// ignores the others. Invalid options make the function fail with an error
// matching [ErrInvalidOption]. An Option is a value: it may be shared and
// reused, concurrently too. The defaults are those of a call given no
// options; docs/nats.md gives each option's rationale.
type Option interface{ apply(*options) error }

type optionFunc func(*options) error

func (f optionFunc) apply(o *options) error { return f(o) }

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
	replicas       int
}

// connOptions applies opts for fn, a function that needs a connection: nc
// must not be nil.
func connOptions(fn string, nc *nats.Conn, opts []Option) (options, error) {
	o, err := newOptions(opts)
	if err == nil && nc == nil {
		err = fmt.Errorf("%w: %s needs a connection", ErrInvalidOption, fn)
	}
	return o, err
}

// atLeastOne is an Option, named name in errors, that sets an integer n
// of at least 1 (want says so in the error).
func atLeastOne(name string, n int, want string, set func(*options)) Option {
	return optionFunc(func(o *options) error {
		if n < 1 {
			return fmt.Errorf("%w: %s(%d): %s", ErrInvalidOption, name, n, want)
		}
		set(o)
		return nil
	})
}

// positive is an Option, named name in errors, that sets a positive
// duration d.
func positive(name string, d time.Duration, set func(*options)) Option {
	return optionFunc(func(o *options) error {
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

func newOptions(opts []Option) (options, error) {
	o := options{
		concurrency:    defaultConcurrency,
		timeout:        defaultTimeout,
		retry:          1,
		attemptTimeout: defaultAttemptTimeout,
		logger:         slog.Default(),
		bucket:         defaultBucket,
		heartbeat:      defaultHeartbeat,
		createBucket:   true,
		replicas:       1,
	}
	for _, opt := range opts {
		if opt == nil {
			return o, fmt.Errorf("%w: nil Option", ErrInvalidOption)
		}
		if err := opt.apply(&o); err != nil {
			return o, err
		}
	}
	return o, nil
}

// WithQueue makes [Serve] or [Subscribe] join queue group group: each
// message goes to one member of the group. Default: "goxfer" for Serve;
// none for Subscribe (every Subscription gets every offer); group not
// empty.
func WithQueue(group string) Option {
	return optionFunc(func(o *options) error {
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
func WithConcurrency(n int) Option {
	return atLeastOne("WithConcurrency", n, "want at least 1", func(o *options) { o.concurrency = n })
}

// WithHeader adds the application headers h to what [Request] or
// [Publish] sends; names starting with "Goxfer-" are reserved and dropped.
// Every call the Option is given to reads h then, so h must not change
// while such a call runs; no call keeps it. Default: none.
func WithHeader(h nats.Header) Option {
	return optionFunc(func(o *options) error {
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
func WithTimeout(d time.Duration) Option {
	return positive("WithTimeout", d, func(o *options) { o.timeout = d })
}

// WithRetry makes [Request] try up to attempts times in all, retrying only
// failures after which the request cannot have been handled or its outcome
// was lost; a Handler may then see a request twice. Default: 1 (no
// retry); attempts at least 1.
func WithRetry(attempts int) Option {
	return atLeastOne("WithRetry", attempts, "want at least 1 attempt", func(o *options) { o.retry = attempts })
}

// WithAttemptTimeout bounds each attempt of a [Request] made with
// [WithRetry] above 1; without retries, ctx bounds the one attempt.
// Default: 2 s; d positive.
func WithAttemptTimeout(d time.Duration) Option {
	return positive("WithAttemptTimeout", d, func(o *options) { o.attemptTimeout = d })
}

// WithLogger sets where a [Service] or a [Registry] logs. Honoured by
// [Serve] and [OpenRegistry]. Default: [slog.Default] at the call; l not
// nil.
func WithLogger(l *slog.Logger) Option {
	return optionFunc(func(o *options) error {
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
func WithBucket(name string) Option {
	return optionFunc(func(o *options) error {
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
func WithHeartbeat(d time.Duration) Option {
	return optionFunc(func(o *options) error {
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
func WithCreateBucket(create bool) Option {
	return optionFunc(func(o *options) error {
		o.createBucket = create
		return nil
	})
}

// WithReplicas sets how many servers of a cluster store a bucket the
// registry creates. Honoured by [OpenRegistry]. Default: 1; n from 1 to 5.
func WithReplicas(n int) Option {
	return optionFunc(func(o *options) error {
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
