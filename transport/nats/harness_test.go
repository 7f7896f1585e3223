package nats

import (
	"bytes"
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/faultproxy"
	"github.com/goxfer/goxfer/internal/pattern"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// The test harness every test file of the package shares: servers and
// connections, Connectors and tokens, services and subscriptions,
// registries, their members and their watches. Everything a helper starts
// ends with the test.

// hangGuard bounds every test's blocking calls: far beyond what any of
// them needs, it only turns a hang into a failure.
const hangGuard = 30 * time.Second

// testHeartbeat keeps registry tests fast; departures take two of them.
const testHeartbeat = 250 * time.Millisecond

var quietLog = slog.New(slog.DiscardHandler)

// guarded returns a context that ends after hangGuard, or with the test.
func guarded(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	t.Cleanup(cancel)
	return ctx
}

// startServer starts an embedded server, shut down when the test ends.
func startServer(t testing.TB, opts ...natsserver.Option) *natsserver.Server {
	t.Helper()
	srv, err := natsserver.Start(context.Background(), opts...)
	require.NoError(t, err)
	t.Cleanup(srv.Shutdown)
	return srv
}

// resilient are client options for tests that restart the server: retry
// reconnecting quickly and forever.
var resilient = []nats.Option{nats.ReconnectWait(20 * time.Millisecond), nats.MaxReconnects(-1), nats.ReconnectJitter(0, 0)}

// dial connects to srv; the connection closes when the test ends.
func dial(t testing.TB, srv *natsserver.Server, opts ...nats.Option) *nats.Conn {
	t.Helper()
	nc, err := srv.Connect(opts...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

// proxied connects to srv through a fault proxy, with the resilient
// options and then opts; the proxy and the connection end with the test.
func proxied(t testing.TB, srv *natsserver.Server, opts ...nats.Option) (*nats.Conn, *faultproxy.Proxy) {
	t.Helper()
	p, err := faultproxy.New(strings.TrimPrefix(srv.URL(), "nats://"))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, p.Close()) })
	nc, err := nats.Connect("nats://"+p.Addr(), slices.Concat(resilient, opts)...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc, p
}

// newConnector returns a Connector that logs nothing, closed when the test
// ends.
func newConnector(t testing.TB, opts ...connect.Option) *connect.Connector {
	t.Helper()
	c, err := connect.NewConnector(append([]connect.Option{connect.WithLogger(quietLog)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, c.Close()) })
	return c
}

// readable exposes b on c for reading; the operation closes when the test
// ends.
func readable(t testing.TB, c *connect.Connector, b []byte) *connect.ReadableOperation {
	t.Helper()
	op, err := c.CreateReadable(context.Background(), connect.NewDescriptor(b))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, op.Close()) })
	return op
}

// readPattern reads with c what the one-descriptor token md names into a
// fresh buffer, and checks that it holds seed's pattern.
func readPattern(t testing.TB, ctx context.Context, c *connect.Connector, md connect.Metadata, seed uint64) {
	t.Helper()
	dst := make([]byte, md.Sizes()[0])
	rop, err := c.BeginRead(ctx, md, connect.NewDescriptor(dst))
	require.NoError(t, err)
	require.NoError(t, rop.Wait(ctx))
	require.NoError(t, pattern.Check(dst, seed, 0, 0))
}

// testToken returns a real token over a small buffer.
func testToken(t testing.TB) connect.Metadata {
	t.Helper()
	c := newConnector(t)
	return readable(t, c, []byte("block")).Metadata()
}

// serve runs h on subject until the test ends.
func serve(t testing.TB, nc *nats.Conn, subject string, h Handler, opts ...ServeOption) *Service {
	t.Helper()
	s, err := Serve(nc, subject, h, append([]ServeOption{WithLogger(quietLog)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, s.Close()) })
	return s
}

// subscribe subscribes to subject until the test ends; the server has the
// subscription when it returns.
func subscribe(t testing.TB, nc *nats.Conn, subject string, opts ...SubscribeOption) *Subscription {
	t.Helper()
	s, err := Subscribe(nc, subject, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, s.Close()) })
	require.NoError(t, nc.Flush())
	return s
}

// registryOptions are the options of a test's registries: testHeartbeat,
// quietLog, then opts.
func registryOptions(opts []RegistryOption) []RegistryOption {
	return append([]RegistryOption{WithHeartbeat(testHeartbeat), WithLogger(quietLog)}, opts...)
}

// openRegistry opens a registry over nc; it must close cleanly when the
// test ends.
func openRegistry(t testing.TB, nc *nats.Conn, opts ...RegistryOption) *Registry {
	t.Helper()
	r, err := OpenRegistry(guarded(t), nc, registryOptions(opts)...)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, r.Close()) })
	return r
}

// join joins c to r; the Member leaves when the test ends.
func join(t testing.TB, r *Registry, c *connect.Connector, opts ...JoinOption) *Member {
	t.Helper()
	m, err := r.Join(guarded(t), c, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	return m
}

// closeDuringFailingJoin opens a registry, shuts its server down, starts a
// Join whose first put cannot be acknowledged (its context lasting
// joinCtx) and, once the Registry has the Member, a Close. It returns when
// the Close began, and the channels on which the Join and the Close
// return.
func closeDuringFailingJoin(t *testing.T, joinCtx time.Duration) (start time.Time, joined, closed <-chan error) {
	t.Helper()
	srv := startServer(t)
	nc := dial(t, srv, resilient...)
	r, err := OpenRegistry(guarded(t), nc, registryOptions(nil)...)
	require.NoError(t, err)
	srv.Shutdown() // the put waits for an acknowledgement that cannot come
	require.Eventually(t, func() bool { return nc.Status() != nats.CONNECTED }, hangGuard, time.Millisecond)
	j := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), joinCtx)
		defer cancel()
		_, err := r.Join(ctx, newConnector(t))
		j <- err
	}()
	// Close while the put is in flight: it sees the Member registered.
	require.Eventually(t, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.members) == 1
	}, hangGuard, time.Millisecond)
	c := make(chan error, 1)
	start = time.Now()
	go func() { c <- r.Close() }()
	return start, j, c
}

// await returns what ch delivers, failing the test if nothing comes within
// hangGuard.
func await[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(hangGuard):
		t.Fatalf("%s: nothing within %v", what, hangGuard)
	}
	var zero T
	return zero
}

// mortal is an agent that can die without a goodbye: a Connector joined
// to a registry of its own over a connection of its own, which the test
// closes to kill it (its entry stays in the bucket until it expires).
type mortal struct {
	nc  *nats.Conn
	reg *Registry
	c   *connect.Connector
}

// newMortal joins a fresh Connector to a registry opened over nc with the
// registry options and opts (a WithHeartbeat among them is the Member's
// too). The registry closes when the test ends, and its error is ignored:
// a dead agent cannot say goodbye.
func newMortal(t testing.TB, nc *nats.Conn, opts ...RegistryOption) mortal {
	t.Helper()
	c := newConnector(t)
	reg, err := OpenRegistry(guarded(t), nc, registryOptions(opts)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = reg.Close() })
	_, err = reg.Join(guarded(t), c)
	require.NoError(t, err)
	return mortal{nc: nc, reg: reg, c: c}
}

func (m mortal) id() uuid.UUID { return m.c.AgentInfo().ID() }

// arrival is the event a Watch reports when m arrives.
func (m mortal) arrival() Presence { return Presence{ID: m.id(), Info: m.c.AgentInfo()} }

// departure is the event a Watch reports when m departs.
func (m mortal) departure() Presence {
	return Presence{ID: m.id(), Info: m.c.AgentInfo(), Departed: true}
}

// next returns the next presence event, failing the test if none comes.
func next(t *testing.T, w <-chan Presence) Presence {
	t.Helper()
	return within(t, w, hangGuard, "a presence event")
}

// within returns the next event of w, or fails the test if none comes in d.
func within(t *testing.T, w <-chan Presence, d time.Duration, what string) Presence {
	t.Helper()
	select {
	case p, ok := <-w:
		require.True(t, ok, "watch closed")
		return p
	case <-time.After(d):
		t.Fatalf("%s: nothing within %v", what, d)
	}
	return Presence{}
}

// quiet fails the test if w reports anything within d.
func quiet(t *testing.T, w <-chan Presence, d time.Duration, what string) {
	t.Helper()
	select {
	case p, ok := <-w:
		if ok {
			t.Fatalf("%s: %s %s", what, departedWord(p), p.ID)
		}
		t.Fatalf("%s: the watch closed", what)
	case <-time.After(d):
	}
}

func departedWord(p Presence) string {
	if p.Departed {
		return "departed"
	}
	return "arrived"
}

// lockedBuffer is a buffer safe for concurrent writes, for logs.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// logger is a WithLogger that writes text lines of level and above to l.
func (l *lockedBuffer) logger(level slog.Level) LoggerOption {
	return WithLogger(slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: level})))
}
