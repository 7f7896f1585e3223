package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/connect"
	gxnats "github.com/goxfer/goxfer/transport/nats"
)

// The token service closes an operation whose token the request says goes
// unused as soon as it answered, and keeps one whose token is used open
// until its peer completes: the nats-token row must leave no exposures
// open under the rows measured after it.
func TestServeTokenUnusedClosesAtOnce(t *testing.T) {
	ctx := context.Background()
	c, err := connect.NewConnector()
	require.NoError(t, err)
	defer func() { assert.NoError(t, c.Close()) }()
	tokCtx, stop := context.WithCancel(ctx)
	defer stop()
	tg := &target{conn: c, tokBuf: make([]byte, 4096), tokCtx: tokCtx}
	fill(tg.tokBuf, 1)

	for range 10 {
		rep, err := tg.serveToken(ctx, &gxnats.ServiceRequest{Data: []byte(tokenUnused)})
		require.NoError(t, err)
		assert.Equal(t, 4096, rep.Metadata.Sizes()[0])
	}
	// The unused ones close without waiting for a peer (before: 30 s).
	require.Eventually(t, func() bool { return c.Stats().Exposed == 0 }, 5*time.Second, time.Millisecond, "exposures left open by unused tokens")
	tg.tokWG.Wait()

	rep, err := tg.serveToken(ctx, &gxnats.ServiceRequest{})
	require.NoError(t, err)
	assert.Equal(t, 1, c.Stats().Exposed, "a token to be used stays exposed")
	peer, err := connect.NewConnector()
	require.NoError(t, err)
	defer func() { assert.NoError(t, peer.Close()) }()
	dst := make([]byte, 4096)
	rop, err := peer.BeginRead(ctx, rep.Metadata, connect.NewDescriptor(dst))
	require.NoError(t, err)
	require.NoError(t, rop.Wait(ctx))
	assert.Equal(t, tg.tokBuf, dst)
	tg.tokWG.Wait() // closed once read
	assert.Zero(t, c.Stats().Exposed)
}
