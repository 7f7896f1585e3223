//go:build !ucx

package ucx_test

import (
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/ucx"
)

func TestNotBuiltIn(t *testing.T) {
	require.False(t, ucx.BuiltIn())
	a, err := agent.New(agent.WithBackends(ucx.New()))
	require.Nil(t, a)
	require.ErrorIs(t, err, ucx.ErrNotBuiltIn)
	assert.Contains(t, err.Error(), "rebuild with -tags ucx against libucx-dev")
}

func TestNotBuiltInCounters(t *testing.T) {
	b := ucx.New()
	b.PeerDeparted(uuid.New(), agent.ErrRemoteLost) // nothing to drop
	assert.Equal(t, ucx.Stats{}, b.Stats())
	assert.Equal(t, map[string]uint64{"disconnected": 0, "handshake_failures": 0, "protocol_errors": 0,
		"limit_rejected": 0, "timeouts": 0, "denied": 0}, b.Counters())
}
