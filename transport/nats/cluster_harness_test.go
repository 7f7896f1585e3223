package nats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
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

// The harness of the cluster tests (cluster_test.go): a fleet of workers,
// one per server of a NATS cluster, each serving requests and joined to
// the registry over its own connection, clients that send requests back
// to back and keep the time of each success, and presence logs that keep
// every registry's events.

// startCluster starts an embedded cluster of n servers, shut down when the
// test ends.
func startCluster(t testing.TB, n int, opts ...natsserver.Option) *natsserver.Cluster {
	t.Helper()
	c, err := natsserver.StartCluster(context.Background(), n, opts...)
	require.NoError(t, err)
	t.Cleanup(c.Shutdown)
	return c
}

// dialFirst connects to urls[first], failing over to the others in order,
// with the resilient options and then opts; the connection closes when the
// test ends.
func dialFirst(t testing.TB, urls []string, first int, opts ...nats.Option) *nats.Conn {
	t.Helper()
	order := slices.Concat(urls[first:], urls[:first])
	nc, err := nats.Connect(strings.Join(order, ","), slices.Concat(resilient, []nats.Option{nats.DontRandomize()}, opts)...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

// presenceLog keeps every event of a registry's Watch, with its time.
type presenceLog struct {
	mu     sync.Mutex
	events []presenceAt
}

type presenceAt struct {
	at time.Time
	p  Presence
}

// logPresence records r's events until the test ends.
func logPresence(t testing.TB, r *Registry) *presenceLog {
	t.Helper()
	l := &presenceLog{}
	ctx, cancel := context.WithCancel(context.Background())
	w := r.Watch(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for p := range w {
			l.mu.Lock()
			l.events = append(l.events, presenceAt{time.Now(), p})
			l.mu.Unlock()
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return l
}

// departedAt returns when the log first reported id departed after since.
func (l *presenceLog) departedAt(id uuid.UUID, since time.Time) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, e := range l.events {
		if e.p.ID == id && e.p.Departed && !e.at.Before(since) {
			return e.at, true
		}
	}
	return time.Time{}, false
}

// arrivedAt returns when the log first reported id arrived after since.
func (l *presenceLog) arrivedAt(id uuid.UUID, since time.Time) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, e := range l.events {
		if e.p.ID == id && !e.p.Departed && !e.at.Before(since) {
			return e.at, true
		}
	}
	return time.Time{}, false
}

// departures returns the departures reported of the agents ids, as lines.
func (l *presenceLog) departures(ids map[uuid.UUID]string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, e := range l.events {
		if name, ok := ids[e.p.ID]; ok && e.p.Departed {
			out = append(out, fmt.Sprintf("%s departed at %s", name, e.at.Format("15:04:05.000")))
		}
	}
	return out
}

// clusterAgent is a worker of the fleet: a Connector joined to a registry
// over a connection of its own, first on server home, serving "echo" and
// answering with its name in the "Worker" header (unless it is a mortal,
// whose connection the test closes); log keeps what its registry reports.
type clusterAgent struct {
	name string
	nc   *nats.Conn
	reg  *Registry
	c    *connect.Connector
	log  *presenceLog
}

func (a *clusterAgent) id() uuid.UUID { return a.c.AgentInfo().ID() }

// startAgent starts worker name on the cluster whose client URLs are
// urls, its connection first on server home (then the others, in order);
// opts are its connection's options after the resilient ones. It stops
// when the test ends.
func startAgent(t testing.TB, urls []string, home int, name string, opts ...nats.Option) *clusterAgent {
	t.Helper()
	a := startMortal(t, urls, home, name, opts...)
	md := readable(t, a.c, []byte(name)).Metadata()
	serve(t, a.nc, "echo", func(_ context.Context, req *ServiceRequest) (*Reply, error) {
		return &Reply{Metadata: md, Data: req.Data, Header: nats.Header{"Worker": []string{name}}}, nil
	})
	return a
}

// startMortal starts an agent as startAgent does, but serving nothing: the
// test may close its connection to kill it (a Service on a closed
// connection cannot be closed).
func startMortal(t testing.TB, urls []string, home int, name string, opts ...nats.Option) *clusterAgent {
	t.Helper()
	a := &clusterAgent{name: name, nc: dialFirst(t, urls, home, opts...), c: newConnector(t)}
	var err error
	a.reg, err = OpenRegistry(guarded(t), a.nc, registryOptions([]RegistryOption{clusterLog.logger(slog.LevelDebug)})...)
	require.NoError(t, err)
	// A mortal's registry cannot say goodbye: its Close error is ignored.
	t.Cleanup(func() { _ = a.reg.Close() })
	a.log = logPresence(t, a.reg)
	_, err = a.reg.Join(guarded(t), a.c)
	require.NoError(t, err)
	return a
}

// clusterLog gathers the cluster tests' registry logs, printed by
// dumpOnFailure.
var clusterLog lockedBuffer

// dumpOnFailure prints, should the test fail, the registry logs and every
// agent's presence events.
func dumpOnFailure(t *testing.T, agents ...*clusterAgent) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		t.Logf("registry logs:\n%s", clusterLog.String())
		names := agentNames(agents...)
		for _, a := range agents {
			a.log.mu.Lock()
			for _, e := range a.log.events {
				t.Logf("%s %s sees %s %s", e.at.Format("15:04:05.000"), a.name, names[e.p.ID], departedWord(e.p))
			}
			a.log.mu.Unlock()
		}
	})
}

// agentNames maps the agents' IDs to their names.
func agentNames(agents ...*clusterAgent) map[uuid.UUID]string {
	ids := map[uuid.UUID]string{}
	for _, a := range agents {
		ids[a.id()] = a.name
	}
	return ids
}

// loadClient sends "echo" requests back to back over its own connection,
// with the package's retries, and keeps what each request became.
type loadClient struct {
	name string
	nc   *nats.Conn

	mu   sync.Mutex
	sent int
	oks  []success
	errs []error
}

// success is a request answered: when, and by which server the client
// was connected to then.
type success struct {
	at     time.Time
	server string
}

// load is a set of loadClients sending until stop.
type load struct {
	clients []*loadClient
	stop    chan struct{}
	wg      sync.WaitGroup
	once    sync.Once
}

// requestOptions retry for as long as a failover takes: every failure
// after which the request cannot have been handled, or its reply was lost.
var clusterRequestOptions = []RequestOption{WithRetry(1000), WithAttemptTimeout(500 * time.Millisecond), WithTimeout(30 * time.Second)}

// startLoad starts one client per server of urls, each first on its
// server; they send until the returned load stops, or the test ends.
func startLoad(t testing.TB, urls []string, opts ...nats.Option) *load {
	t.Helper()
	l := &load{stop: make(chan struct{})}
	for i := range urls {
		lc := &loadClient{name: fmt.Sprintf("client-%d", i), nc: dialFirst(t, urls, i, opts...)}
		l.clients = append(l.clients, lc)
	}
	for _, lc := range l.clients {
		l.wg.Go(func() { lc.run(l.stop) })
	}
	t.Cleanup(l.halt)
	return l
}

func (lc *loadClient) run(stop <-chan struct{}) {
	for n := 0; ; n++ {
		select {
		case <-stop:
			return
		case <-time.After(2 * time.Millisecond):
		}
		want := fmt.Sprintf("%s request %d", lc.name, n)
		rep, err := Request(context.Background(), lc.nc, "echo", []byte(want), clusterRequestOptions...)
		if err == nil && string(rep.Data) != want {
			err = fmt.Errorf("request %q answered %q", want, rep.Data)
		}
		lc.mu.Lock()
		lc.sent++
		if err != nil {
			lc.errs = append(lc.errs, fmt.Errorf("%s request %d: %w", lc.name, n, err))
		} else {
			lc.oks = append(lc.oks, success{time.Now(), lc.nc.ConnectedServerName()})
		}
		lc.mu.Unlock()
	}
}

// halt stops the clients and waits for their requests in flight.
func (l *load) halt() {
	l.once.Do(func() { close(l.stop) })
	l.wg.Wait()
}

// on returns the clients connected to server now.
func (l *load) on(server string) []*loadClient {
	var out []*loadClient
	for _, lc := range l.clients {
		if lc.nc.ConnectedServerName() == server {
			out = append(out, lc)
		}
	}
	return out
}

// firstSuccess returns the time of lc's first success after since on a
// server other than down, or on down once it is back (back not zero).
func (lc *loadClient) firstSuccess(since time.Time, down string, back time.Time) (time.Time, bool) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	for _, s := range lc.oks {
		if s.at.After(since) && (s.server != down || !back.IsZero() && s.at.After(back)) {
			return s.at, true
		}
	}
	return time.Time{}, false
}

// recovery waits until each of clients has succeeded after since on a
// server other than down, or on down once it is back (back not zero), and
// returns how long after since each did.
func recovery(t *testing.T, clients []*loadClient, since time.Time, down string, back time.Time) []time.Duration {
	t.Helper()
	var out []time.Duration
	for _, lc := range clients {
		var at time.Time
		require.Eventually(t, func() bool {
			var ok bool
			at, ok = lc.firstSuccess(since, down, back)
			return ok
		}, hangGuard, 5*time.Millisecond, "%s: no success after %s went down", lc.name, down)
		out = append(out, at.Sub(since))
	}
	return out
}

// totals returns how many requests the clients sent and the errors of
// those that failed.
func (l *load) totals() (sent int, errs []error) {
	for _, lc := range l.clients {
		lc.mu.Lock()
		sent += lc.sent
		errs = append(errs, lc.errs...)
		lc.mu.Unlock()
	}
	return sent, errs
}

// requireNoneLost stops the load and fails the test if any request failed.
func (l *load) requireNoneLost(t *testing.T) int {
	t.Helper()
	l.halt()
	sent, errs := l.totals()
	require.NoError(t, errors.Join(errs...), "%d of %d requests lost", len(errs), sent)
	return sent
}

// roundAll rounds each duration to the millisecond, for logs.
func roundAll(ds []time.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = d.Round(time.Millisecond)
	}
	return out
}

// openFresh opens a registry over nc, trying again while JetStream does
// not answer (consumer creation needs a JetStream meta leader, which a
// crashed server may have been: the others elect one within seconds), and
// logs how long it took; it closes when the test ends.
func openFresh(t *testing.T, nc *nats.Conn) *Registry {
	t.Helper()
	start := time.Now()
	for try := 1; ; try++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		r, err := OpenRegistry(ctx, nc, registryOptions(nil)...)
		cancel()
		if err == nil {
			t.Cleanup(func() { assert.NoError(t, r.Close()) })
			t.Logf("a fresh registry opened in %v (%d tries)", time.Since(start).Round(time.Millisecond), try)
			return r
		}
		require.Less(t, time.Since(start), hangGuard, "no fresh registry: %v", err)
		time.Sleep(100 * time.Millisecond)
	}
}

// waitFor checks cond every 5 ms until it holds or d has passed, and says
// whether it held; unlike require.Eventually, it leaves failing to the
// caller.
func waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

// requireHealthy waits until every agent's registry hears its bucket again.
func requireHealthy(t *testing.T, agents ...*clusterAgent) {
	t.Helper()
	for _, a := range agents {
		require.Eventually(t, func() bool { return a.reg.Err() == nil }, hangGuard, 10*time.Millisecond,
			"%s's registry: %v", a.name, a.reg.Err())
	}
}

// requireNoDepartures fails the test if any agent's registry reported one
// of live departed.
func requireNoDepartures(t *testing.T, live map[uuid.UUID]string, agents ...*clusterAgent) {
	t.Helper()
	for _, a := range agents {
		assert.Empty(t, a.log.departures(live), "%s's registry declared live agents departed", a.name)
	}
}

// routeMesh routes a cluster's route connections through fault proxies,
// so that a test can cut one server off from the others while it and its
// clients run on: pair[i][j] carries the routes server i dials to server
// j. adv[i] is the route address server i advertises, which the others
// learn by gossip and may dial too (an implicit route): it refuses every
// connection, for one that server i made to adv[j] would carry a route
// from i to j that no proxy of i's carries, and cut(i) would leave it up
// (the cut-off server then kept a route, and with it a quorum, in some
// runs). Give option() to StartCluster.
type routeMesh struct {
	pair [][]*faultproxy.Proxy
	adv  []*faultproxy.Proxy
}

// newRouteMesh makes the proxies of an n-server cluster; they close when
// the test ends, after the cluster if the cluster starts after this.
func newRouteMesh(t testing.TB, n int) *routeMesh {
	t.Helper()
	proxy := func() *faultproxy.Proxy {
		p, err := faultproxy.New("")
		require.NoError(t, err)
		t.Cleanup(func() { assert.NoError(t, p.Close()) })
		return p
	}
	m := &routeMesh{pair: make([][]*faultproxy.Proxy, n), adv: make([]*faultproxy.Proxy, n)}
	for i := range n {
		m.adv[i] = proxy()
		m.pair[i] = make([]*faultproxy.Proxy, n)
		for j := range n {
			if j != i {
				m.pair[i][j] = proxy()
			}
		}
	}
	return m
}

// option points each server's routes and advertised route address at the
// mesh's proxies, and the proxies at the server's route port.
func (m *routeMesh) option() natsserver.Option {
	return natsserver.WithServerOptions(func(o *server.Options) {
		i, err := strconv.Atoi(strings.TrimPrefix(o.ServerName, "goxfer-"))
		if err != nil || i >= len(m.adv) {
			panic(fmt.Sprintf("routeMesh: server %q is not in the mesh", o.ServerName))
		}
		addr := net.JoinHostPort(o.Cluster.Host, strconv.Itoa(o.Cluster.Port))
		o.Cluster.Advertise = m.adv[i].Addr() // no upstream: refused
		o.Routes = nil
		for j, p := range m.pair[i] {
			if j != i {
				m.pair[j][i].SetUpstream(addr)
				o.Routes = append(o.Routes, &url.URL{Scheme: "nats-route", Host: p.Addr()})
			}
		}
	})
}

// touching returns the proxies that carry server i's routes.
func (m *routeMesh) touching(i int) []*faultproxy.Proxy {
	var ps []*faultproxy.Proxy
	for j := range m.adv {
		if j != i {
			ps = append(ps, m.pair[i][j], m.pair[j][i])
		}
	}
	return ps
}

// cut partitions server i from the others, as a firewall that rejects
// would: its routes are reset and every new one refused. Its clients stay
// connected to it.
//
// A route connection that a proxy accepted before it refused, and was
// still dialing its upstream while the proxy reset the others, would
// survive one round of resets: they are repeated until three rounds in a
// row find nothing to close.
func (m *routeMesh) cut(i int) {
	ps := m.touching(i)
	for _, p := range ps {
		p.Refuse(true)
	}
	for quiet := 0; quiet < 3; time.Sleep(20 * time.Millisecond) {
		n := 0
		for _, p := range ps {
			n += p.Reset()
		}
		if n == 0 {
			quiet++
		} else {
			quiet = 0
		}
	}
}

// heal lets server i's routes through again; the servers re-dial them.
func (m *routeMesh) heal(i int) {
	for _, p := range m.touching(i) {
		p.Heal()
	}
}

// bucketLeader returns the server that leads the registry bucket's stream.
func bucketLeader(t *testing.T, nc *nats.Conn) string {
	t.Helper()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	s, err := js.Stream(guarded(t), "KV_"+defaultBucket)
	require.NoError(t, err)
	info, err := s.Info(guarded(t))
	require.NoError(t, err)
	require.NotNil(t, info.Cluster)
	return info.Cluster.Leader
}
