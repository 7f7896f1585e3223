package nats

import (
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Err reports every cause, each member whose heartbeats fail among them,
// on one line.
func TestRegistryErrIsOneLine(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv))
	a, b := newConnector(t), newConnector(t)
	join(t, r, a)
	join(t, r, b)

	// From now on the bucket refuses every put.
	js, err := jetstream.New(dial(t, srv))
	require.NoError(t, err)
	st, err := js.Stream(guarded(t), "KV_"+defaultBucket)
	require.NoError(t, err)
	cfg := st.CachedInfo().Config
	cfg.MaxMsgSize = 1
	_, err = js.UpdateStream(guarded(t), cfg)
	require.NoError(t, err)

	require.Eventually(t, func() bool {
		err := r.Err()
		return err != nil && strings.Count(err.Error(), "heartbeat of agent") == 2
	}, hangGuard, time.Millisecond)
	err = r.Err()
	t.Log(err)
	require.ErrorIs(t, err, ErrRegistry)
	assert.NotContains(t, err.Error(), "\n")
	assert.Contains(t, err.Error(), a.AgentInfo().ID().String())
	assert.Contains(t, err.Error(), b.AgentInfo().ID().String())
}
