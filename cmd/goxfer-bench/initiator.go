package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"os/exec"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/connect"
	gxnats "github.com/goxfer/goxfer/transport/nats"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// remote is a target as the initiator sees it.
type remote struct {
	name      string // subject component: "proc" or "local"
	hello     hello
	sameClock bool // its CLOCK_MONOTONIC is ours
}

type initiator struct {
	cfg            *config
	nc             *nats.Conn
	natsURL        string
	stderr         io.Writer
	proc, local    *remote
	conns          map[string]*connect.Connector
	insts          map[string]agent.Backend // each connector's instance of the backend it measures
	raw1, raw4     []net.Conn
	prog           *progress
	round          atomic.Uint64
	results        []Result
	createNs       map[int]float64 // CreateReadable+Metadata per operation, by descriptors
	tokenBytes     map[int]int
	childExited    chan error
	baselineNotice map[string]string // why a baseline is missing
}

func runInitiator(ctx context.Context, cfg *config, stdout, stderr io.Writer) (err error) {
	stderr = &lockedWriter{w: stderr} // the target child writes to it too
	in := &initiator{cfg: cfg, stderr: stderr, conns: map[string]*connect.Connector{}, insts: map[string]agent.Backend{}, createNs: map[int]float64{}, tokenBytes: map[int]int{}, baselineNotice: map[string]string{}}
	in.natsURL = cfg.natsURL
	if in.natsURL == "" {
		host := "127.0.0.1"
		if cfg.role == "initiator" {
			host, _, _ = net.SplitHostPort(cfg.listen)
		}
		srv, err := natsserver.Start(natsserver.WithoutJetStream(), natsserver.WithHost(host),
			natsserver.WithServerOptions(func(o *server.Options) { o.MaxPayload = 8 << 20 }))
		if err != nil {
			return fmt.Errorf("start the embedded NATS server: %w", err)
		}
		defer srv.Shutdown()
		in.natsURL = srv.URL()
		if cfg.role == "initiator" {
			fmt.Fprintf(stderr, "goxfer-bench: embedded NATS server at %s; start the target with:\n  goxfer-bench -role target -nats %s -session %s\n", in.natsURL, in.natsURL, cfg.session)
		}
	}
	in.nc, err = nats.Connect(in.natsURL, nats.Name("goxfer-bench initiator"), nats.Timeout(cfg.timeout))
	if err != nil {
		return fmt.Errorf("connect to NATS at %s: %w", in.natsURL, err)
	}
	defer in.nc.Close()

	needProc := cfg.baseline || slices.ContainsFunc(cfg.backends, func(b backendDef) bool { return !b.inProcess })
	needLocal := slices.ContainsFunc(cfg.backends, func(b backendDef) bool { return b.inProcess })
	if needProc && cfg.role == "both" {
		stop, err := in.spawn()
		if err != nil {
			return err
		}
		defer stop()
	}
	if needLocal {
		// In-process backends (mem) reach only agents of this process: their
		// target runs here, driven through the same NATS subjects.
		t, err := startTarget(cfg, in.nc, "local")
		if err != nil {
			return fmt.Errorf("start the in-process target: %w", err)
		}
		defer t.Close()
		if in.local, err = in.await(ctx, "local"); err != nil {
			return err
		}
	}
	if needProc {
		if in.proc, err = in.await(ctx, "proc"); err != nil {
			return err
		}
		defer func() {
			qctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			var out struct{}
			_ = call(qctx, in.nc, subject(cfg.session, "proc", "quit"), struct{}{}, &out)
		}()
	}

	quiet := slog.New(slog.DiscardHandler)
	bcfg := *cfg
	bcfg.listen = anyPort(cfg.listen)
	for _, b := range cfg.backends {
		bs := agentBackends(&bcfg)
		c, err := connect.NewConnector(connect.WithBackends(bs...), connect.WithBackend(b.name), connect.WithLogger(quiet))
		if err != nil {
			return fmt.Errorf("start a connector for %s: %w", b.name, err)
		}
		defer c.Close()
		in.conns[b.name] = c
		in.insts[b.name] = findBackend(bs, b.name)
	}
	if in.proc != nil && cfg.baseline {
		if in.raw1, err = dialN(ctx, in.proc.hello.Raw, 1); err != nil {
			return err
		}
		if in.raw4, err = dialN(ctx, in.proc.hello.Raw, 4); err != nil {
			return err
		}
		defer closeAll(in.raw1)
		defer closeAll(in.raw4)
	}

	ucxRuns := in.ucxPlan()
	in.prog = newProgress(cfg.progress, stderr, cfg.runs*in.countSteps(len(ucxRuns)))
	var runs [][]Result
	for range cfg.runs {
		in.results = nil
		if err := in.sweep(ctx); err != nil {
			in.prog.finish()
			return err
		}
		if err := in.latency(ctx); err != nil {
			in.prog.finish()
			return err
		}
		in.runUCX(ctx, ucxRuns)
		setRatios(in.results)
		runs = append(runs, in.results)
	}
	in.prog.finish()
	in.results = mergeRuns(runs)
	meta := in.runInfo()
	writeTable(stdout, in.results, meta)
	for _, o := range cfg.outputs {
		if err := writeFile(o, in.results, meta); err != nil {
			return err
		}
	}
	if cfg.chart != "" {
		if err := drawChart(cfg.chart, in.results, meta); err != nil {
			return fmt.Errorf("chart %s: %w", cfg.chart, err)
		}
	}
	return nil
}

// spawn starts the target as a child process running this binary.
func (in *initiator) spawn() (stop func(), err error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, "-role", "target", "-nats", in.natsURL, "-session", in.cfg.session,
		"-listen", in.cfg.listen, "-timeout", in.cfg.timeout.String(), "-backends", "all")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	cmd.Stdout = in.stderr
	cmd.Stderr = in.stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the target process: %w", err)
	}
	in.childExited = make(chan error, 1)
	exited := make(chan struct{})
	go func() {
		err := cmd.Wait()
		in.childExited <- err
		close(exited)
	}()
	return func() {
		_ = stdin.Close() // the child exits when its stdin closes
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	}, nil
}

// await asks the target for its hello until it answers or the timeout.
func (in *initiator) await(ctx context.Context, name string) (*remote, error) {
	ctx, cancel := context.WithTimeout(ctx, in.cfg.timeout)
	defer cancel()
	subj := subject(in.cfg.session, name, "hello")
	for {
		var h hello
		actx, acancel := context.WithTimeout(ctx, time.Second)
		err := call(actx, in.nc, subj, struct{}{}, &h)
		acancel()
		if err == nil {
			return &remote{name: name, hello: h, sameClock: h.BootID != "" && h.BootID == bootID()}, nil
		}
		select {
		case cerr := <-in.childExited:
			return nil, fmt.Errorf("the target process exited before answering: %v", cerr)
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				how := ""
				if in.cfg.role == "initiator" {
					how = fmt.Sprintf(" (start it with: goxfer-bench -role target -nats %s -session %s)", in.natsURL, in.cfg.session)
				}
				return nil, fmt.Errorf("timeout: the target did not show up within %v: nobody answered on NATS subject %q at %s%s", in.cfg.timeout, subj, in.natsURL, how)
			}
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func dialN(ctx context.Context, addr string, n int) ([]net.Conn, error) {
	var d net.Dialer
	cs := make([]net.Conn, 0, n)
	for range n {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			closeAll(cs)
			return nil, fmt.Errorf("dial the target's raw TCP server: %w", err)
		}
		cs = append(cs, c)
	}
	return cs, nil
}

func closeAll(cs []net.Conn) {
	for _, c := range cs {
		_ = c.Close()
	}
}

// memories returns how b's points are measured: with buffers from its
// allocator (true), on Go heap memory (false), or both, per -ucx-alloc.
func (in *initiator) memories(b backendDef) []bool {
	switch {
	case b.alloc == nil || in.cfg.ucxAlloc == "off":
		return []bool{false}
	case in.cfg.ucxAlloc == "on":
		return []bool{true}
	}
	return []bool{true, false}
}

func (in *initiator) countSteps(ucx int) int {
	n := 0
	for range in.cfg.ops {
		for range in.cfg.shapes {
			for _, b := range in.cfg.backends {
				n += len(in.cfg.inflight) * len(in.memories(b))
			}
			if in.cfg.baseline {
				n++
			}
		}
	}
	if in.cfg.baseline {
		n++
	}
	if in.cfg.control {
		n++
	}
	return n + ucx
}

// sweep measures every point: per operation and shape, each backend at each
// depth, then the raw baselines for the same bytes.
func (in *initiator) sweep(ctx context.Context) error {
	for _, op := range in.cfg.ops {
		for _, sh := range in.cfg.shapes {
			for _, n := range in.cfg.inflight {
				for _, b := range in.cfg.backends {
					for _, alloc := range in.memories(b) {
						in.prog.step(fmt.Sprintf("%s %s %s ×%d, %d in flight", b.name, op, fmtSize(float64(sh.Block)), sh.Descs, n))
						r, err := in.measure(ctx, b, op, sh, n, alloc)
						if err != nil {
							return fmt.Errorf("%s %s of %d × %s, %d in flight: %w", b.name, op, sh.Descs, fmtSize(float64(sh.Block)), n, err)
						}
						in.results = append(in.results, r)
						in.prog.done(r.summary())
					}
				}
			}
			if in.cfg.baseline {
				in.prog.step(fmt.Sprintf("baselines %s %s", op, fmtSize(float64(sh.bytes()))))
				rs, err := in.baselines(ctx, op, sh)
				if err != nil {
					return fmt.Errorf("baselines for %s of %s: %w", op, fmtSize(float64(sh.bytes())), err)
				}
				in.results = append(in.results, rs...)
				in.prog.done(fmt.Sprintf("%d baselines", len(rs)))
			}
		}
	}
	return nil
}

// prepared is a round the target has set up.
type prepared struct {
	id    uint64
	t     *remote
	ready roundReady
	mds   []connect.Metadata
}

func (in *initiator) prepare(ctx context.Context, t *remote, req roundReq) (*prepared, error) {
	req.ID = in.round.Add(1)
	ctx, cancel := context.WithTimeout(ctx, in.cfg.timeout)
	defer cancel()
	p := &prepared{id: req.ID, t: t}
	if err := call(ctx, in.nc, subject(in.cfg.session, t.name, "round"), req, &p.ready); err != nil {
		return nil, err
	}
	if p.ready.Err != "" {
		return nil, fmt.Errorf("target: %s", p.ready.Err)
	}
	for page := range p.ready.Pages {
		b, _ := json.Marshal(map[string]any{"id": req.ID, "page": page})
		msg, err := in.nc.RequestWithContext(ctx, subject(in.cfg.session, t.name, "tokens"), b)
		if err != nil {
			return nil, fmt.Errorf("fetch tokens: %w", err)
		}
		if p.mds, err = decodeTokens(msg.Data, p.mds); err != nil {
			return nil, fmt.Errorf("fetch tokens: %w", err)
		}
	}
	if len(p.mds) != p.ready.Tokens {
		return nil, fmt.Errorf("fetched %d tokens, the target made %d", len(p.mds), p.ready.Tokens)
	}
	return p, nil
}

func (in *initiator) finish(ctx context.Context, p *prepared) (roundResult, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), in.cfg.timeout+5*time.Second)
	defer cancel()
	var res roundResult
	if err := call(ctx, in.nc, subject(in.cfg.session, p.t.name, "finish"), finishReq{ID: p.id}, &res); err != nil {
		return res, err
	}
	if res.Err != "" {
		return res, errors.New("target: " + res.Err)
	}
	return res, nil
}

// measure runs one goxfer point: warm-up then measured operations, n in
// flight, each on a fresh passive operation whose token was fetched before
// the clock started.
func (in *initiator) measure(ctx context.Context, b backendDef, op direction, sh shape, n int, alloc bool) (Result, error) {
	t := in.proc
	if b.inProcess {
		t = in.local
	}
	iters, warmup := in.cfg.itersFor(sh.bytes())
	total := warmup + iters
	req := roundReq{Op: op, Block: sh.Block, Descs: sh.Descs, Slots: n, Ops: total, Check: in.cfg.check, WaitMsec: millis(in.cfg.timeout)}
	var allocFn func(int) ([]byte, func() error, error)
	if alloc {
		req.Alloc = b.name
		inst := in.insts[b.name]
		allocFn = func(size int) ([]byte, func() error, error) { return b.alloc(inst, size) }
	}
	p, err := in.prepare(ctx, t, req)
	if err != nil {
		return Result{}, err
	}
	in.createNs[sh.Descs] = float64(p.ready.CreateNs) / float64(total)
	in.tokenBytes[sh.Descs] = p.ready.TokenLen
	res, runErr := in.runOps(ctx, in.conns[b.name], p, op, sh, n, warmup, total, allocFn)
	fin, ferr := in.finish(ctx, p)
	if runErr != nil {
		return Result{}, runErr
	}
	if ferr != nil {
		return Result{}, ferr
	}
	if fin.Failed > 0 {
		return Result{}, fmt.Errorf("%d passive operations failed at the target: %v", fin.Failed, fin.Errors)
	}
	r := Result{
		Kind: "goxfer", Name: b.name, Op: op.String(), Block: sh.Block, Descs: sh.Descs, Bytes: sh.bytes(), Inflight: n,
		Iters: iters, InProcess: b.inProcess, Shape: sh.Label, Checked: in.cfg.check,
	}
	r.setThroughput(sh.bytes(), iters, res.elapsed)
	r.P50, r.P99 = percentiles(res.lat[warmup:])
	if t.sameClock {
		var done []time.Duration
		for i := warmup; i < total; i++ {
			if fin.Done[i] != 0 {
				done = append(done, time.Duration(fin.Done[i]-res.begin[i]))
			}
		}
		if len(done) == iters {
			r.DoneP50, r.DoneP99 = percentiles(done)
		}
	}
	if b.inProcess {
		r.Note = "in-process"
	}
	switch {
	case alloc:
		r.Note = joinNote(r.Note, "buffers from the backend's allocator")
	case b.alloc != nil && in.cfg.ucxAlloc != "off":
		r.Name += heapSuffix
	}
	if in.cfg.check {
		r.Note = joinNote(r.Note, fmt.Sprintf("checked %s", fmtSize(float64(res.verified+fin.Verified))))
	}
	return r, nil
}

type opsRun struct {
	begin    []int64         // CLOCK_MONOTONIC at Begin
	lat      []time.Duration // Begin to the active Wait's return
	elapsed  time.Duration   // first measured Begin to last measured completion
	verified int64
}

// runOps runs operations [0, total), the first warmup of them unmeasured,
// with n in flight: goroutine s runs operations s, s+n, ... on slot s.
func (in *initiator) runOps(ctx context.Context, c *connect.Connector, p *prepared, op direction, sh shape, n, warmup, total int,
	alloc func(int) ([]byte, func() error, error)) (_ *opsRun, err error) {
	size := int(sh.bytes())
	slots := make([][]byte, n)
	descs := make([][]connect.Descriptor, n)
	for s := range slots {
		if alloc == nil {
			slots[s] = make([]byte, size)
		} else {
			buf, free, aerr := alloc(size)
			if aerr != nil {
				return nil, aerr
			}
			defer func() {
				if ferr := free(); ferr != nil && err == nil {
					err = ferr
				}
			}()
			slots[s] = buf
		}
		poison(slots[s]) // fault the pages in before the clock starts
		descs[s] = descriptors(slots[s], sh.Block, sh.Descs)
	}
	check := in.cfg.check
	var acks []chan error
	if check && op == dirWrite {
		acks = make([]chan error, total)
		for i := range acks {
			acks[i] = make(chan error, 1)
		}
		sub, err := in.nc.Subscribe(subject(in.cfg.session, p.t.name, fmt.Sprintf("ack.%d", p.id)), func(m *nats.Msg) {
			var a ack
			if json.Unmarshal(m.Data, &a) == nil && a.I >= 0 && a.I < len(acks) {
				var err error
				if a.Err != "" {
					err = fmt.Errorf("target check of operation %d: %s", a.I, a.Err)
				}
				select {
				case acks[a.I] <- err:
				default:
				}
			}
		})
		if err != nil {
			return nil, err
		}
		defer func() { _ = sub.Unsubscribe() }()
		if err := in.nc.Flush(); err != nil {
			return nil, err
		}
	}
	run := &opsRun{begin: make([]int64, total), lat: make([]time.Duration, total)}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		mu       sync.Mutex
		firstErr error
		verified atomic.Int64
		ends     = make([]int64, total)
	)
	fail := func(err error) {
		mu.Lock()
		if firstErr == nil {
			firstErr = err
		}
		mu.Unlock()
		cancel()
	}
	one := func(i int) error {
		s := i % n
		if check {
			if op == dirRead {
				poison(slots[s])
			} else {
				if i >= n {
					select { // the target has verified the slot's previous write
					case err := <-acks[i-n]:
						if err != nil {
							return err
						}
					case <-time.After(in.cfg.timeout):
						return fmt.Errorf("no check result for operation %d within %v", i-n, in.cfg.timeout)
					case <-ctx.Done():
						return ctx.Err()
					}
				}
				fill(slots[s], writeSeed(p.id, i))
			}
		}
		wctx, wcancel := context.WithTimeout(ctx, in.cfg.timeout)
		defer wcancel()
		t0 := monoNow()
		var err error
		if op == dirRead {
			var x *connect.ReadOperation
			if x, err = c.BeginRead(wctx, p.mds[i], descs[s]...); err == nil {
				err = x.Wait(wctx)
			}
		} else {
			var x *connect.WriteOperation
			if x, err = c.BeginWrite(wctx, p.mds[i], descs[s]...); err == nil {
				err = x.Wait(wctx)
			}
		}
		t1 := monoNow()
		if err != nil {
			if errors.Is(err, context.DeadlineExceeded) {
				return fmt.Errorf("operation %d did not complete within %v: %w", i, in.cfg.timeout, err)
			}
			return fmt.Errorf("operation %d: %w", i, err)
		}
		run.begin[i], run.lat[i], ends[i] = t0, time.Duration(t1-t0), t1
		if check && op == dirRead {
			if err := verify(slots[s], readSeed(p.id, s)); err != nil {
				return fmt.Errorf("check of operation %d: %w", i, err)
			}
			verified.Add(int64(size))
		}
		return nil
	}
	phase := func(lo, hi int) {
		var wg sync.WaitGroup
		for s := range n {
			wg.Go(func() {
				for i := lo + s; i < hi; i += n {
					if ctx.Err() != nil {
						return
					}
					if err := one(i); err != nil {
						fail(err)
						return
					}
				}
			})
		}
		wg.Wait()
	}
	phase(0, warmup)
	phase(warmup, total)
	if firstErr != nil {
		return nil, firstErr
	}
	if acks != nil { // every write verified at the target
		for i := max(total-n, 0); i < total; i++ {
			select {
			case err := <-acks[i]:
				if err != nil {
					return nil, err
				}
			case <-time.After(in.cfg.timeout):
				return nil, fmt.Errorf("no check result for operation %d within %v", i, in.cfg.timeout)
			}
		}
	}
	first, last := slices.Min(run.begin[warmup:]), slices.Max(ends[warmup:])
	run.elapsed = time.Duration(last - first)
	run.verified = verified.Load()
	return run, nil
}

func joinNote(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}

// latency measures the small-operation floor and the control plane.
func (in *initiator) latency(ctx context.Context) error {
	if in.cfg.baseline && in.proc != nil {
		in.prog.step("4 KiB TCP ping-pong")
		r, err := in.pingPong(ctx)
		if err != nil {
			return fmt.Errorf("ping-pong: %w", err)
		}
		in.results = append(in.results, r)
		in.prog.done(r.summary())
	}
	if !in.cfg.control {
		return nil
	}
	in.prog.step("control plane")
	rs, err := in.controlPlane(ctx)
	if err != nil {
		return fmt.Errorf("control plane: %w", err)
	}
	in.results = append(in.results, rs...)
	in.prog.done(fmt.Sprintf("%d rows", len(rs)))
	return nil
}

// controlPlane measures what handing out one token per operation costs:
// CreateReadable+Metadata at the target (from the sweep's rounds), a NATS
// request/reply that makes and carries a token, and a 4 KiB READ that
// first fetches its token that way.
func (in *initiator) controlPlane(ctx context.Context) ([]Result, error) {
	var out []Result
	for _, d := range slices.Sorted(maps.Keys(in.createNs)) {
		out = append(out, Result{Kind: "control", Name: "create+token", Descs: d, Iters: 0,
			P50: in.createNs[d] / 1e3, Note: fmt.Sprintf("CreateReadable/Writable + Metadata per operation, mean; token %d bytes", in.tokenBytes[d])})
	}
	for _, t := range []*remote{in.local, in.proc} {
		if t == nil {
			continue
		}
		iters := in.cfg.latIters
		lat := make([]time.Duration, 0, iters)
		for range iters + iters/10 {
			t0 := time.Now()
			rctx, cancel := context.WithTimeout(ctx, in.cfg.timeout)
			_, err := gxnats.Request(rctx, in.nc, t.hello.Token1, nil)
			cancel()
			if err != nil {
				return nil, err
			}
			lat = append(lat, time.Since(t0))
		}
		r := Result{Kind: "control", Name: "nats-token", Op: "REQ", Block: 4096, Descs: 1, Iters: iters, Note: "NATS request/reply; the target creates a readable and answers with its token"}
		if t == in.local {
			r.Name, r.InProcess = "nats-token (in-process)", true
		}
		r.P50, r.P99 = percentiles(lat[iters/10:])
		out = append(out, r)
	}
	dst := make([]byte, 4096)
	for _, b := range in.cfg.backends {
		t := in.proc
		if b.inProcess {
			t = in.local
		}
		c := in.conns[b.name]
		iters := in.cfg.latIters
		lat := make([]time.Duration, 0, iters)
		for range iters + iters/10 {
			t0 := time.Now()
			rctx, cancel := context.WithTimeout(ctx, in.cfg.timeout)
			rep, err := gxnats.Request(rctx, in.nc, t.hello.Token1, nil)
			if err == nil {
				var x *connect.ReadOperation
				if x, err = c.BeginRead(rctx, rep.Metadata, connect.NewDescriptor(dst)); err == nil {
					err = x.Wait(rctx)
				}
			}
			cancel()
			if err != nil {
				return nil, fmt.Errorf("%s: %w", b.name, err)
			}
			lat = append(lat, time.Since(t0))
		}
		r := Result{Kind: "control", Name: b.name, Op: "REQ+READ", Block: 4096, Descs: 1, Iters: iters, InProcess: b.inProcess,
			Note: "token request over NATS, then BeginRead and Wait"}
		r.P50, r.P99 = percentiles(lat[iters/10:])
		out = append(out, r)
	}
	return out, nil
}

func (in *initiator) runInfo() runInfo {
	host, _ := os.Hostname()
	ri := runInfo{Host: host, Runs: in.cfg.runs, Backends: builtNames(), Args: os.Args[1:], Check: in.cfg.check, Time: time.Now().UTC().Format(time.RFC3339)}
	if in.proc != nil {
		ri.TargetHost, ri.TargetPID, ri.SameHost = in.proc.hello.Host, in.proc.hello.PID, in.proc.sameClock
	}
	for k, v := range in.baselineNotice {
		ri.Notes = append(ri.Notes, k+": "+v)
	}
	slices.Sort(ri.Notes)
	return ri
}

// lockedWriter serializes writes from this process and its child's output.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
