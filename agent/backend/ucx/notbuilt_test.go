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
	var _ agent.Counting = b
}
