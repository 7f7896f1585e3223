package promconnect

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/connect"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// side is a Connector with its Collector, registered in reg under the
// label side=name.
func side(t *testing.T, reg prometheus.Registerer, name string, opts ...connect.Option) *connect.Connector {
	t.Helper()
	m, err := New()
	require.NoError(t, err)
	conn, err := connect.NewConnector(append(opts, connect.WithObserver(m.Observe))...)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, conn.Close()) })
	require.NoError(t, m.Register(prometheus.WrapRegistererWith(prometheus.Labels{"side": name}, reg), conn))
	return conn
}

// scrape GETs url and parses the Prometheus text exposition format.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, resp.Header.Get("Content-Type"), "text/plain")
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	return fams
}

// metric returns the metric of family name whose labels include want (a
// label missing counts as empty), failing unless there is exactly one.
func metric(t *testing.T, fams map[string]*dto.MetricFamily, name string, want map[string]string) *dto.Metric {
	t.Helper()
	fam, ok := fams[name]
	require.True(t, ok, "no metric family %s", name)
	var found []*dto.Metric
	for _, m := range fam.GetMetric() {
		have := map[string]string{}
		for _, lp := range m.GetLabel() {
			have[lp.GetName()] = lp.GetValue()
		}
		match := true
		for k, v := range want {
			if have[k] != v {
				match = false
			}
		}
		if match {
			found = append(found, m)
		}
	}
	require.Len(t, found, 1, "%s%v", name, want)
	return found[0]
}

// labels builds a label set from pairs.
func labels(kv ...string) map[string]string {
	m := map[string]string{}
	for i := 0; i < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return m
}

func buffers(seed byte, sizes ...int) []connect.Descriptor {
	ds := make([]connect.Descriptor, len(sizes))
	for i, n := range sizes {
		b := make([]byte, n)
		for j := range b {
			b[j] = seed + byte(j)
		}
		ds[i] = connect.NewDescriptor(b)
	}
	return ds
}

// Real transfers over tcp between two Connectors in this process, then a
// scrape of /metrics: the operation counters and histogram counts match
// the operations done on each side, the refused READ shows in the passive
// side's counters, and nothing is left open.
func TestScrapeAfterTransfers(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	reg := prometheus.NewPedanticRegistry()
	passive := side(t, reg, "passive")
	active := side(t, reg, "active", connect.WithBackend("tcp"))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()

	sizes := []int{64 << 10, 4 << 10}
	const opBytes = 68 << 10
	const reads, writes = 3, 2
	for i := range reads + writes {
		var pop interface {
			Metadata() connect.Metadata
			Wait(context.Context) error
			Close() error
		}
		var err error
		if i < reads {
			pop, err = passive.CreateReadable(ctx, buffers(byte(i), sizes...)...)
		} else {
			pop, err = passive.CreateWritable(ctx, buffers(0, sizes...)...)
		}
		require.NoError(t, err)
		if i < reads {
			op, err := active.BeginRead(ctx, pop.Metadata(), buffers(0, sizes...)...)
			require.NoError(t, err)
			require.NoError(t, op.Wait(ctx))
		} else {
			op, err := active.BeginWrite(ctx, pop.Metadata(), buffers(byte(i), sizes...)...)
			require.NoError(t, err)
			require.NoError(t, op.Wait(ctx))
		}
		require.NoError(t, pop.Wait(ctx))
		require.NoError(t, pop.Close())
	}
	// A READ of a closed operation's token: refused.
	pop, err := passive.CreateReadable(ctx, buffers(1, 4096)...)
	require.NoError(t, err)
	require.NoError(t, pop.Close())
	op, err := active.BeginRead(ctx, pop.Metadata(), buffers(0, 4096)...)
	require.NoError(t, err)
	require.ErrorIs(t, op.Wait(ctx), connect.ErrAccessDenied)
	// The reader tells the passive side of its failure, from a goroutine of
	// its own; the operation is gone, so the notice is dropped.
	require.Eventually(t, func() bool { return passive.Stats().DroppedNotifications == 1 }, 10*time.Second, time.Millisecond)

	fams := scrape(t, srv.URL)
	ops := "goxfer_operations_total"
	for _, tc := range []struct {
		side, kind, backend, status string
		want                        float64
	}{
		{"active", "read", "tcp", "complete", reads},
		{"active", "write", "tcp", "complete", writes},
		{"active", "read", "tcp", "errored", 1},
		{"passive", "read", "", "complete", reads},
		{"passive", "write", "", "complete", writes},
		{"passive", "read", "", "cancelled", 1}, // closed unused
	} {
		role := tc.side
		l := labels("side", tc.side, "kind", tc.kind, "role", role, "backend", tc.backend, "path", tc.backend, "status", tc.status)
		assert.Equal(t, tc.want, metric(t, fams, ops, l).GetCounter().GetValue(), "%s%v", ops, l)
	}
	for _, tc := range []struct {
		side, kind, backend string
		n                   uint64
	}{
		{"active", "read", "tcp", reads},
		{"active", "write", "tcp", writes},
		{"passive", "read", "", reads},
		{"passive", "write", "", writes},
	} {
		l := labels("side", tc.side, "kind", tc.kind, "role", tc.side, "backend", tc.backend, "path", tc.backend)
		d := metric(t, fams, "goxfer_operation_duration_seconds", l).GetHistogram()
		assert.Equal(t, tc.n, d.GetSampleCount(), "duration %v", l)
		assert.Positive(t, d.GetSampleSum())
		s := metric(t, fams, "goxfer_operation_bytes", l).GetHistogram()
		assert.Equal(t, tc.n, s.GetSampleCount(), "bytes %v", l)
		assert.Equal(t, float64(tc.n*opBytes), s.GetSampleSum(), "bytes %v", l)
	}
	assert.Len(t, fams["goxfer_operation_duration_seconds"].GetMetric(), 4, "failures are counted, not timed")

	assert.Equal(t, 1.0, metric(t, fams, "goxfer_refused_total", labels("side", "passive")).GetCounter().GetValue())
	assert.Equal(t, 0.0, metric(t, fams, "goxfer_refused_total", labels("side", "active")).GetCounter().GetValue())
	assert.Equal(t, 1.0, metric(t, fams, "goxfer_backend_denied_total", labels("side", "passive", "backend", "tcp")).GetCounter().GetValue())
	assert.Equal(t, 0.0, metric(t, fams, "goxfer_backend_disconnected_total", labels("side", "passive", "backend", "tcp")).GetCounter().GetValue())
	for _, s := range []string{"passive", "active"} {
		for _, g := range []string{"goxfer_registered_regions", "goxfer_exposures", "goxfer_transfers_in_flight"} {
			assert.Equal(t, 0.0, metric(t, fams, g, labels("side", s)).GetGauge().GetValue(), "%s on the %s side", g, s)
		}
	}
	assert.Equal(t, 1.0, metric(t, fams, "goxfer_dropped_notifications_total", labels("side", "passive")).GetCounter().GetValue())
	assert.Equal(t, 0.0, metric(t, fams, "goxfer_dropped_notifications_total", labels("side", "active")).GetCounter().GetValue())
	for _, s := range []string{"passive", "active"} {
		assert.Equal(t, 0.0, metric(t, fams, "goxfer_lost_notifications_total", labels("side", s)).GetCounter().GetValue(), "no notification lost on the %s side", s)
	}
}

// A scrape while memory is exposed shows it in the gauges.
func TestScrapeGauges(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	conn := side(t, reg, "passive")
	pop, err := conn.CreateReadable(t.Context(), buffers(1, 4096, 4096)...)
	require.NoError(t, err)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	fams := scrape(t, srv.URL)
	assert.Equal(t, 2.0, metric(t, fams, "goxfer_registered_regions", nil).GetGauge().GetValue())
	assert.Equal(t, 1.0, metric(t, fams, "goxfer_exposures", nil).GetGauge().GetValue())
	require.NoError(t, pop.Close())
	fams = scrape(t, srv.URL)
	assert.Equal(t, 0.0, metric(t, fams, "goxfer_exposures", nil).GetGauge().GetValue())
}

// The metrics follow Prometheus's naming conventions.
func TestLint(t *testing.T) {
	m, err := New()
	require.NoError(t, err)
	conn, err := connect.NewConnector()
	require.NoError(t, err)
	defer func() { assert.NoError(t, conn.Close()) }()
	m.Observe(connect.OpReport{Kind: connect.KindRead, Role: connect.RoleActive, Backend: "tcp", Path: "tcp", Bytes: 1, Status: connect.StatusComplete})
	require.NoError(t, m.Register(prometheus.NewRegistry(), conn))
	problems, err := testutil.CollectAndLint(m)
	require.NoError(t, err)
	assert.Empty(t, problems)
}

func TestOptionsAndRegisterErrors(t *testing.T) {
	for _, opt := range []Option{WithDurationBuckets(), WithDurationBuckets(1, 1), WithSizeBuckets(2, 1)} {
		_, err := New(opt)
		require.ErrorIs(t, err, ErrInvalidOption)
	}
	m, err := New(WithDurationBuckets(0.001, 1), WithSizeBuckets(1024))
	require.NoError(t, err)
	m.Observe(connect.OpReport{Kind: connect.KindWrite, Role: connect.RolePassive, Bytes: 4096, Duration: time.Second, Status: connect.StatusComplete})
	n, err := testutil.GatherAndCount(gatherer(t, m), "goxfer_operation_bytes")
	require.NoError(t, err)
	assert.Equal(t, 1, n)

	conn, err := connect.NewConnector()
	require.NoError(t, err)
	defer func() { assert.NoError(t, conn.Close()) }()
	reg := prometheus.NewRegistry()
	as := func(name string) prometheus.Registerer {
		return prometheus.WrapRegistererWith(prometheus.Labels{"connector": name}, reg)
	}
	require.Error(t, m.Register(as("1"), nil))
	require.NoError(t, m.Register(as("1"), conn))
	require.ErrorIs(t, m.Register(as("1"), conn), ErrRegistered)

	// Another Collector's metrics clash in the same registry unless
	// they carry another label value.
	other, err := New()
	require.NoError(t, err)
	var are prometheus.AlreadyRegisteredError
	require.ErrorAs(t, other.Register(as("1"), conn), &are)
	require.NoError(t, other.Register(as("2"), conn), "a failed Register leaves it unregistered")
}

// gatherer registers c alone in a fresh registry.
func gatherer(t *testing.T, c prometheus.Collector) prometheus.Gatherer {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	return reg
}

// The core packages never link Prometheus: only this package does.
func TestCoreDoesNotImportPrometheus(t *testing.T) {
	goBin, err := exec.LookPath("go")
	require.NoError(t, err, "the test runs go list")
	out, err := exec.CommandContext(t.Context(), goBin, "list", "-deps",
		"github.com/goxfer/goxfer/connect", "github.com/goxfer/goxfer/agent/...", "github.com/goxfer/goxfer/transport/...").CombinedOutput()
	require.NoError(t, err, "%s", out)
	deps := strings.Fields(string(out))
	require.Contains(t, deps, "github.com/goxfer/goxfer/connect")
	for _, d := range deps {
		assert.NotContains(t, d, "prometheus", "a core package depends on %s", d)
	}
}

// What Observe adds to each finished operation.
func BenchmarkObserve(b *testing.B) {
	m, err := New()
	require.NoError(b, err)
	r := connect.OpReport{Kind: connect.KindRead, Role: connect.RoleActive, Backend: "tcp", Path: "tcp", Bytes: 1 << 20, Duration: time.Millisecond, Status: connect.StatusComplete}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			m.Observe(r)
		}
	})
}
