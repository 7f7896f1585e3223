package backendtest

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// The helpers below serve a backend package's own tests, beside the suite
// that [Run] runs.

// NewAgent starts an agent on bs and closes it, ignoring Close's error,
// when the test ends.
func NewAgent(t testing.TB, bs ...agent.Backend) *agent.Agent {
	t.Helper()
	a, err := agent.New(agent.WithBackends(bs...))
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })
	return a
}

// Pair starts two agents with [NewAgent], each on a backend of its own
// that newBackend makes with opts (a backend package's New).
func Pair[B agent.Backend, O any](t testing.TB, newBackend func(...O) B, opts ...O) (a, b *agent.Agent) {
	t.Helper()
	return NewAgent(t, newBackend(opts...)), NewAgent(t, newBackend(opts...))
}

// Smoke is a backend's first test, on two agents of one backend each: for
// 1 B, 4 KiB and 3 MiB+7, b READs a buffer a exposes, with a bound
// notification, then WRITEs it back into another exposure of a. It checks
// the bytes, the notification, and that the READ went over the backend a
// publishes first. With register, a registers the exposed buffer first
// (and releases it after the WRITE).
func Smoke(t *testing.T, a, b *agent.Agent, register bool) {
	t.Helper()
	backend := a.Info().Conns[0].Backend
	for _, size := range []int{1, 4096, 3<<20 + 7} {
		src := make([]byte, size)
		for i := range src {
			src[i] = byte(i * 7)
		}
		var reg *agent.Registration
		if register {
			var err error
			reg, err = a.Register(agent.DRAM(src))
			require.NoError(t, err)
		}
		exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
		require.NoError(t, err)
		dst := make([]byte, size)
		x, err := b.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: exp.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}, Notify: []byte("ok")})
		require.NoError(t, err)
		<-x.Done()
		require.NoError(t, x.Err())
		require.Equal(t, backend, x.Backend())
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
		if reg != nil {
			require.NoError(t, reg.Release())
		}
	}
}

// EndsEarly is a Backend whose Host.Context the test can end on its own,
// before the agent does (which it does just before Backend.Close), to see
// what the backend does when its lifetime ends while it still serves.
type EndsEarly struct {
	agent.Backend
	// End cancels the Host.Context the backend was started with; set by
	// Start.
	End context.CancelCauseFunc
}

// Start starts the backend on h, with a Context that End also cancels.
func (b *EndsEarly) Start(h agent.Host) ([]byte, error) {
	ctx, cancel := context.WithCancelCause(h.Context())
	b.End = cancel
	return b.Backend.Start(earlyHost{Host: h, ctx: ctx})
}

type earlyHost struct {
	agent.Host
	ctx context.Context
}

func (h earlyHost) Context() context.Context { return h.ctx }
