package chaos

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/faultproxy"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if testing.Verbose() {
		fmt.Print(stats.String())
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// The keepalive every agent of the suite uses: peers are declared lost
// after a second of silence or of a request left unanswered.
const (
	kaInterval = 100 * time.Millisecond
	kaTimeout  = time.Second
)

// lostWithin is the bound the suite holds every faulted operation to: from
// the moment the fault hits, both sides' Waits end within it. A silent peer
// takes one keepalive timeout to be noticed, a redial stalled behind the
// fault another one (its handshake is bounded by the timeout too); the
// rest is slack for a loaded CI machine running the race detector.
const lostWithin = 3*kaTimeout + 2*time.Second

// callerDeadline is the deadline the suite's callers give their
// operations: far beyond lostWithin, so that an operation that ends by it
// has missed the bound.
const callerDeadline = 20 * time.Second

// hangGuard is how long the suite waits for any Wait before calling it a
// hang.
const hangGuard = callerDeadline + 4*kaTimeout + 10*time.Second

var quiet = connect.WithLogger(slog.New(slog.DiscardHandler))

// rounds returns how many rounds each fault kind runs: GOXFER_CHAOS_ROUNDS,
// else 1, or 25 under the soak build tag.
func rounds(t *testing.T) int {
	if s := os.Getenv("GOXFER_CHAOS_ROUNDS"); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(t, err, "GOXFER_CHAOS_ROUNDS")
		require.Positive(t, n, "GOXFER_CHAOS_ROUNDS")
		return n
	}
	return defaultRounds
}

// pair is two Connectors over tcp alone, the passive one reached only
// through a fault proxy: it advertises the proxy's address, so every byte
// and notification between them crosses the proxy.
type pair struct {
	proxy           *faultproxy.Proxy
	passive, active *connect.Connector
}

func newPair(t *testing.T, opts ...tcp.Option) *pair {
	t.Helper()
	p, err := faultproxy.New("")
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, p.Close()) }) // last: the Connectors say goodbye through it
	base := append([]tcp.Option{tcp.WithKeepalive(kaInterval, kaTimeout)}, opts...)
	ptcp := tcp.New(append(base, tcp.WithAdvertiseAddr(p.Addr()))...)
	passive := newConnector(t, connect.WithBackends(ptcp))
	p.SetUpstream(ptcp.Addr().String())
	active := newConnector(t, connect.WithBackends(tcp.New(base...)))
	return &pair{proxy: p, passive: passive, active: active}
}

func newConnector(t *testing.T, opts ...connect.Option) *connect.Connector {
	t.Helper()
	c, err := connect.NewConnector(append([]connect.Option{quiet}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() {
		done := make(chan error, 1)
		go func() { done <- c.Close() }()
		select {
		case err := <-done:
			assert.NoError(t, err)
		case <-time.After(hangGuard):
			t.Errorf("Connector.Close hung")
		}
	})
	return c
}

// outcome names how an operation ended, for assertions and the report.
func outcome(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, connect.ErrRemoteLost):
		return "remote-lost"
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline"
	case errors.Is(err, connect.ErrCancelled):
		return "cancelled"
	case errors.Is(err, connect.ErrAccessDenied):
		return "access-denied"
	case strings.Contains(err.Error(), "peer reports the transfer failed"):
		return "peer-failed"
	}
	return "other"
}

// stats collects the suite's counts for the report.
var stats = newReport()

type report struct {
	mu        sync.Mutex
	ops       int
	faults    map[string]int
	active    map[string]int
	passive   map[string]int
	slowest   map[string]time.Duration // per fault kind: the longest a Wait took to end after it
	corrupted int64                    // bytes of successful operations that differ: must stay 0
}

func newReport() *report {
	return &report{faults: map[string]int{}, active: map[string]int{}, passive: map[string]int{}, slowest: map[string]time.Duration{}}
}

func (r *report) op(activeOut, passiveOut string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ops++
	r.active[activeOut]++
	r.passive[passiveOut]++
}

func (r *report) fault(kind string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.faults[kind]++
}

func (r *report) took(kind string, d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.slowest[kind] = max(r.slowest[kind], d)
}

func (r *report) corrupt(n int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.corrupted += n
}

func (r *report) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var b strings.Builder
	line := func(name string, m map[string]int) {
		fmt.Fprintf(&b, "chaos: %-16s", name)
		for _, k := range slices.Sorted(maps.Keys(m)) {
			fmt.Fprintf(&b, " %s=%d", k, m[k])
		}
		b.WriteString("\n")
	}
	fmt.Fprintf(&b, "chaos: operations       %d (keepalive %v/%v, bound %v)\n", r.ops, kaInterval, kaTimeout, lostWithin)
	line("faults injected", r.faults)
	line("active outcomes", r.active)
	line("passive outcomes", r.passive)
	for _, k := range slices.Sorted(maps.Keys(r.slowest)) {
		fmt.Fprintf(&b, "chaos: slowest end after %-26s %v\n", k+":", r.slowest[k].Round(time.Millisecond))
	}
	fmt.Fprintf(&b, "chaos: bytes corrupted  %d\n", r.corrupted)
	return b.String()
}
