package nats

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/pattern"
	"github.com/goxfer/goxfer/internal/retry"
	"github.com/goxfer/goxfer/internal/testproc"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

func TestRegistryCreatesItsBucket(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	r := openRegistry(t, nc, WithBucket("agents_a"), WithHeartbeat(time.Second))
	assert.Equal(t, "agents_a", r.Bucket())
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	kv, err := js.KeyValue(guarded(t), "agents_a")
	require.NoError(t, err)
	st, err := kv.Status(guarded(t))
	require.NoError(t, err)
	assert.Equal(t, 3*time.Second, st.TTL())
	assert.Equal(t, int64(1), st.History())
	// Another process binds the same bucket.
	openRegistry(t, dial(t, srv), WithBucket("agents_a"), WithCreateBucket(false))
}

func TestRegistryMissingBucketNotCreated(t *testing.T) {
	srv := startServer(t)
	_, err := OpenRegistry(guarded(t), dial(t, srv), WithBucket("nope"), WithCreateBucket(false))
	require.ErrorIs(t, err, ErrRegistry)
	assert.Contains(t, err.Error(), `bucket "nope" does not exist`)

	noJS := startServer(t, natsserver.WithoutJetStream())
	_, err = OpenRegistry(guarded(t), dial(t, noJS))
	require.ErrorIs(t, err, ErrRegistry)
	assert.Contains(t, err.Error(), `bucket "goxfer_agents"`)
	t.Log(err)
}

func TestRegistryBucketCreationNotPermitted(t *testing.T) {
	srv := startServer(t, natsserver.WithServerOptions(func(o *server.Options) {
		o.Users = []*server.User{
			{Username: "admin", Password: "a"},
			{Username: "worker", Password: "w", Permissions: &server.Permissions{
				Publish: &server.SubjectPermission{Allow: []string{">"}, Deny: []string{"$JS.API.STREAM.CREATE.>"}},
			}},
		}
	}))
	nc := dial(t, srv, nats.UserInfo("worker", "w"), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	defer func(d time.Duration) { createWithin = d }(createWithin)
	createWithin = 500 * time.Millisecond
	_, err := OpenRegistry(guarded(t), nc, WithBucket("locked"))
	require.ErrorIs(t, err, ErrRegistry)
	assert.Contains(t, err.Error(), `bucket "locked" does not exist and creating it failed`)
	assert.Contains(t, err.Error(), `permissions violation`)
	t.Log(err)

	// Once an admin has created it, the worker may use it.
	openRegistry(t, dial(t, srv, nats.UserInfo("admin", "a")), WithBucket("locked"))
	r := openRegistry(t, nc, WithBucket("locked"))
	join(t, r, newConnector(t))
}

func TestRegistryJoinResolveLeave(t *testing.T) {
	srv := startServer(t)
	r1, r2 := openRegistry(t, dial(t, srv)), openRegistry(t, dial(t, srv))
	watch := r2.Watch(guarded(t))
	c := newConnector(t)
	id := c.AgentInfo().ID()

	m := join(t, r1, c)
	assert.Equal(t, id, m.ID())
	p := next(t, watch)
	assert.Equal(t, Presence{ID: id, Info: p.Info}, p)
	assert.Equal(t, id, p.Info.ID())
	assert.Equal(t, c.AgentInfo().Backends(), p.Info.Backends())
	assert.Equal(t, []uuid.UUID{id}, r2.Agents())
	info, err := r2.Resolve(guarded(t), id)
	require.NoError(t, err)
	assert.Equal(t, c.AgentInfo(), info)

	_, err = r2.Resolve(guarded(t), uuid.New())
	require.ErrorIs(t, err, ErrUnknownAgent)

	require.NoError(t, m.Leave(guarded(t)))
	require.NoError(t, m.Leave(guarded(t)))
	p = next(t, watch)
	assert.Equal(t, Presence{ID: id, Info: c.AgentInfo(), Departed: true}, p)
	assert.Empty(t, r2.Agents())
	_, err = r2.Resolve(guarded(t), id)
	require.ErrorIs(t, err, connect.ErrRemoteLost)

	// A registry opened later resolves a deleted entry as departed too.
	r3 := openRegistry(t, dial(t, srv))
	_, err = r3.Resolve(guarded(t), id)
	require.ErrorIs(t, err, connect.ErrRemoteLost)
}

func TestRegistryWatchStartsWithThePresentAndEnds(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv))
	a, b := newConnector(t), newConnector(t)
	join(t, r, a)
	join(t, r, b)
	require.Eventually(t, func() bool { return len(r.Agents()) == 2 }, hangGuard, time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	w := r.Watch(ctx)
	got := map[uuid.UUID]bool{next(t, w).ID: true, next(t, w).ID: true}
	assert.Equal(t, map[uuid.UUID]bool{a.AgentInfo().ID(): true, b.AgentInfo().ID(): true}, got)
	cancel()
	for range w {
	}
	require.NoError(t, r.Close())
	require.NoError(t, r.Close())
	_, ok := <-r.Watch(context.Background())
	assert.False(t, ok, "Watch after Close")
	_, err := r.Join(guarded(t), a)
	require.ErrorIs(t, err, ErrClosed)
}

// A compact token names its agent without endpoints; the requester's
// Connector resolves it through the registry.
func TestCompactTokenResolvedThroughTheRegistry(t *testing.T) {
	ctx := guarded(t)
	srv := startServer(t)
	prefillReg, decodeReg := openRegistry(t, dial(t, srv)), openRegistry(t, dial(t, srv))
	prefill := newConnector(t)
	join(t, prefillReg, prefill)
	decode := newConnector(t, connect.WithResolver(decodeReg))

	seed := pattern.NextSeed()
	block := make([]byte, 256<<10)
	pattern.Fill(block, seed, 0, 0)
	op := readable(t, prefill, block)
	serve(t, dial(t, srv), "prefill.kv", func(context.Context, *ServiceRequest) (*Reply, error) {
		return &Reply{Metadata: op.Metadata().Compact()}, nil
	})
	rep, err := Request(ctx, dial(t, srv), "prefill.kv", nil)
	require.NoError(t, err)
	require.True(t, rep.Metadata.IsCompact())
	assert.Less(t, rep.Metadata.EncodedLen(), op.Metadata().EncodedLen())
	t.Logf("token: %d bytes full, %d compact", op.Metadata().EncodedLen(), rep.Metadata.EncodedLen())

	readPattern(t, ctx, decode, rep.Metadata, seed)
	require.NoError(t, op.Wait(ctx))
}

// A peer whose NATS connection dies without leaving (its process hung,
// say) is declared departed after two of its heartbeats.
func TestRegistryDeclaresASilentPeerDeparted(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv))
	w := r.Watch(guarded(t))
	peer := newMortal(t, dial(t, srv))
	require.Equal(t, peer.arrival(), next(t, w))

	start := time.Now()
	peer.nc.Close() // no goodbye: the entry stays in the bucket
	p := next(t, w)
	silent := time.Since(start)
	assert.Equal(t, peer.departure(), p)
	assert.GreaterOrEqual(t, silent, testHeartbeat, "declared departed before it could have missed a heartbeat")
	t.Logf("silent peer declared departed after %v (heartbeat %v)", silent, testHeartbeat)
	_, err := r.Resolve(guarded(t), peer.id())
	require.ErrorIs(t, err, connect.ErrRemoteLost)
	// Its Member cannot say goodbye any more, and says so.
	require.Error(t, peer.reg.Close())
}

// Peers that stay alive through a server restart are not declared
// departed, and the registry still hears departures afterwards.
func TestRegistrySurvivesAServerRestart(t *testing.T) {
	srv := startServer(t)
	r1 := openRegistry(t, dial(t, srv, resilient...))
	r2 := openRegistry(t, dial(t, srv, resilient...))
	a, b := newConnector(t), newConnector(t)
	join(t, r1, a)
	mb := join(t, r2, b)
	w1 := r1.Watch(guarded(t))
	w2 := r2.Watch(guarded(t))
	for _, w := range []<-chan Presence{w1, w1, w2, w2} {
		require.False(t, next(t, w).Departed)
	}

	require.NoError(t, srv.Restart())
	// Long enough for many heartbeats, and for departures if any were
	// wrongly declared.
	quiet := time.After(10 * testHeartbeat)
	for done := false; !done; {
		select {
		case p := <-w1:
			t.Errorf("r1 after restart: %+v", p)
		case p := <-w2:
			t.Errorf("r2 after restart: %+v", p)
		case <-quiet:
			done = true
		}
	}
	want := []uuid.UUID{a.AgentInfo().ID(), b.AgentInfo().ID()}
	assert.ElementsMatch(t, want, r1.Agents())
	assert.ElementsMatch(t, want, r2.Agents())

	require.NoError(t, mb.Leave(guarded(t)))
	p := next(t, w1)
	assert.Equal(t, Presence{ID: b.AgentInfo().ID(), Info: b.AgentInfo(), Departed: true}, p)
}

// A peer frozen mid-transfer (SIGSTOP: its tcp and NATS connections stay
// open and silent) fails the operation in flight with ErrRemoteLost as
// soon as the registry misses its heartbeats; the tcp keepalive, a minute
// here, would take far longer.
func TestFrozenPeerFailsOperationsThroughTheRegistry(t *testing.T) {
	needStop(t)
	const keepaliveTimeout = time.Minute
	const size = 256 << 20
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv))
	parent := newConnector(t, connect.WithTCPOptions(tcp.WithKeepalive(time.Second, keepaliveTimeout)))
	join(t, r, parent)
	block := make([]byte, size)

	retry.Until(t, 5, func(t *testing.T) bool {
		ctx := guarded(t)
		op := readable(t, parent, block)
		child := testproc.Start[childRequest, childResponse](t, childEnv, testproc.Options{})
		t.Cleanup(child.Kill) // before the operation closes: frees its blocked sends
		resp := child.Do(childRequest{URL: srv.URL(), Bucket: defaultBucket, Heartbeat: testHeartbeat, Token: op.Metadata().Text(), Size: size})
		require.Empty(t, resp.Err)
		require.Eventually(t, func() bool { return op.Status() != connect.StatusInitialized }, hangGuard, 100*time.Microsecond, "the child never read")

		start := time.Now()
		require.NoError(t, child.Signal(stopSignal))
		err := op.Wait(ctx)
		lost := time.Since(start)
		if err == nil {
			return false // the read finished before the freeze
		}
		t.Logf("frozen peer reported %v after the freeze: %v", lost, err)
		require.ErrorIs(t, err, connect.ErrRemoteLost)
		assert.Contains(t, err.Error(), fmt.Sprintf("agent %s departed", resp.Agent))
		assert.Less(t, lost, keepaliveTimeout/2, "the registry must beat the keepalive")
		assert.NotContains(t, r.Agents(), uuid.MustParse(resp.Agent))
		return true
	})
}

// A peer that leaves (its entry deleted) is forwarded to the joined
// Connectors one heartbeat later, not at once: the notifications and the
// goodbyes its Connector sends as it closes travel over the backends, and
// must get there first. Here the peer is frozen mid-read and its entry
// deleted for it, so that only the registry can end the exposure's Wait:
// it must, after the grace and long before the keepalive. Told at once,
// the example's scale-out run saw an exposure fail that its reader had
// read, its notification still on the way.
func TestLeftPeerToldAfterAHeartbeat(t *testing.T) {
	needStop(t)
	const keepaliveTimeout = time.Minute
	const size = 256 << 20
	const grace = time.Second // the registry's heartbeat
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv), WithHeartbeat(grace))
	parent := newConnector(t, connect.WithTCPOptions(tcp.WithKeepalive(time.Second, keepaliveTimeout)))
	join(t, r, parent)
	block := make([]byte, size)

	retry.Until(t, 5, func(t *testing.T) bool {
		ctx := guarded(t)
		op := readable(t, parent, block)
		child := testproc.Start[childRequest, childResponse](t, childEnv, testproc.Options{})
		t.Cleanup(child.Kill)
		resp := child.Do(childRequest{URL: srv.URL(), Bucket: defaultBucket, Heartbeat: testHeartbeat, Token: op.Metadata().Text(), Size: size})
		require.Empty(t, resp.Err)
		require.Eventually(t, func() bool { return op.Status() != connect.StatusInitialized }, hangGuard, 100*time.Microsecond, "the child never read")
		require.NoError(t, child.Signal(stopSignal))
		if op.Status() == connect.StatusComplete {
			return false // the read finished before the freeze
		}

		start := time.Now()
		require.NoError(t, r.kv.Delete(ctx, resp.Agent))
		err := op.Wait(ctx)
		told := time.Since(start)
		if err == nil {
			return false // the read finished before the freeze
		}
		t.Logf("a peer that left was told after %v (grace %v): %v", told, grace, err)
		require.ErrorIs(t, err, connect.ErrRemoteLost)
		assert.Contains(t, err.Error(), fmt.Sprintf("agent %s departed", resp.Agent))
		assert.GreaterOrEqual(t, told, grace, "told before the leaving agent could close its Connector")
		assert.Less(t, told, keepaliveTimeout/2, "the registry must beat the keepalive")
		return true
	})
}

// OpenRegistry's context bounds only the opening: a registry opened under a
// request's context keeps watching after that context ends.
func TestRegistryOutlivesItsOpeningContext(t *testing.T) {
	srv := startServer(t)
	var logs lockedBuffer
	ctx, cancel := context.WithCancel(context.Background())
	r, err := OpenRegistry(ctx, dial(t, srv), WithHeartbeat(testHeartbeat), logs.logger(slog.LevelDebug))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, r.Close()) })
	cancel()

	c := newConnector(t)
	m := join(t, openRegistry(t, dial(t, srv)), c)
	require.Eventually(t, func() bool { return len(r.Agents()) == 1 }, hangGuard, time.Millisecond,
		"the registry hears an arrival after its opening context ended")
	require.NoError(t, m.Leave(guarded(t)))
	require.Eventually(t, func() bool { return len(r.Agents()) == 0 }, hangGuard, time.Millisecond)
	assert.NotContains(t, logs.String(), "watch ended", "the watch was never interrupted")
}
