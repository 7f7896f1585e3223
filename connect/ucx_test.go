package connect_test

import (
	"context"
	"errors"
	"testing"
	"time"

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
		require.ErrorIs(t, err, connect.ErrInvalidOption)
	})
	if ucx.BuiltIn() {
		t.Run("BuiltIn", func(t *testing.T) {
			c, err := connect.NewConnector(connect.WithUCX(), connect.WithBackend(ucx.Name))
			require.NoError(t, err)
			require.NoError(t, c.Close())
		})
		t.Run("Transfers", func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			passive, err := connect.NewConnector(connect.WithUCX())
			require.NoError(t, err)
			defer func() { assert.NoError(t, passive.Close()) }()
			active, err := connect.NewConnector(connect.WithUCX(), connect.WithBackend(ucx.Name))
			require.NoError(t, err)
			defer func() { assert.NoError(t, active.Close()) }()

			// 64 KiB and 1 MiB blocks: above the inline size, so over RMA.
			src := [][]byte{make([]byte, 64<<10), make([]byte, 1<<20)}
			for i, b := range src {
				for j := range b {
					b[j] = byte(i*7 + j*13)
				}
			}
			rd, err := passive.CreateReadable(ctx, connect.NewDescriptor(src[0]), connect.NewDescriptor(src[1]))
			require.NoError(t, err)
			dst := [][]byte{make([]byte, 64<<10), make([]byte, 1<<20)}
			rop, err := active.BeginRead(ctx, rd.Metadata(), connect.NewDescriptor(dst[0]), connect.NewDescriptor(dst[1]))
			require.NoError(t, err)
			require.NoError(t, rop.Wait(ctx))
			require.NoError(t, rd.Wait(ctx))
			assert.Equal(t, ucx.Name, rop.Backend())
			assert.Equal(t, src, dst)
			require.NoError(t, rd.Close())

			wr, err := passive.CreateWritable(ctx, connect.NewDescriptor(dst[1]))
			require.NoError(t, err)
			msg := make([]byte, 1<<20)
			for j := range msg {
				msg[j] = byte(j * 31)
			}
			wop, err := active.BeginWrite(ctx, wr.Metadata(), connect.NewDescriptor(msg))
			require.NoError(t, err)
			require.NoError(t, wop.Wait(ctx))
			require.NoError(t, wr.Wait(ctx))
			assert.Equal(t, msg, dst[1])
			require.NoError(t, wr.Close())
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
