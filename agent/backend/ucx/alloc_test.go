//go:build ucx

package ucx_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/ucx"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// pairOf is [backendtest.Pair], returning the backends too.
func pairOf(t testing.TB, opts ...ucx.Option) (a, b *agent.Agent, ua, ub *ucx.Backend) {
	t.Helper()
	ua, ub = ucx.New(opts...), ucx.New(opts...)
	return backendtest.NewAgent(t, ua), backendtest.NewAgent(t, ub), ua, ub
}

func TestAllocOwnership(t *testing.T) {
	_, err := ucx.New().Alloc(4096)
	require.Error(t, err, "Alloc before Start")

	a, _, ua, _ := pairOf(t)
	_, err = ua.Alloc(0)
	require.ErrorIs(t, err, agent.ErrInvalid)

	buf, err := ua.Alloc(1 << 20)
	require.NoError(t, err)
	require.Len(t, buf, 1<<20)
	for i := range buf { // the memory is ours to write
		buf[i] = byte(i)
	}
	require.ErrorIs(t, ua.Free(make([]byte, 16)), ucx.ErrNotAllocated, "Go memory")

	// Registered regions inside the block keep it: Free refuses.
	reg, err := a.Register(agent.DRAM(buf[4096:8192]), agent.DRAM(buf))
	require.NoError(t, err)
	require.ErrorIs(t, ua.Free(buf), ucx.ErrInUse)
	require.NoError(t, reg.Release())

	require.NoError(t, ua.Free(buf))
	require.ErrorIs(t, ua.Free(buf), ucx.ErrNotAllocated, "double Free")

	// Close frees what is left; Free afterwards says so.
	left, err := ua.Alloc(4096)
	require.NoError(t, err)
	require.NoError(t, a.Close())
	require.ErrorIs(t, ua.Free(left), ucx.ErrNotAllocated)
	_, err = ua.Alloc(4096)
	require.Error(t, err)
}

// TestAllocTransfers moves bytes between memory from Alloc on both sides,
// by RMA and inline, and between Alloc memory and Go memory.
func TestAllocTransfers(t *testing.T) {
	a, b, ua, ub := pairOf(t, ucx.WithLeaseSize(256<<10))
	for _, size := range []int{4096, 3<<20 + 5} {
		src, err := ua.Alloc(size)
		require.NoError(t, err)
		for i := range src {
			src[i] = byte(i * 13)
		}
		for _, goMem := range []bool{false, true} {
			var dst []byte
			if goMem {
				dst = make([]byte, size)
			} else {
				dst, err = ub.Alloc(size)
				require.NoError(t, err)
			}
			clear(dst)
			regA, err := a.Register(agent.DRAM(src))
			require.NoError(t, err)
			exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
			require.NoError(t, err)
			regB, err := b.Register(agent.DRAM(dst))
			require.NoError(t, err)
			x, err := b.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: exp.Key(),
				Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}})
			require.NoError(t, err)
			backendtest.DoneWithin(t, x, 20*time.Second, "READ")
			require.NoError(t, x.Err())
			require.True(t, bytes.Equal(src, dst), "READ of %d bytes, Go memory %v", size, goMem)
			exp.Revoke()

			// WRITE back into the first half of src's block.
			wexp, err := a.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(src[:size/2])})
			require.NoError(t, err)
			for i := range dst {
				dst[i] = byte(i * 7)
			}
			x, err = b.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: a.Info(), Key: wexp.Key(),
				Segments: []agent.Segment{{Local: agent.DRAM(dst[:size/2]), Remote: agent.DRAM(src[:size/2]).Region}}})
			require.NoError(t, err)
			backendtest.DoneWithin(t, x, 20*time.Second, "WRITE")
			require.NoError(t, x.Err())
			require.True(t, bytes.Equal(src[:size/2], dst[:size/2]))
			wexp.Revoke()
			require.NoError(t, regB.Release())
			require.NoError(t, regA.Release())
			for i := range src {
				src[i] = byte(i * 13)
			}
			if !goMem {
				require.NoError(t, ub.Free(dst))
			}
		}
		require.NoError(t, ua.Free(src))
	}
}

// TestInlineChecks: an inline transfer is checked like any other.
func TestInlineChecks(t *testing.T) {
	a, b := backendtest.Pair(t, ucx.New)
	mem := make([]byte, 8192)
	exp, err := a.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(mem[:4096])})
	require.NoError(t, err)
	defer exp.Revoke()
	src := bytes.Repeat([]byte{7}, 8192)
	// Out of range: refused, and nothing written.
	x, err := b.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: a.Info(), Key: exp.Key(),
		Segments: []agent.Segment{{Local: agent.DRAM(src[:4096]), Remote: agent.DRAM(mem[:4096]).Region},
			{Local: agent.DRAM(src[4096:4100]), Remote: agent.DRAM(mem[4096:4100]).Region}}})
	require.NoError(t, err)
	<-x.Done()
	require.ErrorIs(t, x.Err(), agent.ErrAccessDenied)
	require.Equal(t, make([]byte, 8192), mem, "a refused inline WRITE wrote nothing")
	// A READ of a WRITE exposure is refused too.
	x, err = b.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: exp.Key(),
		Segments: []agent.Segment{{Local: agent.DRAM(src[:64]), Remote: agent.DRAM(mem[:64]).Region}}})
	require.NoError(t, err)
	<-x.Done()
	require.ErrorIs(t, x.Err(), agent.ErrAccessDenied)
}
