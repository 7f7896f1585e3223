package nats

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/faultproxy"
	"github.com/goxfer/goxfer/internal/pattern"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// Faults between one worker and the NATS server: a faultproxy sits on
// that worker's NATS connection (and, where a transfer is involved, on its
// tcp backend's address), so that it can be partitioned away while the
// rest of the system carries on. Server restarts and slow consumers are
// covered by TestRequestSurvivesAServerRestart,
// TestRegistrySurvivesAServerRestart and TestSubscriptionReportsASlowConsumer.

// watchfulServer starts a server that pings its clients every 100 ms and
// drops one that misses two pings, so that a partitioned client's
// subscriptions leave its queue groups within a fraction of a second.
func watchfulServer(t *testing.T) *natsserver.Server {
	t.Helper()
	return startServer(t, natsserver.WithServerOptions(func(o *server.Options) {
		o.PingInterval = 100 * time.Millisecond
		o.MaxPingsOut = 2
	}))
}

// partitionable connects to srv through a fault proxy, with a client that
// notices a silent server within a few hundred milliseconds and reconnects
// for ever. The proxy and the connection end with the test.
func partitionable(t *testing.T, srv *natsserver.Server) (*nats.Conn, *faultproxy.Proxy) {
	t.Helper()
	return proxied(t, srv, nats.PingInterval(100*time.Millisecond), nats.MaxPingsOutstanding(2), nats.Timeout(500*time.Millisecond))
}

// partitions are the ways a worker is cut off from the server.
var partitions = []struct {
	name       string
	cut, heal  func(p *faultproxy.Proxy)
	serverSees string
}{
	// A black hole: the connection stays open and silent until both ends'
	// pings give up on it.
	{"stall", func(p *faultproxy.Proxy) { p.Stall(faultproxy.Both) }, (*faultproxy.Proxy).Heal, "silence"},
	// The connection is reset and every reconnection refused.
	{"reset-and-refuse", func(p *faultproxy.Proxy) { p.Refuse(true); p.Reset() }, (*faultproxy.Proxy).Heal, "a reset"},
}

// echoWorker serves subject on nc, answering with the request's data and
// its name in a header.
func echoWorker(t *testing.T, nc *nats.Conn, subject, name string) {
	md := testToken(t)
	serve(t, nc, subject, func(_ context.Context, req *ServiceRequest) (*Reply, error) {
		return &Reply{Metadata: md, Data: req.Data, Header: nats.Header{"Worker": []string{name}}}, nil
	})
}

// Requests to a queue group of two workers, one of them partitioned away,
// are retried onto the healthy one: none fails. Once the partition heals,
// the other worker answers again.
func TestRequestsRetryAroundAPartitionedWorker(t *testing.T) {
	for _, part := range partitions {
		t.Run(part.name, func(t *testing.T) {
			srv := watchfulServer(t)
			echoWorker(t, dial(t, srv, resilient...), "kv", "healthy")
			cut, p := partitionable(t, srv)
			echoWorker(t, cut, "kv", "partitioned")
			nc := dial(t, srv, resilient...)
			request := func(i int) (*Reply, error) {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				return Request(ctx, nc, "kv", fmt.Appendf(nil, "%d", i), WithRetry(20), WithAttemptTimeout(200*time.Millisecond))
			}

			part.cut(p)
			by := map[string]int{}
			start := time.Now()
			for i := range 40 {
				sent := time.Now()
				rep, err := request(i)
				require.NoError(t, err, "request %d, %v after the partition", i, time.Since(start))
				require.Equal(t, fmt.Sprint(i), string(rep.Data))
				by[rep.Header.Get("Worker")]++
				assert.Less(t, time.Since(sent), 5*time.Second)
			}
			t.Logf("%s: 40 requests in %v: %v", part.name, time.Since(start).Round(time.Millisecond), by)
			assert.Zero(t, by["partitioned"], "a partitioned worker answered")

			part.heal(p)
			require.Eventually(t, func() bool {
				rep, err := request(0)
				return err == nil && rep.Header.Get("Worker") == "partitioned"
			}, hangGuard, time.Millisecond, "the healed worker never answered again")
		})
	}
}

// With its only worker partitioned away, a request fails by its deadline
// with an error that names the subject and matches the deadline.
func TestRequestToAPartitionedOnlyWorkerFailsClearly(t *testing.T) {
	srv := watchfulServer(t)
	cut, p := partitionable(t, srv)
	echoWorker(t, cut, "kv", "partitioned")
	nc := dial(t, srv, resilient...)
	p.Stall(faultproxy.Both)
	defer p.Heal() // lets the Service close quickly
	const deadline = 2 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	start := time.Now()
	_, err := Request(ctx, nc, "kv", []byte("x"), WithRetry(100), WithAttemptTimeout(300*time.Millisecond))
	took := time.Since(start)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), `subject "kv"`)
	assert.Less(t, took, deadline+time.Second, "Request overran its deadline")
	t.Logf("after %v: %v", took.Round(time.Millisecond), err)
}

// A worker partitioned away from NATS is reported departed by every other
// member's registry within about two of its heartbeats, its entry then
// resolving to ErrRemoteLost; once the partition heals, it is reported
// back.
func TestRegistryReportsAPartitionedWorker(t *testing.T) {
	for _, part := range partitions {
		t.Run(part.name, func(t *testing.T) {
			srv := watchfulServer(t)
			r := openRegistry(t, dial(t, srv, resilient...))
			w := r.Watch(guarded(t))
			cut, p := partitionable(t, srv)
			worker := newConnector(t)
			join(t, openRegistry(t, cut), worker)
			id := worker.AgentInfo().ID()
			require.Equal(t, Presence{ID: id, Info: worker.AgentInfo()}, next(t, w))

			start := time.Now()
			part.cut(p)
			require.Equal(t, Presence{ID: id, Info: worker.AgentInfo(), Departed: true}, next(t, w))
			gone := time.Since(start)
			t.Logf("%s: departed after %v (heartbeat %v)", part.name, gone.Round(time.Millisecond), testHeartbeat)
			assert.GreaterOrEqual(t, gone, testHeartbeat, "declared departed before a heartbeat was missed")
			assert.Less(t, gone, 2*testHeartbeat+time.Second, "about two heartbeats, with slack for a loaded machine")
			assert.NotContains(t, r.Agents(), id)
			_, err := r.Resolve(guarded(t), id)
			require.ErrorIs(t, err, connect.ErrRemoteLost)

			start = time.Now()
			part.heal(p)
			require.Equal(t, Presence{ID: id, Info: worker.AgentInfo()}, next(t, w))
			t.Logf("%s: back %v after healing", part.name, time.Since(start).Round(time.Millisecond))
			info, err := r.Resolve(guarded(t), id)
			require.NoError(t, err)
			assert.Equal(t, worker.AgentInfo(), info)

			// The registry goes on hearing departures.
			quiet(t, w, 4*testHeartbeat, "after healing")
		})
	}
}

// A worker partitioned away entirely, its NATS connection and its tcp
// data path both black-holed mid-transfer, fails a READ of a compact token
// it handed out with ErrRemoteLost through the registry (PeerDeparted).
// The compact token then resolves to ErrRemoteLost; once the partition
// heals the worker is back and a fresh token from it reads exactly.
//
// The READ fails within about two heartbeats of the partition, long before
// the tcp keepalive timeout (20 s here), as docs/nats.md promises: the
// departure aborts the transfer and the tcp backend drops its connections
// to the worker (agent.Departer), failing the frames still in flight.
//
// The read after the heal is small. A live peer is declared departed when
// none of its puts is stored within two of its heartbeats of the last one
// heard, so each put may lag about one heartbeat (250 ms here) on its way
// to the server. A 64 MiB transfer through two user-space proxies under
// -race saturates a small machine, and the worker's puts, which cross its
// NATS proxy, then lagged longer: by its rules the registry found the
// worker silent, and the departure aborted the read (a handler filling
// 64 MiB for every retried attempt added to the load). What the heal must
// show, that the worker is back and a fresh token from it reads exactly,
// needs no large transfer.
func TestPartitionedWorkerFailsOperationsThroughTheRegistry(t *testing.T) {
	const kaTimeout = 20 * time.Second // the registry must beat it by far
	const size = 64 << 20              // in flight when the partition comes
	const healedSize = 1 << 20
	srv := watchfulServer(t)

	// The worker: NATS and tcp both behind proxies.
	cut, natsProxy := partitionable(t, srv)
	tcpProxy, err := faultproxy.New("")
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, tcpProxy.Close()) })
	wtcp := tcp.New(tcp.WithKeepalive(time.Second, kaTimeout), tcp.WithAdvertiseAddr(tcpProxy.Addr()))
	worker := newConnector(t, connect.WithBackends(wtcp))
	tcpProxy.SetUpstream(wtcp.Addr().String())
	join(t, openRegistry(t, cut), worker)
	var served atomic.Uint64
	// Each request names the size of the block to expose.
	serve(t, cut, "kv", func(ctx context.Context, req *ServiceRequest) (*Reply, error) {
		var n int
		if _, err := fmt.Sscan(string(req.Data), &n); err != nil {
			return nil, &HandlerError{Code: "bad-request", Message: fmt.Sprintf("want a size, found %q", req.Data)}
		}
		seed := served.Add(1)
		block := make([]byte, n)
		pattern.Fill(block, seed, 0, 0)
		op, err := worker.CreateReadable(ctx, connect.NewDescriptor(block))
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { _ = op.Close() })
		return &Reply{Metadata: op.Metadata().Compact(), Data: fmt.Append(nil, seed)}, nil
	})

	// The reader: direct, and told of departures by its registry.
	r := openRegistry(t, dial(t, srv, resilient...))
	reader := newConnector(t, connect.WithResolver(r), connect.WithBackends(tcp.New(tcp.WithKeepalive(time.Second, kaTimeout))))
	join(t, r, reader)
	id := worker.AgentInfo().ID()
	require.Eventually(t, func() bool { return slices.Contains(r.Agents(), id) }, hangGuard, time.Millisecond)

	read := func(ctx context.Context, rep *Reply) (*connect.ReadOperation, error) {
		return reader.BeginRead(ctx, rep.Metadata, connect.NewDescriptor(make([]byte, rep.Metadata.Sizes()[0])))
	}
	ctx := guarded(t)
	rep, err := Request(ctx, dial(t, srv), "kv", fmt.Append(nil, size), WithRetry(5))
	require.NoError(t, err)
	require.True(t, rep.Metadata.IsCompact())

	hit := make(chan time.Time, 1)
	tcpProxy.When(faultproxy.Downstream, tcpProxy.Stats().Downstream+size/4, func() {
		hit <- time.Now()
		tcpProxy.Stall(faultproxy.Both)
		natsProxy.Stall(faultproxy.Both)
	})
	rop, err := read(ctx, rep)
	require.NoError(t, err)
	err = rop.Wait(ctx)
	at := <-hit
	lost := time.Since(at)
	t.Logf("READ failed %v after the partition: %v", lost.Round(time.Millisecond), err)
	require.ErrorIs(t, err, connect.ErrRemoteLost)
	assert.Contains(t, err.Error(), fmt.Sprintf("agent %s departed", id))
	assert.Less(t, lost, 2*testHeartbeat+2*time.Second, "about two heartbeats, far below the keepalive timeout")

	// The token names a departed agent now.
	_, err = read(ctx, rep)
	require.ErrorIs(t, err, connect.ErrRemoteLost)

	tcpProxy.Heal()
	natsProxy.Heal()
	require.Eventually(t, func() bool { return slices.Contains(r.Agents(), id) }, hangGuard, time.Millisecond,
		"the healed worker never came back")
	rep, err = Request(ctx, dial(t, srv), "kv", fmt.Append(nil, healedSize), WithRetry(20), WithAttemptTimeout(500*time.Millisecond))
	require.NoError(t, err)
	var seed uint64
	_, err = fmt.Sscan(string(rep.Data), &seed)
	require.NoError(t, err)
	readPattern(t, ctx, reader, rep.Metadata, seed)
}

// A server restart while a watch is open, with one agent dying silently
// around it: afterwards the watch reports that one departed, within a few
// heartbeats of the restart, and nobody else; the live agent stays
// present and resolvable.
func TestRegistryRestartWithAPeerDyingAroundIt(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv, resilient...))
	w := r.Watch(guarded(t))
	live := newConnector(t)
	join(t, openRegistry(t, dial(t, srv, resilient...)), live)
	dead := newMortal(t, dial(t, srv, resilient...))
	for range 2 {
		require.False(t, next(t, w).Departed)
	}

	dead.nc.Close() // no goodbye: its entry stays in the bucket
	require.NoError(t, srv.Restart())
	start := time.Now()
	p := next(t, w)
	assert.Equal(t, dead.departure(), p)
	t.Logf("the dead peer departed %v after the restart", time.Since(start).Round(time.Millisecond))
	quiet(t, w, 6*testHeartbeat, "after the restart")
	assert.Equal(t, []uuid.UUID{live.AgentInfo().ID()}, r.Agents())
	_, err := r.Resolve(guarded(t), live.AgentInfo().ID())
	require.NoError(t, err)
	_, err = r.Resolve(guarded(t), dead.id())
	require.ErrorIs(t, err, connect.ErrRemoteLost)
	require.Error(t, dead.reg.Close(), "its Member cannot say goodbye")
}
