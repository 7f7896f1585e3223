package nats

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/faultproxy"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// pausedChildEnv, when set to a server URL, makes TestRegistryPausedChild
// the child of TestRegistryPausedProcessDeclaresNobodyDeparted.
const pausedChildEnv = "GOXFER_NATS_PAUSED_CHILD"

// A registry whose process is paused (SIGSTOP, a VM pause, CPU starvation)
// for longer than two heartbeats did not listen meanwhile: the heartbeats
// its peers sent are queued in its socket, and it must not declare them
// departed before it has read them. A peer that really dies is still
// declared departed afterwards.
func TestRegistryPausedProcessDeclaresNobodyDeparted(t *testing.T) {
	needStop(t)
	const pauses = 5
	srv := startServer(t)
	peer := newMortal(t, dial(t, srv))
	id := peer.id()

	// The child prints "arrived ID" and "departed ID" as its registry
	// reports them.
	cmd := exec.Command(os.Args[0], "-test.run=^TestRegistryPausedChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), pausedChildEnv+"="+srv.URL())
	var stderr lockedBuffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	events := make(chan string, 100)
	go func() {
		defer close(events)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			events <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(contSignal)
		_ = stdin.Close() // the child exits
		for range events {
		}
		if err := cmd.Wait(); err != nil {
			t.Errorf("child: %v", err)
		}
		if t.Failed() {
			t.Logf("child stderr:\n%s", stderr.String())
		}
	})
	// await returns the next event, failing the test if none comes.
	await := func() string {
		t.Helper()
		select {
		case ev, ok := <-events:
			require.True(t, ok, "the child exited; stderr:\n%s", stderr.String())
			return ev
		case <-time.After(hangGuard):
			t.Fatal("no event from the child")
		}
		return ""
	}
	require.Equal(t, "arrived "+id.String(), await())

	for i := range pauses {
		require.NoError(t, cmd.Process.Signal(stopSignal))
		time.Sleep(4 * testHeartbeat) // two heartbeats would do
		require.NoError(t, cmd.Process.Signal(contSignal))
		// Time for the child to read what was queued, and for wrong
		// departures to be reported.
		select {
		case ev := <-events:
			t.Fatalf("pause %d of %d: the child reported %q of a peer that never stopped heartbeating", i+1, pauses, ev)
		case <-time.After(4 * testHeartbeat):
		}
	}

	// The child still hears real departures.
	peer.nc.Close() // no goodbye
	require.Equal(t, "departed "+id.String(), await())
}

// TestRegistryPausedChild is the child process of
// TestRegistryPausedProcessDeclaresNobodyDeparted; on its own, it skips.
func TestRegistryPausedChild(t *testing.T) {
	url := os.Getenv(pausedChildEnv)
	if url == "" {
		t.Skip("the child process of TestRegistryPausedProcessDeclaresNobodyDeparted")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { // the parent closes stdin to end the child
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	nc, err := nats.Connect(url)
	require.NoError(t, err)
	defer nc.Close()
	r, err := OpenRegistry(ctx, nc, WithHeartbeat(testHeartbeat),
		WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))))
	require.NoError(t, err)
	defer func() { require.NoError(t, r.Close()) }()
	for p := range r.Watch(ctx) {
		what := "arrived"
		if p.Departed {
			what = "departed"
		}
		fmt.Printf("%s %s\n", what, p.ID)
	}
}

// Close returns, and Leave honours its context, even while a Join is
// failing its first put (the server is down): that Member's heartbeats
// never start, and nobody may wait for them.
func TestRegistryCloseRacingAFailingJoinReturns(t *testing.T) {
	_, joined, closed := closeDuringFailingJoin(t, 4*testHeartbeat)
	// Close cuts the put short: it does not wait for the Join's ctx.
	require.ErrorIs(t, await(t, joined, "the Join"), ErrClosed)
	assert.NoError(t, await(t, closed, "Close after a Join whose first put failed"), "a Member that never joined has nothing to leave")
}

// Leave returns by its context's end even when deleting the entry cannot
// be done (the server is down); the error says so.
func TestMemberLeaveHonoursItsContext(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv, resilient...)
	r := openRegistry(t, nc)
	m := join(t, r, newConnector(t))
	srv.Shutdown()
	require.Eventually(t, func() bool { return nc.Status() != nats.CONNECTED }, hangGuard, time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), testHeartbeat)
	defer cancel()
	err := m.Leave(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), "leave registry")
	assert.Equal(t, err, m.Leave(guarded(t)), "Leave returns the first call's result")
}

// forgetfulServer starts a server that loses its JetStream store on every
// Restart, as one on a fresh disk or an emptied volume would.
func forgetfulServer(t *testing.T) *natsserver.Server {
	t.Helper()
	base := t.TempDir()
	starts := 0
	return startServer(t, natsserver.WithServerOptions(func(o *server.Options) {
		starts++
		o.StoreDir = fmt.Sprintf("%s/store-%d", base, starts)
	}))
}

// A server restart that loses the JetStream store takes the bucket with
// it: the registries re-create it, their Members put their entries again,
// and a peer that dies afterwards is declared departed.
func TestRegistryRecreatesABucketLostWithTheServerStore(t *testing.T) {
	srv := forgetfulServer(t)
	var logs lockedBuffer // of every registry: any of them may re-create the bucket
	log := logs.logger(slog.LevelInfo)
	r := openRegistry(t, dial(t, srv, resilient...), log)
	w := r.Watch(guarded(t))
	live := newConnector(t)
	join(t, openRegistry(t, dial(t, srv, resilient...), log), live)
	doomed := newMortal(t, dial(t, srv, resilient...), log)
	for range 2 {
		require.False(t, next(t, w).Departed)
	}

	require.NoError(t, srv.Restart())
	start := time.Now()
	// The bucket is back, with both members' entries in it.
	js, err := jetstream.New(dial(t, srv))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		kv, err := js.KeyValue(guarded(t), defaultBucket)
		if err != nil {
			return false
		}
		keys, err := kv.Keys(guarded(t))
		return err == nil && len(keys) == 2
	}, hangGuard, 10*time.Millisecond, "the bucket was not re-created and re-joined")
	require.Eventually(t, func() bool { return r.Err() == nil }, hangGuard, time.Millisecond)
	t.Logf("bucket re-created and re-joined %v after the restart", time.Since(start).Round(time.Millisecond))
	assert.Contains(t, logs.String(), "re-created it")

	// Departures are heard again.
	require.NoError(t, doomed.reg.Close())
	start = time.Now()
	p := next(t, w)
	assert.Equal(t, doomed.departure(), p)
	t.Logf("a peer leaving after the restart was heard %v later", time.Since(start).Round(time.Millisecond))

	// And silent ones too.
	silent := newMortal(t, dial(t, srv, resilient...))
	require.Equal(t, silent.arrival(), next(t, w))
	silent.nc.Close()
	require.Equal(t, silent.departure(), next(t, w))
	assert.Equal(t, []uuid.UUID{live.AgentInfo().ID()}, r.Agents())
}

// A registry that may not create its bucket cannot restore it after the
// store is lost: it says so loudly, and Err reports it until an
// administrator re-creates the bucket; then it hears again.
func TestRegistryReportsABucketItMayNotRecreate(t *testing.T) {
	srv := forgetfulServer(t)
	openRegistry(t, dial(t, srv)) // creates the bucket
	var logs lockedBuffer
	r := openRegistry(t, dial(t, srv, resilient...), WithCreateBucket(false), logs.logger(slog.LevelInfo))
	require.NoError(t, r.Err())

	require.NoError(t, srv.Restart())
	require.Eventually(t, func() bool { return errors.Is(r.Err(), ErrRegistry) }, hangGuard, time.Millisecond)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "level=ERROR") }, hangGuard, time.Millisecond)
	err := r.Err()
	t.Log(err)
	assert.Contains(t, err.Error(), "WithCreateBucket(false) forbids re-creating it")

	// An administrator creates it again.
	w := r.Watch(guarded(t))
	openRegistry(t, dial(t, srv))
	require.Eventually(t, func() bool { return r.Err() == nil }, hangGuard, time.Millisecond)
	c := newConnector(t)
	join(t, openRegistry(t, dial(t, srv)), c)
	require.Equal(t, Presence{ID: c.AgentInfo().ID(), Info: c.AgentInfo()}, next(t, w))
}

// A departure is reported once: the delete marker a re-watch delivers
// again does not declare a departed agent departed a second time.
func TestRegistryReportsADepartureOnce(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv, resilient...))
	w := r.Watch(guarded(t))
	c := newConnector(t)
	m := join(t, openRegistry(t, dial(t, srv, resilient...)), c)
	require.False(t, next(t, w).Departed)
	require.NoError(t, m.Leave(guarded(t)))
	require.True(t, next(t, w).Departed)

	require.NoError(t, srv.Restart()) // the re-watch delivers the delete marker again
	quiet(t, w, 8*testHeartbeat, "after the restart")
	_, err := r.Resolve(guarded(t), c.AgentInfo().ID())
	require.ErrorIs(t, err, connect.ErrRemoteLost)
}

// A registry whose link from the server starts lagging (a congested
// network, a starved server) hears every heartbeat late, not missing: it
// must not declare departed the peers whose heartbeats wait in the lag with
// its own. It still declares departed a peer that dies, once a heartbeat of
// its own, sent two of the peer's heartbeats later, has come back.
func TestRegistryOnALaggingLinkDeclaresNobodyDeparted(t *testing.T) {
	const lag = 4 * testHeartbeat
	srv := startServer(t)
	nc, p := proxied(t, srv)
	r := openRegistry(t, nc)
	self := newConnector(t)
	join(t, r, self)
	w := r.Watch(guarded(t))
	peer := newMortal(t, dial(t, srv))
	for range 2 {
		require.False(t, next(t, w).Departed)
	}

	for i := range 3 {
		p.Latency(faultproxy.Downstream, lag, 0)
		quiet(t, w, 2*lag, fmt.Sprintf("lag %d, of a peer that never stopped heartbeating", i+1))
		p.Latency(faultproxy.Downstream, 0, 0)
		quiet(t, w, 4*testHeartbeat, fmt.Sprintf("lag %d lifted", i+1))
	}

	p.Latency(faultproxy.Downstream, lag, 0)
	start := time.Now()
	peer.nc.Close() // no goodbye
	require.Equal(t, peer.departure(), next(t, w))
	t.Logf("a peer dying behind a lag of %v was declared departed %v later (heartbeat %v)",
		lag, time.Since(start).Round(time.Millisecond), testHeartbeat)
	assert.Equal(t, []uuid.UUID{self.AgentInfo().ID()}, r.Agents())
}
