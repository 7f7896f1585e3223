//go:build linux

package cma

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// postTo starts a one-segment READ of peer under ctx.
func postTo(ctx context.Context, a *agent.Agent, peer agent.Info) error {
	buf := make([]byte, 16)
	_, err := a.Post(ctx, agent.Request{Op: agent.OpRead, Peer: peer, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(buf), Remote: agent.Region{Addr: 4096, Len: 16}}}})
	return err
}

// A peer whose socket accepts and stays silent: every caller returns when
// its own context ends, whoever started the probe, and once the probe has
// timed out its verdict is cached, so the silent socket costs one timeout.
func TestReachableHonoursContext(t *testing.T) {
	a, b := newAgent(t, WithTimeout(2*time.Second))
	s := newSilentPeer(t)
	short := func(name string) (context.Context, error) {
		cause := errors.New(name)
		ctx, cancel := context.WithTimeoutCause(context.Background(), 50*time.Millisecond, cause)
		t.Cleanup(cancel)
		return ctx, cause
	}

	// The first caller starts the probe and gives up at its deadline.
	ctx, cause := short("first caller's deadline")
	err := postTo(ctx, a, s.info)
	require.ErrorIs(t, err, cause, "the first caller returns when its context ends")

	// A caller waiting for the probe in flight keeps its own deadline.
	waited := make(chan error, 1)
	go func() { waited <- postTo(context.Background(), a, s.info) }()
	ctx, cause = short("second caller's deadline")
	err = postTo(ctx, a, s.info)
	require.ErrorIs(t, err, cause, "a caller waiting on another's probe returns when its context ends")

	// The probe times out once; its failure is the verdict for everyone.
	err = <-waited
	require.ErrorIs(t, err, agent.ErrNoBackend)
	require.ErrorIs(t, err, agent.ErrRemoteLost)
	err = postTo(context.Background(), a, s.info)
	require.ErrorIs(t, err, agent.ErrRemoteLost, "the failed verdict is cached")
	assert.EqualValues(t, 1, s.accepts.Load(), "the silent socket is dialled once")

	// Once the verdict expires, the next caller probes again.
	b.mu.Lock()
	b.retry = 0
	b.mu.Unlock()
	ctx, cause = short("caller's deadline after the verdict expired")
	err = postTo(ctx, a, s.info)
	require.ErrorIs(t, err, cause)
	require.Eventually(t, func() bool { return s.accepts.Load() == 2 }, 5*time.Second, time.Millisecond)
}

// The agent chooses cma for a transfer because Reachable found the peer
// connected; if that connection is forgotten before Post (the peer departed)
// Post and Notify fail at once with ErrRemoteLost rather than wait, without
// the caller's context, for a new probe of a peer that may be frozen.
func TestPostAfterPeerForgottenFailsFast(t *testing.T) {
	_, ab := newAgent(t, WithTimeout(5*time.Second))
	g := newGatedExposer(t)
	g.gate <- struct{}{} // the first handshake is answered
	require.NoError(t, ab.Reachable(context.Background(), g.info))
	ab.PeerDeparted(g.info.ID, errors.New("registry: entry deleted"))
	check := func(what string) {
		t.Helper()
		start := time.Now()
		require.ErrorIs(t, ab.Notify(context.Background(), g.info, agent.NewKey(), []byte("x")), agent.ErrRemoteLost, what)
		require.ErrorIs(t, ab.Post(&agent.Work{Op: agent.OpRead, Peer: g.info}), agent.ErrRemoteLost, what)
		assert.Less(t, time.Since(start), time.Second, "%s: Post and Notify waited for a new probe", what)
	}
	check("forgotten")
	// A new probe, which the exposer leaves unanswered, is no connection
	// either.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = ab.Reachable(ctx, g.info) }()
	require.Eventually(t, func() bool { return g.accepted.Load() == 2 }, 5*time.Second, time.Millisecond)
	check("probing")
}
