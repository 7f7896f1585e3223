package promconnect

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/goxfer/goxfer/connect"
)

// ErrInvalidOption is wrapped by the errors of [New] for invalid options.
var ErrInvalidOption = errors.New("promconnect: invalid option")

// ErrRegistered is returned by a second [Collector.Register].
var ErrRegistered = errors.New("promconnect: collector already registered")

// Default histogram buckets.
var (
	// DefaultDurationBuckets, in seconds: 10 µs to about 42 s, ×4 apart;
	// an in-process copy of a few KiB to a GiB over a slow link.
	DefaultDurationBuckets = prometheus.ExponentialBuckets(10e-6, 4, 12)
	// DefaultSizeBuckets, in bytes: 4 KiB to 4 GiB, ×4 apart; a KV block
	// to a whole prompt's KV cache.
	DefaultSizeBuckets = prometheus.ExponentialBuckets(4<<10, 4, 11)
)

// Option configures a [Collector]; see [New].
type Option interface{ apply(*options) error }

type optionFunc func(*options) error

func (f optionFunc) apply(o *options) error { return f(o) }

type options struct {
	duration, size []float64
}

// WithDurationBuckets sets the upper bounds, in seconds, of the buckets of
// goxfer_operation_duration_seconds; they must increase.
//
// Default: [DefaultDurationBuckets].
func WithDurationBuckets(b ...float64) Option {
	return optionFunc(func(o *options) error {
		if err := checkBuckets(b); err != nil {
			return fmt.Errorf("%w: WithDurationBuckets: %w", ErrInvalidOption, err)
		}
		o.duration = slices.Clone(b)
		return nil
	})
}

// WithSizeBuckets sets the upper bounds, in bytes, of the buckets of
// goxfer_operation_bytes; they must increase.
//
// Default: [DefaultSizeBuckets].
func WithSizeBuckets(b ...float64) Option {
	return optionFunc(func(o *options) error {
		if err := checkBuckets(b); err != nil {
			return fmt.Errorf("%w: WithSizeBuckets: %w", ErrInvalidOption, err)
		}
		o.size = slices.Clone(b)
		return nil
	})
}

func checkBuckets(b []float64) error {
	if len(b) == 0 {
		return errors.New("want at least one bucket")
	}
	for i := 1; i < len(b); i++ {
		if b[i] <= b[i-1] {
			return fmt.Errorf("bucket %d: %g does not exceed %g", i, b[i], b[i-1])
		}
	}
	return nil
}

// Collector is a [prometheus.Collector] of one Connector's metrics. Make
// one with [New], pass its Observe to [connect.WithObserver] when creating
// the Connector, then [Collector.Register] it with the Connector. It is
// safe for concurrent use.
type Collector struct {
	operations *prometheus.CounterVec
	duration   *prometheus.HistogramVec
	size       *prometheus.HistogramVec

	mu   sync.Mutex
	conn *connect.Connector // whose Stats are read at each scrape; nil until Register
}

// Labels of the per-operation metrics.
var opLabels = []string{"kind", "role", "backend", "path"}

// The metrics read from connect.Stats at each scrape.
var (
	refusedDesc = prometheus.NewDesc("goxfer_refused_total",
		"Remote accesses the Connector's agent refused: forged or revoked tokens, out-of-range addresses, the wrong access kind, malformed requests.", nil, nil)
	droppedDesc = prometheus.NewDesc("goxfer_dropped_notifications_total",
		"Notifications that arrived for no known operation, or while its queue was full.", nil, nil)
	lostDesc = prometheus.NewDesc("goxfer_lost_notifications_total",
		"Completion notifications this side could not send after its transfer succeeded (the connection broke); the peer saw ErrRemoteLost.", nil, nil)
	registeredDesc = prometheus.NewDesc("goxfer_registered_regions",
		"Memory regions registered with the backends now.", nil, nil)
	exposedDesc = prometheus.NewDesc("goxfer_exposures",
		"Passive operations and exposures whose memory is exposed to peers now.", nil, nil)
	inFlightDesc = prometheus.NewDesc("goxfer_transfers_in_flight",
		"Transfers posted and not yet finished.", nil, nil)

	backendCounters = []struct {
		desc  *prometheus.Desc
		value func(connect.BackendStats) uint64
	}{
		{backendDesc("disconnected", "Connections the backend dropped on a peer's account: the sum of the kinds below, as far as they cost a connection."),
			func(s connect.BackendStats) uint64 { return s.Disconnected }},
		{backendDesc("handshake_failures", "Connections whose handshake was malformed, named another agent or none, or was abandoned."),
			func(s connect.BackendStats) uint64 { return s.HandshakeFailures }},
		{backendDesc("protocol_errors", "Malformed or out-of-place frames, in either direction."),
			func(s connect.BackendStats) uint64 { return s.ProtocolErrors }},
		{backendDesc("limit_rejected", "Connections closed or requests dropped for going over a limit."),
			func(s connect.BackendStats) uint64 { return s.LimitRejected }},
		{backendDesc("timeouts", "Connections cut because a peer was silent, too slow, or left a request unanswered."),
			func(s connect.BackendStats) uint64 { return s.Timeouts }},
		{backendDesc("denied", "Requests answered \"access denied\", the connection kept."),
			func(s connect.BackendStats) uint64 { return s.Denied }},
	}
)

func backendDesc(name, help string) *prometheus.Desc {
	return prometheus.NewDesc("goxfer_backend_"+name+"_total", help, []string{"backend"}, nil)
}

// New returns a Collector with no Connector yet: until [Collector.Register]
// it collects only what its Observe was told. Invalid options fail with an
// error wrapping [ErrInvalidOption].
func New(opts ...Option) (*Collector, error) {
	o := options{duration: DefaultDurationBuckets, size: DefaultSizeBuckets}
	for _, opt := range opts {
		if err := opt.apply(&o); err != nil {
			return nil, err
		}
	}
	return &Collector{
		operations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "goxfer_operations_total",
			Help: "Operations finished, by outcome (status: complete, cancelled, errored). Passive operations have no backend; active ones that could not start have none either.",
		}, append(slices.Clone(opLabels), "status")),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "goxfer_operation_duration_seconds",
			Help:    "Duration of completed operations: active, from Begin to the last byte in place; passive, from Create to the outcome, the wait for a peer included.",
			Buckets: o.duration,
		}, opLabels),
		size: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "goxfer_operation_bytes",
			Help:    "Bytes of completed operations.",
			Buckets: o.size,
		}, opLabels),
	}, nil
}

// Observe counts r, and for a completed operation records its duration
// and size. Give it to [connect.WithObserver]; it never blocks for long
// and is safe for concurrent use.
func (c *Collector) Observe(r connect.OpReport) {
	kind, role := kindLabel(r.Kind), r.Role.String()
	c.operations.WithLabelValues(kind, role, r.Backend, r.Path, statusLabel(r.Status)).Inc()
	if r.Status != connect.StatusComplete {
		return
	}
	c.duration.WithLabelValues(kind, role, r.Backend, r.Path).Observe(r.Duration.Seconds())
	c.size.WithLabelValues(kind, role, r.Backend, r.Path).Observe(float64(r.Bytes))
}

// kindLabel is the kind label's value for k.
func kindLabel(k connect.OperationKind) string {
	switch k {
	case connect.KindRead:
		return "read"
	case connect.KindWrite:
		return "write"
	}
	return strings.ToLower(k.String())
}

// statusLabel is the status label's value for s.
func statusLabel(s connect.Status) string {
	switch s {
	case connect.StatusComplete:
		return "complete"
	case connect.StatusCancelled:
		return "cancelled"
	case connect.StatusErrored:
		return "errored"
	}
	return strings.ToLower(s.String())
}

// Register ties the Collector to conn, whose [connect.Connector.Stats]
// it then reads at each scrape, and registers it with reg. conn should be
// the Connector given Observe. It fails for a nil conn, with
// [ErrRegistered] when the Collector is registered already, and with
// reg's error (a [prometheus.AlreadyRegisteredError] when reg holds
// another Collector's metrics of the same names and labels).
func (c *Collector) Register(reg prometheus.Registerer, conn *connect.Connector) error {
	if conn == nil {
		return errors.New("promconnect: Register needs a Connector")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn != nil {
		return ErrRegistered
	}
	c.conn = conn
	if err := reg.Register(c); err != nil {
		c.conn = nil
		return err
	}
	return nil
}

// Describe sends the descriptions of every metric the Collector may
// collect. It is part of [prometheus.Collector].
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	c.operations.Describe(ch)
	c.duration.Describe(ch)
	c.size.Describe(ch)
	for _, d := range []*prometheus.Desc{refusedDesc, droppedDesc, lostDesc, registeredDesc, exposedDesc, inFlightDesc} {
		ch <- d
	}
	for _, b := range backendCounters {
		ch <- b.desc
	}
}

// Collect sends the per-operation metrics and, once registered, the
// Connector's counters as they are now. It is part of
// [prometheus.Collector].
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	c.operations.Collect(ch)
	c.duration.Collect(ch)
	c.size.Collect(ch)
	c.mu.Lock()
	conn := c.conn
	c.mu.Unlock()
	if conn == nil {
		return
	}
	st := conn.Stats()
	ch <- prometheus.MustNewConstMetric(refusedDesc, prometheus.CounterValue, float64(st.Refused))
	ch <- prometheus.MustNewConstMetric(droppedDesc, prometheus.CounterValue, float64(st.DroppedNotifications))
	ch <- prometheus.MustNewConstMetric(lostDesc, prometheus.CounterValue, float64(st.LostNotifications))
	ch <- prometheus.MustNewConstMetric(registeredDesc, prometheus.GaugeValue, float64(st.Registered))
	ch <- prometheus.MustNewConstMetric(exposedDesc, prometheus.GaugeValue, float64(st.Exposed))
	ch <- prometheus.MustNewConstMetric(inFlightDesc, prometheus.GaugeValue, float64(st.InFlight))
	for name, bs := range st.Backends {
		for _, b := range backendCounters {
			ch <- prometheus.MustNewConstMetric(b.desc, prometheus.CounterValue, float64(b.value(bs)), name)
		}
	}
}
