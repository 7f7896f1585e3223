//go:build ucx

package ucx

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/testproc"
)

// Notify never blocks: it queues the notification, and a ctx already done
// fails it with the context's cause.
func TestNotifyContext(t *testing.T) {
	_, ua := newUCXAgent(t)
	b, _ := newUCXAgent(t)
	exp, err := b.Expose(agent.AccessRead, []agent.Local{agent.DRAM(make([]byte, 64))})
	require.NoError(t, err)
	defer exp.Revoke()

	cause := errors.New("caller gave up")
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(cause)
	err = ua.Notify(ctx, b.Info(), exp.Key(), []byte("late"))
	require.ErrorIs(t, err, cause)

	require.NoError(t, ua.Notify(context.Background(), b.Info(), exp.Key(), []byte("hi")))
	select {
	case ev := <-exp.Events():
		require.Equal(t, "hi", string(ev.Msg)) // and not "late"
	case <-time.After(5 * time.Second):
		t.Fatal("no notification")
	}
}

// A dropped connection is logged at Debug on the agent's logger.
func TestDropLogged(t *testing.T) {
	var logs testproc.Buffer // the progress thread writes to it
	a, err := agent.New(agent.WithBackends(New()),
		agent.WithLogger(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))))
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })
	b, _ := newUCXAgent(t)
	src := make([]byte, 64)
	exp, err := b.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	defer exp.Revoke()
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: b.Info(), Key: exp.Key(),
		Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 64)), Remote: agent.DRAM(src).Region}}})
	require.NoError(t, err)
	<-x.Done()
	require.NoError(t, x.Err())
	a.PeerDeparted(b.ID(), errors.New("registry: flapped"))
	require.Eventually(t, func() bool {
		s := logs.String()
		return strings.Contains(s, "ucx: dropped a connection") && strings.Contains(s, "flapped")
	}, 5*time.Second, time.Millisecond, "log: %s", logs.String())
}
