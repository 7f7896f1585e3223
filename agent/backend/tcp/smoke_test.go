package tcp_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/tcp"
)

func pair(t testing.TB, opts ...tcp.Option) (a, b *agent.Agent) {
	t.Helper()
	a, err := agent.New(agent.WithBackends(tcp.New(opts...)))
	require.NoError(t, err)
	b, err = agent.New(agent.WithBackends(tcp.New(opts...)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close(); _ = b.Close() })
	return a, b
}

func TestSmokeReadWrite(t *testing.T) {
	a, b := pair(t)
	for _, size := range []int{1, 4096, 3<<20 + 7} {
		src := make([]byte, size)
		for i := range src {
			src[i] = byte(i * 7)
		}
		exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
		require.NoError(t, err)
		dst := make([]byte, size)
		x, err := b.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: exp.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}, Notify: []byte("ok")})
		require.NoError(t, err)
		<-x.Done()
		require.NoError(t, x.Err())
		require.True(t, bytes.Equal(src, dst))
		select {
		case ev := <-exp.Events():
			require.Equal(t, "ok", string(ev.Msg))
		case <-time.After(5 * time.Second):
			t.Fatal("no notification")
		}
		exp.Revoke()

		wexp, err := a.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(dst)})
		require.NoError(t, err)
		clear(dst)
		x, err = b.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: a.Info(), Key: wexp.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(src), Remote: agent.DRAM(dst).Region}}})
		require.NoError(t, err)
		<-x.Done()
		require.NoError(t, x.Err())
		wexp.Revoke() // the passive side reads its memory only after revoking (or its completion event)
		require.True(t, bytes.Equal(src, dst))
	}
}
