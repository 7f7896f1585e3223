package connect

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/shm"
)

// AllocHost's contract, in one process: zeroed memory of the size asked,
// which Free refuses while an exposure of it is open and frees once it is
// closed; errors off Linux, for bad sizes and on a closed Connector.
func TestAllocHost(t *testing.T) {
	c := newConnector(t)
	if runtime.GOOS != "linux" {
		_, err := c.AllocHost(4096)
		require.ErrorIs(t, err, shm.ErrUnsupported)
		return
	}
	for _, size := range []int{0, -1} {
		_, err := c.AllocHost(size)
		require.ErrorIs(t, err, shm.ErrInvalid, "size %d", size)
	}

	buf, err := c.AllocHost(3<<20 + 5)
	require.NoError(t, err)
	b := buf.Bytes()
	require.Len(t, b, 3<<20+5)
	require.Equal(t, 3<<20+5, cap(b))
	for i, x := range b {
		if x != 0 {
			require.Failf(t, "not zeroed", "byte %d is %#x", i, x)
		}
	}

	op, err := c.CreateReadable(t.Context(), NewDescriptor(b[4096:8192]))
	require.NoError(t, err)
	require.ErrorIs(t, buf.Free(), shm.ErrBusy, "Free while an exposure is open")
	b[0] = 1 // still ours
	require.NoError(t, op.Close())
	require.NoError(t, buf.Free())
	require.NoError(t, buf.Free(), "freeing again")

	closed := startConnector(t)
	require.NoError(t, closed.Close())
	_, err = closed.AllocHost(4096)
	require.ErrorIs(t, err, ErrClosed)
}
