//go:build unix

package main

import (
	"bytes"
	"net/http"
	"regexp"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// scrapeMetrics GETs a worker's /metrics and parses the text exposition
// format.
func scrapeMetrics(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	return fams
}

// sumWhere adds up the counter or histogram sample count of family name
// over its metrics whose labels include want.
func sumWhere(fams map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	var sum float64
	for _, m := range fams[name].GetMetric() {
		have := map[string]string{}
		for _, lp := range m.GetLabel() {
			have[lp.GetName()] = lp.GetValue()
		}
		match := true
		for k, v := range want {
			match = match && have[k] == v
		}
		if !match {
			continue
		}
		if h := m.GetHistogram(); h != nil {
			sum += float64(h.GetSampleCount())
		} else {
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

var metricsLine = regexp.MustCompile(`metrics: (http://\S+/metrics)`)

// A prefill worker started with -metrics serves /metrics: after a decode
// worker's READs it counts and times each one it exposed, with the
// Connector's gauges and the Go runtime's metrics beside them.
func TestMetricsSeparateWorkers(t *testing.T) {
	srv, err := natsserver.Start(t.Context())
	require.NoError(t, err)
	t.Cleanup(srv.Shutdown)

	prefill := start(t, append([]string{"-role", "prefill", "-nats", srv.URL(), "-metrics", "127.0.0.1:0"}, small...)...)
	url := metricsLine.FindStringSubmatch(prefill.await(`metrics: http://`))[1]
	prefill.await(`ready: READ requests`)

	code, out := run1(t, append([]string{"-role", "decode", "-nats", srv.URL(), "-requests", "3", "-metrics", "127.0.0.1:0"}, small...)...)
	require.Equal(t, 0, code, "exit status")
	assert.Contains(t, out, "summary: 3 of 3 requests verified")
	assert.Regexp(t, metricsLine, out, "the decode worker serves metrics too")

	// The prefill worker records each outcome as its Wait takes it, just
	// after the reader's transfer ends.
	read := map[string]string{"kind": "read", "role": "passive", "status": "complete"}
	var fams map[string]*dto.MetricFamily
	require.Eventually(t, func() bool {
		fams = scrapeMetrics(t, url)
		return sumWhere(fams, "goxfer_operations_total", read) == 3
	}, 10*time.Second, 10*time.Millisecond, "3 READs of the prefill worker's blocks")
	delete(read, "status")
	assert.Equal(t, 3.0, sumWhere(fams, "goxfer_operation_duration_seconds", read))
	assert.Equal(t, 3.0, sumWhere(fams, "goxfer_operation_bytes", read))
	assert.Zero(t, sumWhere(fams, "goxfer_operations_total", map[string]string{"role": "active"}), "in READ mode the prefill worker moves no bytes")
	for _, name := range []string{"goxfer_refused_total", "goxfer_registered_regions", "goxfer_transfers_in_flight", "go_goroutines", "process_resident_memory_bytes"} {
		assert.Contains(t, fams, name)
	}

	require.NoError(t, prefill.cmd.Process.Signal(syscall.SIGTERM))
	assert.Equal(t, 0, prefill.wait(), "exit status of a prefill worker told to stop")
}

// Without -role, each worker serves its own metrics: with port 0 each
// takes a free one, and says which.
func TestMetricsOrchestrator(t *testing.T) {
	t.Parallel()
	code, out := run1(t, append([]string{"-requests", "2", "-metrics", "127.0.0.1:0"}, small...)...)
	require.Equal(t, 0, code, "exit status")
	requireAllVerified(t, out, 2)
	assert.Regexp(t, `(?m)^\[prefill\] metrics: http://127\.0\.0\.1:\d+/metrics$`, out)
	assert.Regexp(t, `(?m)^\[decode\] metrics: http://127\.0\.0\.1:\d+/metrics$`, out)
}

func TestMetricsAddr(t *testing.T) {
	for _, tc := range []struct {
		base string
		i    int
		want string
	}{
		{":9090", 0, ":9090"},
		{":9090", 1, ":9091"},
		{":9090", 4, ":9094"}, // -prefill 3 -decode 2: decode-2
		{"127.0.0.1:0", 1, "127.0.0.1:0"},
		{"[::1]:8080", 1, "[::1]:8081"},
	} {
		got, err := metricsAddr(tc.base, tc.i)
		require.NoError(t, err)
		assert.Equal(t, tc.want, got, "%s, worker %d", tc.base, tc.i)
	}
	for _, base := range []string{"9090", ":http", ":-1", ":70000"} {
		_, err := metricsAddr(base, 0)
		assert.Error(t, err, base)
	}
	_, err := metricsAddr(":65535", 1)
	assert.ErrorContains(t, err, "would need port 65536")

	var stdout, stderr bytes.Buffer
	assert.Equal(t, 2, run([]string{"-metrics", "9090"}, &stdout, &stderr))
	assert.Contains(t, stderr.String(), `-metrics "9090": want host:port or :port`)
}
