package chaos

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/faultproxy"
	"github.com/goxfer/goxfer/internal/pattern"
)

// op is the kind of active operation a round runs.
type op string

const (
	read  op = "read"
	write op = "write"
)

// data returns the direction, through the proxy, that op's bytes flow in:
// the passive side's agent is the proxy's upstream.
func (o op) data() faultproxy.Direction {
	if o == read {
		return faultproxy.Downstream
	}
	return faultproxy.Upstream
}

// shape is a descriptor list.
type shape struct {
	name  string
	sizes []int
}

func uniform(n, size int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = size
	}
	return s
}

func (s shape) total() int {
	n := 0
	for _, v := range s.sizes {
		n += v
	}
	return n
}

var (
	large = shape{"1x8MiB", []int{8 << 20}}
	small = shape{"512x8KiB", uniform(512, 8<<10)}
)

// combos are every operation kind with every shape.
var combos = []struct {
	op    op
	shape shape
}{{read, large}, {read, small}, {write, large}, {write, small}}

// fault is a fault kind the proxy injects mid-transfer.
type fault struct {
	name string
	// inject injects the fault; data is the direction the operation's
	// bytes flow in. It runs on a proxy goroutine and must not block.
	inject func(p *faultproxy.Proxy, data faultproxy.Direction)
	// mustFail: the fault cuts the operation's bytes off, so it cannot
	// succeed. mustSucceed: the fault is one TCP rides out.
	mustFail, mustSucceed bool
	// blocksNew: while the fault holds, a new operation cannot succeed
	// either; one is tried and must fail within the bound.
	blocksNew bool
}

var faults = []fault{
	{name: "reset", mustFail: true,
		inject: func(p *faultproxy.Proxy, _ faultproxy.Direction) { p.Reset() }},
	{name: "stall", mustFail: true, blocksNew: true,
		inject: func(p *faultproxy.Proxy, _ faultproxy.Direction) { p.Stall(faultproxy.Both) }},
	{name: "stall-data-direction", mustFail: true,
		inject: func(p *faultproxy.Proxy, d faultproxy.Direction) { p.Stall(d) }},
	// Frames already requested may all be answered: a READ can succeed,
	// its completion then never reaching the passive side.
	{name: "stall-other-direction",
		inject: func(p *faultproxy.Proxy, d faultproxy.Direction) { p.Stall(faultproxy.Both &^ d) }},
	{name: "half-open-passive-gone", mustFail: true,
		inject: func(p *faultproxy.Proxy, _ faultproxy.Direction) { p.HalfOpen(faultproxy.Server) }},
	{name: "half-open-active-gone", mustFail: true,
		inject: func(p *faultproxy.Proxy, _ faultproxy.Direction) { p.HalfOpen(faultproxy.Client) }},
	{name: "half-close-data-direction", mustFail: true,
		inject: func(p *faultproxy.Proxy, d faultproxy.Direction) { p.HalfClose(d) }},
	{name: "reset-and-refuse", mustFail: true, blocksNew: true,
		inject: func(p *faultproxy.Proxy, _ faultproxy.Direction) { p.Refuse(true); p.Reset() }},
	// A partition shorter than the keepalive timeout is ridden out.
	{name: "blip", mustSucceed: true,
		inject: func(p *faultproxy.Proxy, _ faultproxy.Direction) {
			p.Stall(faultproxy.Both)
			time.AfterFunc(kaTimeout/5, func() { p.Resume(faultproxy.Both) })
		}},
}

// result is how one round went.
type result struct {
	active, passive error
	// since the fault hit (or the operation began, without a fault)
	activeAfter, passiveAfter time.Duration
	injected                  bool
}

// round runs one operation of kind o and shape sh between the pair. With a
// fault f, the proxy injects it once a quarter of the operation's bytes
// have crossed. It checks what must hold whatever happened: both Waits end
// in time, with an outcome the fault allows; every success is exact; no
// guard byte around any descriptor is touched; the passive side never
// reports success for an operation that did not succeed.
func (pr *pair) round(t *testing.T, o op, sh shape, f *fault, deadline time.Duration) result {
	t.Helper()
	return pr.run(t, o, sh, f, deadline, false)
}

// run is round; with unreached, the fault may keep the active side from
// ever reaching the passive one, whose operation then stays bound to no
// peer and hears nothing (docs/concepts.md): its Wait is given a keepalive
// timeout only, and may end with that deadline.
func (pr *pair) run(t *testing.T, o op, sh shape, f *fault, deadline time.Duration, unreached bool) result {
	t.Helper()
	seed := pattern.NextSeed()
	ps, as := pattern.NewSlab(sh.sizes), pattern.NewSlab(sh.sizes)
	src, dst := ps, as
	if o == write {
		src, dst = as, ps
	}
	src.Fill(seed)

	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	var pop interface {
		Metadata() connect.Metadata
		Wait(context.Context) error
		Close() error
	}
	var err error
	if o == read {
		pop, err = pr.passive.CreateReadable(ctx, descs(ps)...)
	} else {
		pop, err = pr.passive.CreateWritable(ctx, descs(ps)...)
	}
	require.NoError(t, err)

	hit := make(chan time.Time, 1)
	if f != nil {
		var base int64
		if st := pr.proxy.Stats(); o == read {
			base = st.Downstream
		} else {
			base = st.Upstream
		}
		disarm := pr.proxy.When(o.data(), base+int64(sh.total()/4), func() {
			hit <- time.Now()
			f.inject(pr.proxy, o.data())
		})
		defer disarm()
	}
	start := time.Now()
	var aop interface{ Wait(context.Context) error }
	if o == read {
		aop, err = pr.active.BeginRead(ctx, pop.Metadata(), descs(as)...)
	} else {
		aop, err = pr.active.BeginWrite(ctx, pop.Metadata(), descs(as)...)
	}
	require.NoError(t, err)

	var r result
	var aEnd, pEnd time.Time
	r.active, aEnd = guarded(t, "active Wait", aop.Wait)
	// The passive side must hear within the bound of the fault, or of the
	// active side's end.
	pwait := lostWithin + deadline
	if unreached {
		pwait = kaTimeout
	}
	pctx, pcancel := context.WithTimeout(context.Background(), pwait)
	r.passive, pEnd = guarded(t, "passive Wait", func(context.Context) error { return pop.Wait(pctx) })
	pcancel()
	require.NoError(t, pop.Close())

	from := start
	select {
	case at := <-hit:
		r.injected, from = true, at
		stats.fault(f.name)
	default:
	}
	r.activeAfter, r.passiveAfter = aEnd.Sub(from), pEnd.Sub(from)
	aout, pout := outcome(r.active), outcome(r.passive)
	stats.op(aout, pout)
	name := "no fault"
	if f != nil {
		name = f.name
	}
	t.Logf("%s %s, %s: active %s after %v, passive %s after %v", o, sh.name, name,
		aout, r.activeAfter.Round(time.Millisecond), pout, r.passiveAfter.Round(time.Millisecond))

	// Every success is exact; a failed WRITE may have written part.
	if r.active == nil {
		checkExact(t, dst, seed, "a successful "+string(o))
	}
	if r.passive == nil && o == write {
		checkExact(t, ps, seed, "a WRITE the passive side saw complete")
	}
	assert.NoError(t, ps.CheckGuards(), "passive side")
	assert.NoError(t, as.CheckGuards(), "active side")

	assert.Contains(t, []string{"ok", "remote-lost", "deadline"}, aout, "active: %v", r.active)
	passiveOK := []string{"ok", "remote-lost", "cancelled", "peer-failed"}
	if unreached {
		passiveOK = append(passiveOK, "deadline")
	}
	assert.Contains(t, passiveOK, pout, "passive: %v", r.passive)
	if r.passive == nil {
		assert.NoError(t, r.active, "the passive side saw a completion the active side did not report")
	}
	if f != nil {
		require.True(t, r.injected, "the fault was never injected")
		stats.took(f.name, max(r.activeAfter, r.passiveAfter))
		if f.mustFail {
			assert.Error(t, r.active, "%s succeeded though %s cut its bytes off", o, f.name)
		}
		if f.mustSucceed {
			assert.NoError(t, r.active)
			assert.NoError(t, r.passive)
		}
		if r.active != nil {
			assert.LessOrEqual(t, r.activeAfter, lostWithin, "the active side took too long to fail")
		}
		if r.passive != nil && !unreached {
			assert.LessOrEqual(t, r.passiveAfter, lostWithin, "the passive side took too long to fail")
		}
	}
	return r
}

// mustSucceed runs a round without a fault, which must succeed on both
// sides.
func (pr *pair) mustSucceed(t *testing.T, o op, sh shape) result {
	t.Helper()
	r := pr.round(t, o, sh, nil, callerDeadline)
	require.NoError(t, r.active, "%s %s", o, sh.name)
	require.NoError(t, r.passive, "%s %s", o, sh.name)
	return r
}

// guarded calls wait and returns its error and when it returned, failing
// the test if it does not return within hangGuard.
func guarded(t *testing.T, what string, wait func(context.Context) error) (error, time.Time) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- wait(context.Background()) }()
	select {
	case err := <-done:
		return err, time.Now()
	case <-time.After(hangGuard):
		t.Fatalf("%s hung for %v", what, hangGuard)
		return nil, time.Time{}
	}
}

func descs(s *pattern.Slab) []connect.Descriptor {
	bufs := s.Bufs()
	ds := make([]connect.Descriptor, len(bufs))
	for i, b := range bufs {
		ds[i] = connect.NewDescriptor(b)
	}
	return ds
}

// checkExact asserts that slab s holds pattern seed, counting the bytes
// that differ in the report.
func checkExact(t *testing.T, s *pattern.Slab, seed uint64, what string) {
	t.Helper()
	if err := s.Check(seed); err != nil {
		stats.corrupt(differing(s, seed))
		t.Errorf("%s is not exact: %v", what, err)
	}
}

func differing(s *pattern.Slab, seed uint64) int64 {
	var n int64
	for i, b := range s.Bufs() {
		want := make([]byte, len(b))
		pattern.Fill(want, seed, i, 0)
		if bytes.Equal(want, b) {
			continue
		}
		for j := range b {
			if b[j] != want[j] {
				n++
			}
		}
	}
	return n
}

// Every fault kind, injected mid-transfer into READs and WRITEs of one
// large and of many small descriptors: each operation ends within the
// bound, exact or with ErrRemoteLost, and the next one after the fault is
// lifted succeeds through the same Connectors.
func TestFaultsMidTransfer(t *testing.T) {
	n := rounds(t)
	for _, f := range faults {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			pr := newPair(t)
			for i := range n {
				for _, c := range combos {
					t.Run(fmt.Sprintf("%s-%s-%d", c.op, c.shape.name, i), func(t *testing.T) {
						pr.round(t, c.op, c.shape, &f, callerDeadline)
						if f.blocksNew {
							// Still faulted: a new operation fails too, in time.
							r := pr.run(t, c.op, c.shape, nil, callerDeadline, true)
							assert.Error(t, r.active, "an operation succeeded through %s", f.name)
							assert.LessOrEqual(t, r.activeAfter, lostWithin)
						}
						pr.proxy.Heal()
						pr.mustSucceed(t, c.op, c.shape)
					})
				}
			}
		})
	}
}

// Latency makes operations slower, never wrong.
func TestLatency(t *testing.T) {
	t.Parallel()
	const oneWay, jitter = 25 * time.Millisecond, 10 * time.Millisecond
	pr := newPair(t)
	pr.proxy.Latency(faultproxy.Both, oneWay, jitter)
	for range rounds(t) {
		for _, c := range combos {
			r := pr.mustSucceed(t, c.op, c.shape)
			// A request and its answer cross the proxy, each way delayed.
			assert.GreaterOrEqual(t, r.activeAfter, 2*(oneWay-jitter))
		}
	}
}

// An operation slower than its caller's deadline fails with the deadline,
// the passive side hears it was cancelled, and the next one, given time,
// succeeds.
func TestLatencyBeyondTheCallersDeadline(t *testing.T) {
	t.Parallel()
	pr := newPair(t)
	pr.proxy.Latency(faultproxy.Both, 50*time.Millisecond, 0)
	for range rounds(t) {
		for _, c := range combos {
			r := pr.round(t, c.op, c.shape, nil, 60*time.Millisecond)
			require.ErrorIs(t, r.active, context.DeadlineExceeded)
			require.ErrorIs(t, r.active, connect.ErrCancelled)
			assert.Contains(t, []string{"cancelled", "remote-lost"}, outcome(r.passive), "passive: %v", r.passive)
			assert.LessOrEqual(t, r.passiveAfter, lostWithin)
			pr.mustSucceed(t, c.op, c.shape)
		}
	}
}

// A bandwidth limit makes operations slower, never wrong, as long as one
// chunk per stream crosses within the keepalive timeout (see
// TestBandwidthBelowOneChunkPerTimeout).
func TestBandwidthLimit(t *testing.T) {
	t.Parallel()
	const rate = 32 << 20 // bytes per second, each way: 8 MiB/s per stream
	pr := newPair(t)
	pr.proxy.Bandwidth(faultproxy.Both, rate)
	for range rounds(t) {
		for _, c := range combos {
			r := pr.mustSucceed(t, c.op, c.shape)
			floor := time.Duration(int64(c.shape.total()-rate/50) * int64(time.Second) / rate)
			assert.GreaterOrEqual(t, r.activeAfter, floor, "faster than the link allows")
		}
	}
}

// When the active peer vanishes behind the proxy, the goroutines the dead
// connections used, on both agents and in the proxy, all end: the count
// returns to what it was with the connections up.
func TestGoroutinesReturnToBaseline(t *testing.T) {
	pr := newPair(t)
	pr.mustSucceed(t, read, small) // connections up
	settle := func() int {
		runtime.GC()
		return runtime.NumGoroutine()
	}
	base := settle()
	for _, name := range []string{"stall", "half-open-active-gone", "reset"} {
		f := faultNamed(t, name)
		for _, c := range combos {
			pr.round(t, c.op, c.shape, &f, callerDeadline)
			pr.proxy.Heal()
			pr.mustSucceed(t, c.op, c.shape)
		}
	}
	deadline := time.Now().Add(4 * lostWithin)
	now := settle()
	for now > base && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
		now = settle()
	}
	if now > base {
		var b strings.Builder
		_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
		t.Fatalf("goroutines: %d with connections up, still %d after the faults:\n%s", base, now, b.String())
	}
	t.Logf("goroutines: %d with connections up, %d after the faults", base, now)
}

func faultNamed(t *testing.T, name string) fault {
	for _, f := range faults {
		if f.name == name {
			return f
		}
	}
	t.Fatalf("no fault %q", name)
	return fault{}
}

// A link slow enough that one chunk takes longer than the keepalive
// timeout to cross is alive, and bytes flow on it all the time; operations
// over it should be slow, not lost: a frame's deadline is extended while
// bytes keep moving (see minProgress in agent/backend/tcp).
func TestBandwidthBelowOneChunkPerTimeout(t *testing.T) {
	t.Parallel()
	const rate = 1 << 20 // bytes per second: a 2 MiB chunk takes 2 s, the timeout is 1 s
	pr := newPair(t, tcp.WithStreams(1))
	pr.proxy.Bandwidth(faultproxy.Both, rate)
	for _, o := range []op{read, write} {
		r := pr.round(t, o, shape{"1x4MiB", []int{4 << 20}}, nil, callerDeadline)
		assert.NoError(t, r.active, "%s over a live link at %d KiB/s", o, rate>>10)
		assert.NoError(t, r.passive, "%s over a live link at %d KiB/s", o, rate>>10)
	}
}
