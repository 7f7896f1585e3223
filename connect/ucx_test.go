package connect_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backend/ucx"
	"github.com/goxfer/goxfer/connect"
)

func TestWithUCX(t *testing.T) {
	t.Run("Conflicts", func(t *testing.T) {
		_, err := connect.NewConnector(connect.WithBackends(mem.New()), connect.WithUCX())
		require.ErrorIs(t, err, connect.ErrInvalidOption)
	})
	t.Run("InvalidOption", func(t *testing.T) {
		_, err := connect.NewConnector(connect.WithUCX(ucx.WithTimeout(1)))
		require.ErrorIs(t, err, connect.ErrInvalidOption)
		require.ErrorIs(t, err, ucx.ErrInvalidOption)
	})
	if ucx.BuiltIn() {
		t.Run("BuiltIn", func(t *testing.T) {
			c, err := connect.NewConnector(connect.WithUCX(), connect.WithBackend(ucx.Name))
			require.NoError(t, err)
			require.NoError(t, c.Close())
		})
		return
	}
	t.Run("NotBuiltIn", func(t *testing.T) {
		c, err := connect.NewConnector(connect.WithUCX(ucx.WithTransports("tcp,self")))
		require.ErrorIs(t, err, ucx.ErrNotBuiltIn)
		require.Nil(t, c)
		assert.Contains(t, err.Error(), "-tags ucx")
	})
	t.Run("ForcedNotBuiltIn", func(t *testing.T) {
		_, err := connect.NewConnector(connect.WithBackend(ucx.Name))
		require.ErrorIs(t, err, connect.ErrInvalidOption)
		require.True(t, errors.Is(err, ucx.ErrNotBuiltIn), "%v", err)
	})
}
