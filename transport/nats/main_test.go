package nats

import (
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		// A cross-process test's child: serve the parent, then exit.
		os.Exit(runChild(os.Stdin, os.Stdout))
	}
	goleak.VerifyTestMain(m)
}

// hangGuard bounds every test's blocking calls: far beyond what any of
// them needs, it only turns a hang into a failure.
const hangGuard = 30 * time.Second

var quietLog = slog.New(slog.DiscardHandler)

func guarded(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	t.Cleanup(cancel)
	return ctx
}

// startServer starts an embedded server, shut down when the test ends.
func startServer(t testing.TB, opts ...natsserver.Option) *natsserver.Server {
	t.Helper()
	srv, err := natsserver.Start(opts...)
	require.NoError(t, err)
	t.Cleanup(srv.Shutdown)
	return srv
}

// resilient are client options for tests that restart the server: retry
// reconnecting quickly and forever.
var resilient = []nats.Option{nats.ReconnectWait(20 * time.Millisecond), nats.MaxReconnects(-1), nats.ReconnectJitter(0, 0)}

// dial connects to srv; the connection closes when the test ends.
func dial(t testing.TB, srv *natsserver.Server, opts ...nats.Option) *nats.Conn {
	t.Helper()
	nc, err := srv.Connect(opts...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

func newConnector(t testing.TB, opts ...connect.Option) *connect.Connector {
	t.Helper()
	c, err := connect.NewConnector(append([]connect.Option{connect.WithLogger(quietLog)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, c.Close()) })
	return c
}

// readable exposes b on c for reading; the operation closes when the test
// ends.
func readable(t testing.TB, c *connect.Connector, b []byte) *connect.ReadableOperation {
	t.Helper()
	op, err := c.CreateReadable(context.Background(), connect.NewDescriptor(b))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, op.Close()) })
	return op
}
