package nats

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/testproc"
)

// BenchmarkRequestToken measures a NATS request/reply carrying a token:
// the worker exposes a buffer (CreateReadable) and replies with its token,
// the requester decodes the reply; the operation is then closed. It reports
// the token's size; the transfer itself is connect's to measure.
func BenchmarkRequestToken(b *testing.B) {
	srv := startServer(b)
	c := newConnector(b)
	block := make([]byte, 64<<10)
	ops := make(chan *connect.ReadableOperation, 1)
	s, err := Serve(dial(b, srv), "bench.kv", func(ctx context.Context, _ *ServiceRequest) (*Reply, error) {
		op, err := c.CreateReadable(ctx, connect.NewDescriptor(block))
		if err != nil {
			return nil, err
		}
		ops <- op
		return &Reply{Metadata: op.Metadata()}, nil
	}, WithLogger(quietLog))
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, s.Close()) })
	nc := dial(b, srv)
	ctx := context.Background()

	var tokenBytes int
	b.ReportAllocs()
	for b.Loop() {
		rep, err := Request(ctx, nc, "bench.kv", nil)
		if err != nil {
			b.Fatal(err)
		}
		tokenBytes = rep.Metadata.EncodedLen()
		if err := (<-ops).Close(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(tokenBytes), "token-bytes")
}

// BenchmarkTokenRequest splits a token request into what NATS costs and
// what goxfer adds. A worker, in this process ("local") or in a child
// process ("process", as cmd/goxfer-bench's target), serves three
// subjects on one connection (see startTokenWorker); the requester calls
// them on another. Each case runs in batches alternating with batches of
// the baseline, a raw nats.go request/reply to the same worker whose reply
// is a token message's size (a plain subscription that answers from its
// callback), and reports both p50s and the median over the pairs of
// batches of their ratio ("x-raw"):
//
//   - raw: the baseline against itself (how far apart two identical
//     paths measure);
//   - service: Request to a Service whose Handler answers a fixed token
//     (goxfer's request/reply machinery, no Connector);
//   - token: the Handler creates a readable operation per request
//     (CreateReadable + Metadata), as cmd/goxfer-bench's token service
//     does.
//
// ns/op and allocs/op cover both sides of the pairs; the p50s are each
// side's own.
func BenchmarkTokenRequest(b *testing.B) {
	srv := startServer(b)
	requester := dial(b, srv)
	ctx := context.Background()
	var body int // the raw reply's size
	rawCall := func() error {
		m, err := requester.RequestWithContext(ctx, "bench.raw", nil)
		if err == nil && len(m.Data) != body {
			b.Fatalf("raw reply of %d bytes, want %d", len(m.Data), body)
		}
		return err
	}
	request := func(subject string) func() error {
		return func() error {
			_, err := Request(ctx, requester, subject, nil)
			return err
		}
	}
	for _, where := range []string{"local", "process"} {
		b.Run(where, func(b *testing.B) {
			if where == "local" {
				stop, err := startTokenWorker(dial(b, srv), newConnector(b))
				require.NoError(b, err)
				b.Cleanup(stop)
			} else {
				var hello benchWorkerHello
				p := testproc.Spawn(b, benchWorkerEnv, &hello, func(cmd *exec.Cmd) {
					cmd.Env = append(cmd.Env, benchWorkerURLEnv+"="+srv.URL())
				})
				b.Cleanup(func() {
					if err := p.Stop(); err != nil {
						b.Errorf("bench worker: %v; stderr:\n%s", err, p.Stderr())
					}
				})
				require.Empty(b, hello.Err)
			}
			m, err := requester.Request("bench.raw", nil, hangGuard)
			require.NoError(b, err)
			body = len(m.Data)
			for _, tc := range []struct {
				name string
				call func() error
			}{
				{"raw", rawCall},
				{"service", request("bench.service")},
				{"token", request("bench.token")},
			} {
				b.Run(tc.name, func(b *testing.B) { benchPaired(b, tc.call, rawCall) })
			}
		})
	}
}

// startTokenWorker serves BenchmarkTokenRequest's subjects on nc:
// bench.raw answers every request with a token message's bytes from a
// plain subscription's callback; bench.service is a Service answering a
// fixed token; bench.token a Service exposing a 4 KiB buffer per request
// with c (CreateReadable), each operation closed at once by a goroutine
// of its own, off the reply's path (nobody uses the tokens). stop
// ends them all.
func startTokenWorker(nc *nats.Conn, c *connect.Connector) (stop func(), err error) {
	var stops []func()
	stop = func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	defer func() {
		if err != nil {
			stop()
		}
	}()
	block := make([]byte, 4096)
	fixed, err := c.CreateReadable(context.Background(), connect.NewDescriptor(block))
	if err != nil {
		return nil, err
	}
	stops = append(stops, func() { _ = fixed.Close() })
	body, err := encodeMessage(fixed.Metadata(), nil)
	if err != nil {
		return nil, err
	}
	raw, err := nc.Subscribe("bench.raw", func(m *nats.Msg) { _ = m.Respond(body) })
	if err != nil {
		return nil, err
	}
	stops = append(stops, func() { _ = raw.Unsubscribe() })
	svc, err := Serve(nc, "bench.service", func(context.Context, *ServiceRequest) (*Reply, error) {
		return &Reply{Metadata: fixed.Metadata()}, nil
	}, WithLogger(quietLog))
	if err != nil {
		return nil, err
	}
	stops = append(stops, func() { _ = svc.Close() })
	ops := make(chan *connect.ReadableOperation, 64)
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		for op := range ops {
			_ = op.Close()
		}
	}()
	stops = append(stops, func() { close(ops); <-closed })
	tok, err := Serve(nc, "bench.token", func(ctx context.Context, _ *ServiceRequest) (*Reply, error) {
		op, err := c.CreateReadable(ctx, connect.NewDescriptor(block))
		if err != nil {
			return nil, err
		}
		ops <- op
		return &Reply{Metadata: op.Metadata()}, nil
	}, WithLogger(quietLog))
	if err != nil {
		return nil, err
	}
	stops = append(stops, func() { _ = tok.Close() })
	return stop, nc.Flush()
}

// The benchmark's worker process: the test binary, started with
// benchWorkerEnv set (see init), serves startTokenWorker's subjects on the
// server at benchWorkerURLEnv until its stdin closes.
const (
	benchWorkerEnv    = "GOXFER_NATS_BENCH_WORKER"
	benchWorkerURLEnv = "GOXFER_NATS_BENCH_URL"
)

// benchWorkerHello is the worker's first line: Err says why it could not
// serve.
type benchWorkerHello struct{ Err string }

func init() {
	if os.Getenv(benchWorkerEnv) != "" {
		os.Exit(runBenchWorker())
	}
}

func runBenchWorker() int {
	enc := json.NewEncoder(os.Stdout)
	fail := func(err error) int {
		_ = enc.Encode(benchWorkerHello{Err: err.Error()})
		return 1
	}
	nc, err := nats.Connect(os.Getenv(benchWorkerURLEnv))
	if err != nil {
		return fail(err)
	}
	defer nc.Close()
	c, err := connect.NewConnector(connect.WithLogger(quietLog))
	if err != nil {
		return fail(err)
	}
	defer c.Close()
	stop, err := startTokenWorker(nc, c)
	if err != nil {
		return fail(err)
	}
	defer stop()
	if err := enc.Encode(benchWorkerHello{}); err != nil {
		return 1
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}

// pairedBatch is how many calls of one side run in a row.
const pairedBatch = 50

// benchPaired runs call and base in alternating batches of pairedBatch,
// timing each call, and reports each side's p50 and the median over the
// pairs of batches of the ratio of their p50s.
func benchPaired(b *testing.B, call, base func() error) {
	b.Helper()
	for range pairedBatch { // warm both paths up
		if err := call(); err != nil {
			b.Fatal(err)
		}
		if err := base(); err != nil {
			b.Fatal(err)
		}
	}
	var calls, bases []time.Duration
	var ratios []float64
	batch := make([]time.Duration, 0, pairedBatch)
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		f := call
		if (i/pairedBatch)%2 == 1 {
			f = base
		}
		t0 := time.Now()
		if err := f(); err != nil {
			b.Fatal(err)
		}
		batch = append(batch, time.Since(t0))
		i++
		if i%pairedBatch != 0 {
			continue
		}
		if (i/pairedBatch)%2 == 1 {
			calls = append(calls, batch...)
		} else {
			bases = append(bases, batch...)
			ratios = append(ratios, float64(median(calls[len(calls)-pairedBatch:]))/float64(median(batch)))
		}
		batch = batch[:0]
	}
	if len(ratios) == 0 {
		return // too few iterations for one pair (-benchtime too short)
	}
	b.ReportMetric(float64(median(calls))/1e3, "p50-µs")
	b.ReportMetric(float64(median(bases))/1e3, "raw-p50-µs")
	b.ReportMetric(median(ratios), "x-raw")
}

// median returns the median of vs, which it sorts.
func median[T time.Duration | float64](vs []T) T {
	slices.Sort(vs)
	return vs[len(vs)/2]
}
