package nats

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/connect"
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
