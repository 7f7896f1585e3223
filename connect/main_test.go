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

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/mem"
)

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

func newConnector(t *testing.T, opts ...Option) *Connector {
	t.Helper()
	c, err := NewConnector(append([]Option{quiet}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, c.Close()) })
	return c
}

// pair returns two Connectors with the default backends, as two services
// would have; the active one moves its bytes over backend.
func pair(t *testing.T, backend string) (passive, active *Connector) {
	t.Helper()
	return newConnector(t), newConnector(t, WithBackend(backend))
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

func (s *stall) Post(x *agent.Work) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return agent.ErrClosed
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		select {
		case s.posted <- x:
		default:
		}
		select {
		case <-x.Cancelled():
			x.Finish(x.CancelErr())
		case <-s.stop:
			x.Finish(agent.ErrClosed)
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

// uniform returns n sizes of size bytes.
func uniform(n, size int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = size
	}
	return s
}

// waiter is what both passive operation types offer.
type waiter interface {
	Metadata() Metadata
	Wait(context.Context) error
	Status() Status
	Close() error
}
