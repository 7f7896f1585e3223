package nats

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/connect"
)

// block is what the served exposures hold.
var block = bytes.Repeat([]byte{0x5a}, 4096)

// serveBlocks serves a fresh copy of block of kind on subject with server
// until the test ends; the returned channel has each request's outcome.
func serveBlocks(t *testing.T, nc *nats.Conn, subject string, server *connect.Connector, kind connect.OperationKind, opts ...connect.ExposeOption) (*ExposureService, <-chan error) {
	t.Helper()
	outcomes := make(chan error, 16)
	s, err := ServeExposures(nc, subject, server, func(ctx context.Context, req *ServiceRequest) (*Exposed, error) {
		return &Exposed{
			Kind: kind, Descriptors: []connect.Descriptor{connect.NewDescriptor(bytes.Clone(block))},
			Data:    []byte("block 7"),
			Options: opts,
			Done:    func(err error) { outcomes <- err },
		}, nil
	}, WithLogger(quietLog))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, s.Close()) })
	return s, outcomes
}

// outcome returns the next outcome a served exposure reported.
func outcome(t *testing.T, ctx context.Context, outcomes <-chan error) error {
	t.Helper()
	select {
	case err := <-outcomes:
		return err
	case <-ctx.Done():
		require.FailNow(t, "no outcome")
	}
	return nil
}

// readBlock reads the block rep's token names with c.
func readBlock(ctx context.Context, c *connect.Connector, rep *Reply) ([]byte, error) {
	dst := make([]byte, len(block))
	rop, err := c.BeginRead(ctx, rep.Metadata, connect.NewDescriptor(dst))
	if err != nil {
		return nil, err
	}
	return dst, rop.Wait(ctx)
}

// A served block is read, and its exposure closes at once: Done hears
// nil, and the token is refused afterwards.
func TestServeExposuresClosesOnCompletion(t *testing.T) {
	ctx := guarded(t)
	nc := dial(t, startServer(t))
	server, reader := newConnector(t), newConnector(t)
	_, outcomes := serveBlocks(t, nc, "kv", server, connect.KindRead)

	rep, err := Request(ctx, nc, "kv", nil)
	require.NoError(t, err)
	assert.Equal(t, []byte("block 7"), rep.Data)
	got, err := readBlock(ctx, reader, rep)
	require.NoError(t, err)
	assert.Equal(t, block, got)
	require.NoError(t, outcome(t, ctx, outcomes))
	_, err = readBlock(ctx, reader, rep)
	require.ErrorIs(t, err, connect.ErrAccessDenied)
}

// The requester's failure, release and silence each close the exposure,
// with Done saying which; Close closes what is left.
func TestServeExposuresClosesOnEveryEnd(t *testing.T) {
	ctx := guarded(t)
	nc := dial(t, startServer(t))
	server, reader := newConnector(t), newConnector(t)
	svc, outcomes := serveBlocks(t, nc, "kv", server, connect.KindWrite, connect.WithExpiry(time.Hour))

	// A WRITE of the wrong size fails before it starts; the server hears.
	rep, err := Request(ctx, nc, "kv", nil)
	require.NoError(t, err)
	_, err = reader.BeginWrite(ctx, rep.Metadata, connect.NewDescriptor(make([]byte, 10)))
	require.ErrorIs(t, err, connect.ErrSizeMismatch)
	err = outcome(t, ctx, outcomes)
	var te *connect.TransferError
	require.ErrorAs(t, err, &te)
	assert.Contains(t, err.Error(), "size mismatch")

	// A release.
	rep, err = Request(ctx, nc, "kv", nil)
	require.NoError(t, err)
	require.NoError(t, reader.Release(ctx, rep.Metadata))
	require.ErrorIs(t, outcome(t, ctx, outcomes), connect.ErrReleased)

	// Close with a token handed out and unused.
	_, err = Request(ctx, nc, "kv", nil)
	require.NoError(t, err)
	require.NoError(t, svc.Close())
	require.ErrorIs(t, outcome(t, ctx, outcomes), connect.ErrClosed)
	require.NoError(t, svc.Close(), "idempotent")
}

// A token nobody uses expires: 30 s by default, WithExpiry's here.
func TestServeExposuresExpire(t *testing.T) {
	ctx := guarded(t)
	nc := dial(t, startServer(t))
	server := newConnector(t)
	_, outcomes := serveBlocks(t, nc, "kv", server, connect.KindRead, connect.WithExpiry(20*time.Millisecond))
	_, err := Request(ctx, nc, "kv", nil)
	require.NoError(t, err)
	require.ErrorIs(t, outcome(t, ctx, outcomes), connect.ErrExpired)
}

// A transfer that could not start closes nothing; the retry over a
// backend that works completes it.
func TestServeExposuresSurviveUnstartedAttempt(t *testing.T) {
	ctx := guarded(t)
	nc := dial(t, startServer(t))
	server := newConnector(t, connect.WithBackends(mem.New()))
	noWay := newConnector(t, connect.WithBackends(mem.New(), tcp.New()), connect.WithBackend("tcp"))
	reader := newConnector(t)
	_, outcomes := serveBlocks(t, nc, "kv", server, connect.KindRead)

	rep, err := Request(ctx, nc, "kv", nil)
	require.NoError(t, err)
	_, err = readBlock(ctx, noWay, rep)
	require.ErrorIs(t, err, connect.ErrNoBackend)
	got, err := readBlock(ctx, reader, rep)
	require.NoError(t, err)
	assert.Equal(t, block, got)
	require.NoError(t, outcome(t, ctx, outcomes))
}

// A requester that departs (its presence lapses in the registry the
// server joined) closes the exposure it touched, with ErrRemoteLost, long
// before the expiry.
func TestServeExposuresCloseOnDeparture(t *testing.T) {
	ctx := guarded(t)
	srv := startServer(t)
	nc := dial(t, srv)
	server := newConnector(t, connect.WithBackends(mem.New()))
	join(t, openRegistry(t, nc), server)
	_, outcomes := serveBlocks(t, nc, "kv", server, connect.KindRead, connect.WithExpiry(time.Hour))

	// The requester, on a registry and connection of its own that the test
	// cuts without a goodbye. Its attempt reaches the server's agent, which
	// binds the exposure to it, but cannot start: it forces tcp, which the
	// server lacks.
	mortal := newConnector(t, connect.WithBackends(mem.New(), tcp.New()), connect.WithBackend("tcp"))
	mnc := dial(t, srv)
	reg, err := OpenRegistry(ctx, mnc, registryOptions(nil)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = reg.Close() })
	_, err = reg.Join(ctx, mortal)
	require.NoError(t, err)

	rep, err := Request(ctx, nc, "kv", nil)
	require.NoError(t, err)
	_, err = readBlock(ctx, mortal, rep)
	require.ErrorIs(t, err, connect.ErrNoBackend)
	select {
	case err := <-outcomes:
		require.FailNow(t, "closed by an attempt that could not start", "%v", err)
	case <-time.After(50 * time.Millisecond):
	}

	mnc.Close()
	err = outcome(t, ctx, outcomes)
	require.ErrorIs(t, err, connect.ErrRemoteLost)
	assert.Contains(t, err.Error(), mortal.AgentInfo().ID().String())
}

// ServeExposures checks its arguments; an ExposeFunc's error, and a
// failure to expose, reach the requester, and Done hears the latter.
func TestServeExposuresErrors(t *testing.T) {
	ctx := guarded(t)
	nc := dial(t, startServer(t))
	server := newConnector(t)
	_, err := ServeExposures(nc, "kv", nil, func(context.Context, *ServiceRequest) (*Exposed, error) { return nil, nil })
	require.ErrorIs(t, err, ErrInvalidOption)
	_, err = ServeExposures(nc, "kv", server, nil)
	require.ErrorIs(t, err, ErrInvalidOption)
	_, err = ServeExposures(nc, "kv", server, func(context.Context, *ServiceRequest) (*Exposed, error) { return nil, nil }, WithConcurrency(0))
	require.ErrorIs(t, err, ErrInvalidOption)

	done := make(chan error, 1)
	s, err := ServeExposures(nc, "bad", server, func(_ context.Context, req *ServiceRequest) (*Exposed, error) {
		if string(req.Data) == "refuse" {
			return nil, &HandlerError{Code: "no-block", Message: "no such block"}
		}
		return &Exposed{Descriptors: []connect.Descriptor{connect.NewDescriptor(block)}, Done: func(err error) { done <- err }}, nil
	}, WithLogger(quietLog))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, s.Close()) })
	_, err = Request(ctx, nc, "bad", []byte("refuse"))
	var he *HandlerError
	require.ErrorAs(t, err, &he)
	assert.Equal(t, "no-block", he.Code)
	_, err = Request(ctx, nc, "bad", nil)
	require.ErrorAs(t, err, &he)
	assert.Contains(t, he.Message, "want KindRead or KindWrite")
	require.ErrorIs(t, <-done, connect.ErrInvalidOption)
}
