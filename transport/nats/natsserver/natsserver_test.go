package natsserver_test

import (
	"context"
	"errors"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestStartRestartShutdown(t *testing.T) {
	srv, err := natsserver.Start(t.Context())
	require.NoError(t, err)
	url := srv.URL()
	assert.Regexp(t, `^nats://127\.0\.0\.1:\d+$`, url)

	nc, err := srv.Connect(nats.ReconnectWait(10*time.Millisecond), nats.MaxReconnects(-1))
	require.NoError(t, err)
	defer nc.Close()
	js, err := nc.JetStream()
	require.NoError(t, err)
	_, err = js.AddStream(&nats.StreamConfig{Name: "S", Subjects: []string{"s"}})
	require.NoError(t, err)
	_, err = js.Publish("s", []byte("kept"))
	require.NoError(t, err)

	back := nc.StatusChanged(nats.CONNECTED)
	defer nc.RemoveStatusListener(back)
	require.NoError(t, srv.Restart())
	assert.Equal(t, url, srv.URL(), "same port after Restart")
	select {
	case <-back:
	case <-time.After(30 * time.Second):
		t.Fatal("the client did not reconnect")
	}
	m, err := js.GetLastMsg("S", "s")
	require.NoError(t, err, "JetStream keeps its store across Restart")
	assert.Equal(t, "kept", string(m.Data))

	srv.Shutdown()
	srv.Shutdown()
	require.Error(t, srv.Restart())
}

func TestStoreDirIsKept(t *testing.T) {
	dir := t.TempDir()
	srv, err := natsserver.Start(t.Context(), natsserver.WithStoreDir(dir), natsserver.WithHost("localhost"))
	require.NoError(t, err)
	assert.Regexp(t, `^nats://localhost:\d+$`, srv.URL())
	srv.Shutdown()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.NotEmpty(t, entries)
}

func TestOptions(t *testing.T) {
	for _, opt := range []natsserver.Option{natsserver.WithPort(0), natsserver.WithHost(""), natsserver.WithStoreDir(""), natsserver.WithServerOptions(nil), nil} {
		_, err := natsserver.Start(t.Context(), opt)
		assert.Error(t, err)
	}
	srv, err := natsserver.Start(t.Context(), natsserver.WithoutJetStream(), natsserver.WithServerOptions(func(o *server.Options) { o.MaxPayload = 4096 }))
	require.NoError(t, err)
	defer srv.Shutdown()
	nc, err := srv.Connect()
	require.NoError(t, err)
	defer nc.Close()
	assert.Equal(t, int64(4096), nc.MaxPayload())
	js, err := nc.JetStream()
	require.NoError(t, err)
	_, err = js.AccountInfo()
	assert.Error(t, err, "JetStream is off")
}

// A port already taken fails at once, saying so, rather than after the
// wait for a server that never listens.
func TestStartOnBusyPort(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	port := l.Addr().(*net.TCPAddr).Port

	start := time.Now()
	srv, err := natsserver.Start(t.Context(), natsserver.WithPort(port))
	elapsed := time.Since(start)
	if err == nil {
		srv.Shutdown()
	}
	require.Error(t, err)
	assert.Contains(t, err.Error(), "address in use")
	assert.Contains(t, err.Error(), l.Addr().String())
	assert.ErrorIs(t, err, syscall.EADDRINUSE)
	assert.Less(t, elapsed, 2*time.Second, "fails at once, not after the readiness wait")
}

// ctx bounds the start.
func TestStartCancelled(t *testing.T) {
	ctx, cancel := context.WithCancelCause(t.Context())
	stop := errors.New("stopped by the test")
	cancel(stop)
	srv, err := natsserver.Start(ctx)
	if err == nil {
		srv.Shutdown()
	}
	require.ErrorIs(t, err, stop)
}
