package natsserver_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// A three-server cluster forms with an R3 stream possible at once; a
// client on a killed server fails over to the others, the stream keeps
// its data and quorum with one server down, and the server restarted on
// the same ports and store catches up.
func TestClusterKillRestart(t *testing.T) {
	start := time.Now()
	c, err := natsserver.StartCluster(t.Context(), 3)
	require.NoError(t, err)
	defer c.Shutdown()
	t.Logf("3 servers formed in %v", time.Since(start).Round(time.Millisecond))
	require.Equal(t, 3, c.Len())
	urls := c.URLs()
	require.Len(t, urls, 3)
	for _, u := range urls {
		assert.Regexp(t, `^nats://127\.0\.0\.1:\d+$`, u)
	}
	assert.Equal(t, strings.Join(urls, ","), c.ClientURL())

	// Connected to server 0 first, the client fails over when it dies.
	nc, err := nats.Connect(c.ClientURL(), nats.DontRandomize(), nats.ReconnectWait(10*time.Millisecond), nats.MaxReconnects(-1))
	require.NoError(t, err)
	defer nc.Close()
	require.Equal(t, urls[0], nc.ConnectedUrl())
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "b", Replicas: 3})
	require.NoError(t, err, "R3 right after StartCluster")
	_, err = kv.PutString(ctx, "k", "v1")
	require.NoError(t, err)

	moved := nc.StatusChanged(nats.CONNECTED)
	defer nc.RemoveStatusListener(moved)
	assert.GreaterOrEqual(t, c.MetaLeader(), 0)
	require.NoError(t, c.Kill(0))
	require.NoError(t, c.Kill(0), "killing a killed server does nothing")
	select {
	case <-moved:
	case <-ctx.Done():
		t.Fatal("the client did not fail over")
	}
	assert.NotEqual(t, urls[0], nc.ConnectedUrl())
	// Two of three keep the quorum: writes go on.
	require.Eventually(t, func() bool {
		_, err := kv.PutString(ctx, "k", "v2")
		return err == nil
	}, 20*time.Second, 50*time.Millisecond, "no write with one server of three down")

	require.NoError(t, c.Restart(ctx, 0))
	assert.Equal(t, urls, c.URLs(), "same ports after Restart")
	nc0, err := c.Server(0).Connect()
	require.NoError(t, err)
	defer nc0.Close()
	js0, err := jetstream.New(nc0)
	require.NoError(t, err)
	kv0, err := js0.KeyValue(ctx, "b")
	require.NoError(t, err)
	e, err := kv0.Get(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, "v2", string(e.Value()))

	c.Shutdown()
	c.Shutdown()
	assert.Error(t, c.Kill(1))
	assert.Error(t, c.Restart(ctx, 1))
}

// Every server has its own store under WithStoreDir's directory, kept
// after Shutdown; the WithServerOptions functions see each server's
// cluster settings.
func TestClusterStoreDirsAndOptions(t *testing.T) {
	dir := t.TempDir()
	var names []string
	c, err := natsserver.StartCluster(t.Context(), 2, natsserver.WithStoreDir(dir), natsserver.WithServerOptions(func(o *server.Options) {
		names = append(names, o.ServerName+"@"+o.Cluster.Name)
		assert.Len(t, o.Routes, 1)
	}))
	require.NoError(t, err)
	c.Shutdown()
	assert.Equal(t, []string{"goxfer-0@goxfer", "goxfer-1@goxfer"}, names)
	for _, name := range []string{"goxfer-0", "goxfer-1"} {
		entries, err := os.ReadDir(filepath.Join(dir, name))
		require.NoError(t, err)
		assert.NotEmpty(t, entries)
	}
}

func TestClusterArguments(t *testing.T) {
	for _, n := range []int{0, 17} {
		_, err := natsserver.StartCluster(t.Context(), n)
		assert.Error(t, err)
	}
	_, err := natsserver.StartCluster(t.Context(), 3, natsserver.WithPort(4222))
	assert.ErrorContains(t, err, "WithPort")
	_, err = natsserver.StartCluster(t.Context(), 3, nil)
	assert.Error(t, err)

	c, err := natsserver.StartCluster(t.Context(), 2, natsserver.WithoutJetStream())
	require.NoError(t, err)
	defer c.Shutdown()
	assert.Error(t, c.Kill(2))
	assert.Error(t, c.Kill(-1))
	assert.Equal(t, -1, c.MetaLeader(), "no JetStream")
}

// ctx bounds the start; a cluster not formed in time is shut down.
func TestClusterStartCancelled(t *testing.T) {
	ctx, cancel := context.WithCancelCause(t.Context())
	stop := errors.New("stopped by the test")
	cancel(stop)
	c, err := natsserver.StartCluster(ctx, 3)
	if err == nil {
		c.Shutdown()
	}
	require.ErrorIs(t, err, stop)
}
