package connect

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/mem"
)

// The harness the package's tests share: Connectors and pairs of them,
// buffers and descriptors, passive and active operations, the notices a
// peer sends, and a backend whose transfers stall until cancelled.

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		// A cross-process test's child: serve the parent, then exit.
		os.Exit(runChild(os.Stdin, os.Stdout))
	}
	goleak.VerifyTestMain(m)
}

// transferBackends are the backends every transfer test runs over.
var transferBackends = []string{"mem", "tcp"}

var quiet = WithLogger(slog.New(slog.DiscardHandler))

// hangGuard bounds waits that must end promptly, so a bug fails the test
// instead of hanging it. It asserts nothing about speed.
const hangGuard = 30 * time.Second

func guarded(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), hangGuard)
	t.Cleanup(cancel)
	return ctx
}

// startConnector starts a quiet Connector that the caller closes: one of
// many a test makes in rounds.
func startConnector(tb testing.TB, opts ...Option) *Connector {
	tb.Helper()
	c, err := NewConnector(append([]Option{quiet}, opts...)...)
	require.NoError(tb, err)
	return c
}

// newConnector starts a quiet Connector that is closed, without error,
// when the test ends. The test may close it first: Close is idempotent.
func newConnector(tb testing.TB, opts ...Option) *Connector {
	tb.Helper()
	c := startConnector(tb, opts...)
	tb.Cleanup(func() { assert.NoError(tb, c.Close()) })
	return c
}

// pair returns two Connectors with the default backends, as two services
// would have; the active one moves its bytes over backend.
func pair(tb testing.TB, backend string) (passive, active *Connector) {
	tb.Helper()
	return newConnector(tb), newConnector(tb, WithBackend(backend))
}

// stallPair returns Connectors whose transfers never progress until they are
// cancelled, to catch operations in flight deterministically. Notifications
// still travel over mem.
func stallPair(t *testing.T) (passive, active *Connector, stalled <-chan *agent.Work) {
	t.Helper()
	s := newStall()
	passive = newConnector(t, WithBackends(mem.New(), newStall()))
	active = newConnector(t, WithBackends(mem.New(), s), WithBackend(s.Name()))
	return passive, active, s.posted
}

// stall is a backend whose transfers wait until cancelled or closed.
type stall struct {
	posted chan *agent.Work
	stop   chan struct{}

	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
}

func newStall() *stall {
	return &stall{posted: make(chan *agent.Work, 64), stop: make(chan struct{})}
}

func (s *stall) Name() string                     { return "stall" }
func (s *stall) Start(agent.Host) ([]byte, error) { return []byte{1}, nil }
func (s *stall) Supports(agent.MemKind) bool      { return true }

func (s *stall) Reachable(_ context.Context, info agent.Info) error {
	if _, ok := info.Conn(s.Name()); !ok {
		return errors.New("peer has no stall backend")
	}
	return nil
}

func (s *stall) Post(w *agent.Work) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return agent.ErrClosed
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		select {
		case s.posted <- w:
		default:
		}
		select {
		case <-w.Cancelled():
			w.Finish(w.CancelErr())
		case <-s.stop:
			w.Finish(agent.ErrClosed)
		}
	}()
	return nil
}

func (s *stall) Notify(context.Context, agent.Info, agent.Key, []byte) error {
	return errors.New("stall: no notifications")
}

func (s *stall) Close() error {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.stop)
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

// buffers returns one buffer per size, filled from seed (seed 0: zeros).
func buffers(sizes []int, seed int) [][]byte {
	bufs := make([][]byte, len(sizes))
	for i, n := range sizes {
		b := make([]byte, n)
		if seed != 0 {
			for j := range b {
				b[j] = byte(seed + 131*i + 7*j + j>>8)
			}
		}
		bufs[i] = b
	}
	return bufs
}

func descriptors(bufs [][]byte) []Descriptor {
	ds := make([]Descriptor, len(bufs))
	for i, b := range bufs {
		ds[i] = NewDescriptor(b)
	}
	return ds
}

// uniform returns n sizes of size bytes.
func uniform(n, size int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = size
	}
	return s
}

// requireSame fails at the first byte that differs.
func requireSame(t *testing.T, want, got [][]byte) {
	t.Helper()
	require.Len(t, got, len(want))
	for i := range want {
		if !bytes.Equal(want[i], got[i]) {
			j := 0
			for j < len(want[i]) && j < len(got[i]) && want[i][j] == got[i][j] {
				j++
			}
			require.FailNow(t, fmt.Sprintf("buffer %d differs at byte %d of %d", i, j, len(want[i])))
		}
	}
}

func requireUnregistered(t *testing.T, c *Connector) {
	t.Helper()
	regions, refs := c.a.Registered()
	require.Zero(t, regions, "regions still registered")
	require.Zero(t, refs, "registration references still held")
}

// waiter is what both passive operation types offer.
type waiter interface {
	Metadata() Metadata
	Wait(context.Context) error
	Status() Status
	Close() error
}

// create makes a passive operation of kind over bufs, which the caller
// closes: one of many a test makes in rounds.
func create(tb testing.TB, c *Connector, kind OperationKind, bufs [][]byte) waiter {
	tb.Helper()
	var (
		op  waiter
		err error
	)
	if kind == KindRead {
		op, err = c.CreateReadable(tb.Context(), descriptors(bufs)...)
	} else {
		op, err = c.CreateWritable(tb.Context(), descriptors(bufs)...)
	}
	require.NoError(tb, err)
	return op
}

// expose creates a passive operation of kind over bufs, closed without
// error when the test ends (or before, by the test).
func expose(tb testing.TB, c *Connector, kind OperationKind, bufs [][]byte) waiter {
	tb.Helper()
	op := create(tb, c, kind, bufs)
	tb.Cleanup(func() { assert.NoError(tb, op.Close()) })
	return op
}

// active is what both active operation types offer.
type active interface {
	Wait(context.Context) error
	Status() Status
	Cancel()
	Backend() string
}

// begin starts the active operation md calls for.
func begin(ctx context.Context, c *Connector, md Metadata, bufs [][]byte) (active, error) {
	if md.Kind() == KindWrite {
		op, err := c.BeginWrite(ctx, md, descriptors(bufs)...)
		if err != nil {
			return nil, err
		}
		return op, nil
	}
	op, err := c.BeginRead(ctx, md, descriptors(bufs)...)
	if err != nil {
		return nil, err
	}
	return op, nil
}

// beginWait begins the operation md calls for and waits for it: the error
// of either.
func beginWait(ctx context.Context, c *Connector, md Metadata, bufs [][]byte) error {
	op, err := begin(ctx, c, md, bufs)
	if err != nil {
		return err
	}
	return op.Wait(ctx)
}

// moved begins the operation md calls for, which must complete.
func moved(t *testing.T, ctx context.Context, c *Connector, md Metadata, bufs [][]byte) active {
	t.Helper()
	op, err := begin(ctx, c, md, bufs)
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	return op
}

// goWaits starts n Waits on w in wg; the slice holds their errors once wg
// is done.
func goWaits(wg *sync.WaitGroup, ctx context.Context, w interface{ Wait(context.Context) error }, n int) []error {
	errs := make([]error, n)
	for k := range errs {
		wg.Go(func() { errs[k] = w.Wait(ctx) })
	}
	return errs
}

// lifetimeRounds is how many times a race is run: full, or a tenth of it
// with -short.
func lifetimeRounds(full int) int {
	if testing.Short() {
		return full / 10
	}
	return full
}

// notice sends msg to the passive operation md names, as an active side
// does. Over mem it is delivered before it returns: queued, or handed to a
// Wait blocked on the queue.
func notice(t *testing.T, from *Connector, md Metadata, msg []byte) {
	t.Helper()
	require.NoError(t, from.a.Notify(context.Background(), md.peer, md.key.open(), msg))
}

// reportDone sends the completion notice to the operation md names, as the
// active side does once every byte is in place.
func reportDone(t *testing.T, from *Connector, md Metadata) {
	t.Helper()
	notice(t, from, md, doneNotice)
}

// bindPeer makes from the peer of op without deciding anything: it sends a
// notice of a code this version does not know, which binds the exposure to
// the link it came on, and waits until op is in progress.
func bindPeer(t *testing.T, from *Connector, op waiter) {
	t.Helper()
	notice(t, from, op.Metadata(), []byte{0xee, 'x'})
	require.Eventually(t, func() bool { return op.Status() == StatusInProgress }, hangGuard, time.Millisecond)
}
