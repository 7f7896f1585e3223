package soak

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/testproc"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild(os.Stdin, os.Stdout))
	}
	goleak.VerifyTestMain(m)
}

// Environment variables that adjust a run.
const (
	opsEnv    = "GOXFER_SOAK_OPS"    // measured operations per backend, instead of the mode's
	reportEnv = "GOXFER_SOAK_REPORT" // a file to write the reports to, as JSON
	// profilesEnv names a directory where both processes write heap
	// profiles at every quiescent sample:
	// <backend>-<parent|child>-<start|q1|mid|q3|end>.pprof.
	profilesEnv = "GOXFER_SOAK_PROFILES"
)

// Flatness tolerances; see docs/reliability.md#soak for why these. Both
// processes are sampled at rest after the warm-up (start), after each
// quarter of the operations, and at the end.
const (
	// goroutineSlack is how many more goroutines a process may run at any
	// later sample than at the start: every Connector goroutine (tcp
	// streams, cma workers) exists after the warm-up, so any growth is a
	// leak, but a timer or a NATS ping may be in flight.
	goroutineSlack = 3
	// rssSlack is how much more resident memory a process may hold at the
	// end than at the start: the larger of rssSlackMin and rssSlackFrac of
	// the start. Both samples are taken after a GC that returns free memory
	// to the OS, but the heap's fragmentation and page-granular scavenging
	// leave some MiB that depend on the operations' sizes, and maps keep
	// the size of their peak (see heapCap).
	rssSlackMin  = 64 << 20
	rssSlackFrac = 0.25
	// A leak grows memory in proportion to the operations: in each of the
	// last two quarters. Growth in one quarter only is a step, such as a
	// map's tables doubling after a new peak of concurrent registrations
	// (Go maps never shrink), which heapCap bounds. So memory may grow by
	// more than heapQuarterSlack (live heap) or rssQuarterSlack (RSS) in
	// one of the last two quarters, not in both. In the full run a leak of
	// 500 bytes per operation shows; in longer runs (GOXFER_SOAK_OPS),
	// smaller ones.
	heapQuarterSlack = 1 << 20
	rssQuarterSlack  = 8 << 20
	// heapCap is how much more live heap a process may hold at the end than
	// at the start, whatever the shape of the growth.
	heapCap = 32 << 20
	// shmemSlack is how much shared memory (RssShmem) a process may hold
	// resident at rest, when every segment is freed: the lease tables of
	// its cma connection, its own and the peer's (at most 260 KiB each;
	// 0.3 MiB measured for both), with room to spare. Segments are shmem
	// pages, counted in VmRSS but not in RssAnon, where the heap is; while
	// operations are in flight a segment is resident in both processes.
	shmemSlack = 4 << 20
)

// backends are the backends that cross processes, each run in a subtest:
// tcp, cma with memory on the Go heap, and cma with every slab in shared
// host memory (Connector.AllocHost), which cma maps instead of leasing.
var backends = []string{"tcp", "cma", "shm"}

// paths are the backend and the paths every transfer of a subtest must
// take: over cma, an exposure of one slab of Go heap memory is copied
// inside the lease table (cma+table) when it fits one call, others under
// leases (cma).
var paths = map[string]struct {
	backend string
	paths   []string
}{
	"tcp": {"tcp", []string{"tcp"}},
	"cma": {"cma", []string{"cma", "cma+table"}},
	"shm": {"cma", []string{"cma+shm"}},
}

func TestSoak(t *testing.T) {
	cfg := mode
	if v := os.Getenv(opsEnv); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err, "%s=%q", opsEnv, v)
		require.Positive(t, n, "%s", opsEnv)
		cfg.ops = n
	}
	var (
		mu      sync.Mutex
		reports []*report
	)
	for _, backend := range backends {
		t.Run(backend, func(t *testing.T) {
			switch {
			case backend == "cma" && runtime.GOOS != "linux":
				t.Skip("cma is Linux's")
			case backend == "shm" && runtime.GOOS != "linux":
				t.Skip("shared host memory (AllocHost, memfd segments) and cma are Linux's")
			}
			r := soak(t, cfg, backend)
			if r != nil {
				mu.Lock()
				reports = append(reports, r)
				mu.Unlock()
			}
		})
	}
	if path := os.Getenv(reportEnv); path != "" {
		b, err := json.MarshalIndent(reports, "", "  ")
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(path, append(b, '\n'), 0o644))
		t.Logf("reports written to %s", path)
	}
}

// runner is one backend's soak, seen from the parent.
type runner struct {
	t      *testing.T
	cfg    config
	seed   uint64
	name   string   // the subtest's: tcp, cma or shm
	want   string   // the backend every transfer must use
	paths  []string // and the paths it may take
	conn   *connect.Connector
	mem    memory
	nc     *nats.Conn
	child  *testproc.Child[ctlRequest, ctlResponse]
	pid    int
	subj   string
	tally  *tally
	n      counts
	nMu    sync.Mutex
	flight atomic.Int64
}

// soak runs cfg's soak over backend and returns its report, or nil if the
// backend is not available here.
func soak(t *testing.T, cfg config, backend string) *report {
	baseGoroutines := runtime.NumGoroutine()
	h := fnv.New64a()
	_, _ = h.Write([]byte(cfg.name + "/" + backend))
	r := &runner{t: t, cfg: cfg, seed: h.Sum64(), name: backend, want: paths[backend].backend, paths: paths[backend].paths, tally: newTally()}
	t.Logf("%s soak over %s: %d operations (+%d warm-up), %d in flight, plan seed %d",
		cfg.name, backend, cfg.ops, cfg.warmup, cfg.inFlight, r.seed)

	srv, err := natsserver.Start(t.Context(), natsserver.WithoutJetStream())
	require.NoError(t, err)
	r.nc, err = srv.Connect(nats.Name("soak parent"))
	require.NoError(t, err)
	opts := []connect.Option{connect.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))}
	if backend == "tcp" {
		opts = append(opts, connect.WithoutCMA())
	}
	r.conn, err = connect.NewConnector(opts...)
	require.NoError(t, err)
	r.mem = memoryFor(backend, r.conn)
	closed := false
	closeAll := func() {
		if closed {
			return
		}
		closed = true
		assert.NoError(t, r.conn.Close(), "the parent's Connector.Close")
		r.nc.Close()
		srv.Shutdown()
	}
	t.Cleanup(closeAll)

	r.child = testproc.Start[ctlRequest, ctlResponse](t, childEnv, testproc.Options{AnswerWithin: 5 * time.Minute})
	r.subj = "soak." + backend
	resp := r.child.Do(ctlRequest{Cmd: "start", Backend: backend, NATS: srv.URL(), Subject: r.subj, SampleEvery: cfg.sampleEvery})
	require.Empty(t, resp.Err, "child start")
	r.pid = resp.PID

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// One operation of each shape first: if cma is not permitted here
	// (ptrace restrictions, containers), transfers fall back to tcp, and
	// the cma soak has nothing to prove.
	for id := range 4 {
		s := cfg.plan(r.seed, -1-id)
		s.Kind = []connect.OperationKind{connect.KindRead, connect.KindWrite}[id%2]
		s.ChildPassive = id < 2
		o := r.do(ctx, s)
		if r.want == "cma" && id == 0 && o.backend == "tcp" {
			t.Skipf("cma is not available between two processes here (transfers fall back to tcp; see docs/cma.md): %v", o.problems())
		}
		require.Empty(t, o.problems(), "probe operation %s", s.label())
	}

	// Warm-up: connections, workers and buffer pools come up.
	r.phase(ctx, -cfg.warmup-4, -4)
	require.Zero(t, r.tally.problems(), "problems in the warm-up: %v", r.tally.first)
	warm := r.tally.reset()

	rep := &report{Backend: backend, Mode: cfg.name, Race: raceEnabled, InFlight: cfg.inFlight, Seed: r.seed, WarmupOps: warm.ops}
	smp := startSampler(cfg.sampleEvery, r.pid)
	r.quiet("start", &rep.Parent.Start, &rep.Child.Start, smp)
	quarters := []struct {
		label         string
		parent, child *sample
	}{
		{"q1", &rep.Parent.Q1, &rep.Child.Q1},
		{"mid", &rep.Parent.Mid, &rep.Child.Mid},
		{"q3", &rep.Parent.Q3, &rep.Child.Q3},
		{"end", &rep.Parent.End, &rep.Child.End},
	}
	var wall time.Duration
	for i, q := range quarters {
		began := time.Now()
		r.phase(ctx, cfg.ops*i/4, cfg.ops*(i+1)/4)
		wall += time.Since(began)
		r.quiet(q.label, q.parent, q.child, smp)
	}
	rep.Parent.Peak, rep.Child.Peak = smp.stop()
	rep.fill(r.tally, wall)

	// The child's end: every exposure closed, its Connector and NATS closed,
	// no goroutine left over.
	resp = r.child.Do(ctlRequest{Cmd: "stop"})
	assert.Empty(t, resp.Err, "child stop")
	assert.Empty(t, resp.Leaks, "goroutines left in the child after it closed everything")
	if resp.Peaks != nil {
		rep.Child.Peak.Goroutines = resp.Peaks.Goroutines
		rep.Child.Peak.Threads = max(rep.Child.Peak.Threads, resp.Peaks.Threads)
		rep.Child.Peak.RSS = max(rep.Child.Peak.RSS, resp.Peaks.RSS)
		rep.Child.Peak.Samples += resp.Peaks.Samples
	}
	if resp.Counts != nil {
		rep.Child.Counts = *resp.Counts
	}
	r.nMu.Lock()
	rep.Parent.Counts = r.n
	r.nMu.Unlock()
	st := r.conn.Stats()
	assert.Zero(t, st.Registered+st.Exposed+st.InFlight,
		"the parent's Connector still holds %d regions, %d exposures, %d transfers after every operation closed", st.Registered, st.Exposed, st.InFlight)
	assert.Zero(t, st.Refused, "accesses the parent refused")
	closeAll()
	rep.Parent.GoroutinesBefore = baseGoroutines
	rep.Parent.GoroutinesClosed = settleGoroutines(baseGoroutines)
	// Every buffer freed, both Connectors closed: no segment, no lease
	// table mapped or open in either process.
	assert.Empty(t, resp.ShmLeft, "shared memory the child maps or holds open after it closed everything")
	assert.Empty(t, shmLeft(), "shared memory the parent maps or holds open after it closed everything")

	t.Log(rep.String())
	r.assertFlat(rep)
	return rep
}

// quiet samples both processes at rest: no operation in flight, the
// child's request handlers done.
func (r *runner) quiet(label string, parent, child *sample, smp *sampler) {
	profile := func(proc string) string {
		dir := os.Getenv(profilesEnv)
		if dir == "" {
			return ""
		}
		return filepath.Join(dir, fmt.Sprintf("%s-%s-%s.pprof", r.name, proc, label))
	}
	resp := r.child.Do(ctlRequest{Cmd: "sample", Profile: profile("child")})
	require.Empty(r.t, resp.Err, "child sample")
	*child = *resp.Sample
	var err error
	*parent, err = quiescent(profile("parent"))
	require.NoError(r.t, err)
	smp.note(*parent)
}

// phase runs operations [from, to) with cfg.inFlight workers.
func (r *runner) phase(ctx context.Context, from, to int) {
	var next atomic.Int64
	next.Store(int64(from))
	var wg sync.WaitGroup
	for range r.cfg.inFlight {
		wg.Go(func() {
			for {
				id := int(next.Add(1) - 1)
				if id >= to || ctx.Err() != nil {
					return
				}
				s := r.cfg.plan(r.seed, id)
				r.tally.inFlight(int(r.flight.Add(1)))
				o := r.do(ctx, s)
				r.flight.Add(-1)
				if r.tally.add(o) && r.tally.problems() >= giveUpAfter {
					return
				}
				if n := r.tally.done(); id >= 0 && n%progressEvery == 0 {
					r.t.Logf("%d operations done", n)
				}
			}
		})
	}
	wg.Wait()
}

const (
	// giveUpAfter stops a run once this many operations went wrong: the
	// failure is plain by then, and the report says what.
	giveUpAfter = 100
	// progressEvery is how often a long run says how far it is.
	progressEvery = 2000
)

// outcome is what both processes saw of one operation.
type outcome struct {
	spec          opSpec
	backend, path string // the active side's
	parent, child side
}

func (o outcome) problems() []string {
	var p []string
	for _, s := range []side{o.parent, o.child} {
		p = append(p, s.Errs...)
		p = append(p, s.Damage.First...)
	}
	return p
}

// do runs one operation to the end in both processes.
func (r *runner) do(ctx context.Context, s opSpec) outcome {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	o := outcome{spec: s}
	if s.ChildPassive {
		r.childPassive(ctx, &o)
	} else {
		r.parentPassive(ctx, &o)
	}
	if o.backend != r.want || !slices.Contains(r.paths, o.path) {
		o.parent.fail("op %d (%s): moved over %q, path %q, want %q, one of %q", s.ID, s.label(), o.backend, o.path, r.want, r.paths)
	}
	return o
}

// childPassive: the child exposes memory, the parent moves the bytes.
func (r *runner) childPassive(ctx context.Context, o *outcome) {
	s := o.spec
	var rep opReply
	if err := r.request(ctx, opRequest{Cmd: "expose", ID: s.ID, Kind: s.Kind, Sizes: s.Sizes}, &rep); err != nil {
		o.parent.fail("op %d: expose: %v", s.ID, err)
		return
	}
	if len(rep.Result.Errs) > 0 {
		o.child = rep.Result
		return
	}
	md, err := connect.ParseMetadata(rep.Token)
	switch {
	case err != nil:
		o.parent.fail("op %d: the child's token: %v", s.ID, err)
	case md.Kind() != s.Kind:
		o.parent.fail("op %d: the child's token is for %v, want %v", s.ID, md.Kind(), s.Kind)
	default:
		if err := sameSizes(md.Sizes(), s.Sizes); err != nil {
			o.parent.fail("op %d: the child's token: %v", s.ID, err)
		}
	}
	if len(o.parent.Errs) == 0 {
		seed := uint64(dataSeed)
		if s.Kind == connect.KindRead {
			seed = fillerSeed
		}
		o.transfer(ctx, r, md, seed)
	}
	// Finish even after a failure: the child's exposure must be closed.
	rep = opReply{}
	if err := r.request(ctx, opRequest{Cmd: "finish", ID: s.ID}, &rep); err != nil {
		o.parent.fail("op %d: finish: %v", s.ID, err)
	}
	o.child = rep.Result
}

// transfer is the parent's side of an operation the child exposed: it
// moves the bytes between md and memory of its own filled with seed, checks
// them and frees its memory.
func (o *outcome) transfer(ctx context.Context, r *runner, md connect.Metadata, seed uint64) {
	s := o.spec
	mem, err := r.mem.slab(s.ID, s.Sizes, seed)
	if err != nil {
		o.parent.fail("op %d: memory: %v", s.ID, err)
		return
	}
	o.backend, o.path, err = transfer(ctx, r.conn, md, mem.Slab, r.begun)
	r.waited()
	if err != nil {
		o.parent.fail("op %d: %v", s.ID, err)
	}
	o.parent.Damage = check(mem.Slab, s.ID, dataSeed)
	if err := mem.free(); err != nil {
		o.parent.fail("op %d: %v", s.ID, err)
	}
}

// parentPassive: the parent exposes memory, the child moves the bytes.
func (r *runner) parentPassive(ctx context.Context, o *outcome) {
	s := o.spec
	seed := uint64(dataSeed)
	if s.Kind == connect.KindWrite {
		seed = fillerSeed
	}
	mem, err := r.mem.slab(s.ID, s.Sizes, seed)
	if err != nil {
		o.parent.fail("op %d: memory: %v", s.ID, err)
		return
	}
	defer func() {
		// After the Close below, or a failed create.
		if err := mem.free(); err != nil {
			o.parent.fail("op %d: %v", s.ID, err)
		}
	}()
	var (
		op interface {
			Wait(context.Context) error
			Close() error
			Metadata() connect.Metadata
		}
	)
	if s.Kind == connect.KindRead {
		op, err = r.conn.CreateReadable(ctx, descriptors(mem.Slab)...)
	} else {
		op, err = r.conn.CreateWritable(ctx, descriptors(mem.Slab)...)
	}
	if err != nil {
		o.parent.fail("op %d: create %v: %v", s.ID, s.Kind, err)
		return
	}
	r.count(func(n *counts) { n.Created++ })
	var rep opReply
	if err := r.request(ctx, opRequest{Cmd: "begin", ID: s.ID, Sizes: s.Sizes, Token: op.Metadata().Text()}, &rep); err != nil {
		o.parent.fail("op %d: begin: %v", s.ID, err)
	}
	o.child, o.backend, o.path = rep.Result, rep.Result.Backend, rep.Result.Path
	// A child that failed before it began leaves nobody to tell this side.
	if len(o.parent.Errs) == 0 && len(o.child.Errs) == 0 {
		if err := op.Wait(ctx); err != nil {
			o.parent.fail("op %d: passive Wait: %v", s.ID, err)
		}
	}
	// READ: the reader left the memory alone; WRITE: the writer's bytes.
	o.parent.Damage = check(mem.Slab, s.ID, dataSeed)
	if err := op.Close(); err != nil {
		o.parent.fail("op %d: passive Close: %v", s.ID, err)
	}
	r.count(func(n *counts) { n.Closed++ })
}

func (r *runner) begun()  { r.count(func(n *counts) { n.Begun++ }) }
func (r *runner) waited() { r.count(func(n *counts) { n.Waited++ }) }

func (r *runner) count(f func(*counts)) {
	r.nMu.Lock()
	defer r.nMu.Unlock()
	f(&r.n)
}

// request sends req to the child over NATS and decodes its answer.
func (r *runner) request(ctx context.Context, req opRequest, rep *opReply) error {
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	m, err := r.nc.RequestWithContext(ctx, r.subj, b)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(m.Data, rep); err != nil {
		return fmt.Errorf("the child's answer: %w", err)
	}
	return nil
}

// assertFlat checks the report: no corruption, no failure, everything
// closed, and resources flat.
func (r *runner) assertFlat(rep *report) {
	t := r.t
	assert.Zero(t, rep.Corruptions, "corrupted descriptors and guards")
	assert.Zero(t, rep.Failures, "failed operations")
	assert.Equal(t, r.cfg.ops, rep.Ops, "operations run")
	for _, p := range []struct {
		name string
		f    flatness
	}{{"parent", rep.Parent}, {"child", rep.Child}} {
		name, f := p.name, p.f
		assert.Equal(t, f.Counts.Created, f.Counts.Closed, "%s: passive operations created and closed", name)
		assert.Equal(t, f.Counts.Begun, f.Counts.Waited, "%s: active operations begun and awaited", name)
		for _, x := range []struct {
			label string
			s     sample
		}{{"a quarter in", f.Q1}, {"half-way", f.Mid}, {"three quarters in", f.Q3}, {"at the end", f.End}} {
			assert.LessOrEqual(t, x.s.Goroutines, f.Start.Goroutines+goroutineSlack, "%s: goroutines %s vs at the start", name, x.label)
		}
		for _, x := range []struct {
			label string
			s     sample
		}{{"at the start", f.Start}, {"a quarter in", f.Q1}, {"half-way", f.Mid}, {"three quarters in", f.Q3}, {"at the end", f.End}} {
			// At rest every buffer is freed and every exposure closed: no
			// segment stays mapped or open, its own or the peer's. Lease
			// tables belong to connections, which stay.
			assert.Zero(t, x.s.Shm.Segments+x.s.Shm.SegFDs, "%s: shared-memory segments mapped or open at rest %s: %+v", name, x.label, x.s.Shm)
			assert.LessOrEqual(t, x.s.Shm.Tables, f.Start.Shm.Tables, "%s: lease tables mapped %s vs at the start", name, x.label)
			assert.LessOrEqual(t, x.s.Shm.TableFDs, f.Start.Shm.TableFDs, "%s: lease tables open %s vs at the start", name, x.label)
			// What stays resident of shared memory at rest is the lease
			// tables', at most 256 KiB each.
			assert.LessOrEqual(t, x.s.RSSShmem, int64(shmemSlack), "%s: resident shared memory at rest %s", name, x.label)
		}
		assert.LessOrEqual(t, f.End.HeapAlloc, f.Start.HeapAlloc+heapCap, "%s: live heap at the end vs at the start", name)
		assert.False(t, steady(f.Mid.HeapAlloc, f.Q3.HeapAlloc, f.End.HeapAlloc, heapQuarterSlack),
			"%s: live heap grew in each of the last two quarters: %s, %s, %s", name, mib(int64(f.Mid.HeapAlloc)), mib(int64(f.Q3.HeapAlloc)), mib(int64(f.End.HeapAlloc)))
		if f.Start.RSS > 0 && f.End.RSS > 0 && !raceEnabled {
			allowed := f.Start.RSS + max(int64(rssSlackMin), int64(rssSlackFrac*float64(f.Start.RSS)))
			assert.LessOrEqual(t, f.End.RSS, allowed, "%s: RSS at the end vs at the start", name)
			assert.False(t, steady(uint64(f.Mid.RSS), uint64(f.Q3.RSS), uint64(f.End.RSS), rssQuarterSlack),
				"%s: RSS grew in each of the last two quarters: %s, %s, %s", name, mib(f.Mid.RSS), mib(f.Q3.RSS), mib(f.End.RSS))
		}
	}
	if !assert.LessOrEqual(t, rep.Parent.GoroutinesClosed, rep.Parent.GoroutinesBefore, "parent: goroutines once everything closed vs before the soak") {
		var b strings.Builder
		_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
		t.Logf("the parent's goroutines:\n%s", b.String())
	}
}

// steady reports whether a quantity sampled half-way, three quarters in and
// at the end grew by more than slack in both quarters: a leak's signature.
func steady(mid, q3, end, slack uint64) bool {
	return q3 > mid+slack && end > q3+slack
}

// settleGoroutines returns the number of goroutines once it is at most
// want, or after closedWithin: goroutines of things just closed (the
// child's pipes, the NATS server's connections) take a moment to return.
func settleGoroutines(want int) int {
	deadline := time.Now().Add(closedWithin)
	n := runtime.NumGoroutine()
	for n > want && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
		n = runtime.NumGoroutine()
	}
	return n
}

// closedWithin bounds how long settleGoroutines waits: far more than
// closing needs, it only keeps a leak from going unnoticed.
const closedWithin = 10 * time.Second
