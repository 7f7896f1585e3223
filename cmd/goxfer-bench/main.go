package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// childEnv marks a target process spawned by an initiator: it exits when
// its standard input (the initiator's pipe) closes.
const childEnv = "GOXFER_BENCH_CHILD"

type config struct {
	role     string
	natsURL  string
	session  string
	listen   string
	timeout  time.Duration
	backends []backendDef
	ops      []direction
	blocks   []int
	descs    []int
	inflight []int
	shapes   []shape // from -blocks × -descs, or a preset
	iters    int
	warmup   int
	runs     int
	check    bool
	outputs  []string
	chart    string
	baseline bool
	control  bool
	ucx      string
	ucxTLS   []string
	ucxAlloc string
	latIters int
	progress string
	preset   string
	from     string
	// GPU memory: where each side's buffers live, on which GPU, and how
	// the connectors stage it through host memory.
	mem                   mems
	gpu                   int
	stageChunk, stagePool int
	staging               string // -staging as given, passed on to a spawned target
	// deviceIPC lets cma move GPU memory on one host by mapping the peer's
	// allocations (cma.WithDeviceIPC); off, it is staged.
	deviceIPC bool
	// tcpSpin is -tcp-latency: 0 leaves tcp's latency mode off, anything
	// else is the spin of tcp.WithLatencyMode, on both sides.
	tcpSpin time.Duration
	// interleave runs small operations in batches alternating with the
	// 4 KiB TCP ping-pong (interleave.go).
	interleave bool
	// gap pauses after each operation (-gap): a passive side slower per
	// operation than the active one then queues no notifications, and
	// "done" is the latency of one operation alone.
	gap time.Duration
	// cpuProfile is where this process writes its CPU profile; a spawned
	// target writes its own beside it, with ".target" appended.
	cpuProfile string
}

// shape is one transfer: descs descriptors of block bytes.
type shape struct {
	Block, Descs int
	Label        string // for presets
}

func (s shape) bytes() int64 { return int64(s.Block) * int64(s.Descs) }

// models are the -model configurations for -preset model: one prompt's KV
// cache in blocks of 16 tokens, K and V of one layer's block in one
// descriptor, fp16.
var models = map[string]struct{ layers, kvHeads, headDim int }{
	"llama3-8b":  {32, 8, 128},
	"llama3-70b": {80, 8, 128},
	"mistral-7b": {32, 8, 128},
	"qwen2-7b":   {28, 4, 128},
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is the command: it returns the exit status (2 for bad usage).
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "goxfer-bench: %v\n", err)
		return 2
	}
	if cfg.cpuProfile != "" && cfg.from == "" {
		stop, err := startCPUProfile(cfg.cpuProfile)
		if err != nil {
			fmt.Fprintf(stderr, "goxfer-bench: %v\n", err)
			return 1
		}
		defer func() {
			if err := stop(); err != nil {
				fmt.Fprintf(stderr, "goxfer-bench: %v\n", err)
			}
		}()
	}
	switch {
	case cfg.from != "":
		err = render(cfg, stdout)
	case cfg.role == "target":
		err = runTarget(ctx, cfg, stderr)
	default:
		err = runInitiator(ctx, cfg, stdout, stderr)
	}
	if err != nil {
		fmt.Fprintf(stderr, "goxfer-bench: %v\n", err)
		return 1
	}
	return 0
}

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	fs := flag.NewFlagSet("goxfer-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: goxfer-bench [flags]\n\nnixlbench-style READ/WRITE sweeps of goxfer's backends with raw baselines from the same run.\nBuilt backends: %s.\n\n", strings.Join(builtNames(), ", "))
		fs.PrintDefaults()
	}
	c := &config{}
	var backends, ops, blocks, descs, inflight, outputs, ucxTLS, model, shapes, initMem, targetMem string
	var step, tokens int
	fs.StringVar(&c.role, "role", "both", "both: spawn the target as a child process; initiator or target: run one side (two hosts: same -nats and -session)")
	fs.StringVar(&c.natsURL, "nats", "", "NATS server URL; empty: an embedded server (with -role initiator it listens on -listen's host)")
	fs.StringVar(&c.session, "session", "", "names this run's NATS subjects; default: random with -role both, \"goxfer-bench\" otherwise")
	fs.StringVar(&c.listen, "listen", "127.0.0.1:0", "where the target's tcp backend and raw TCP servers listen (and the embedded NATS server's host); use a routable address across hosts")
	fs.DurationVar(&c.timeout, "timeout", 30*time.Second, "how long to wait for the target to show up, and for any one operation or request")
	fs.StringVar(&backends, "backends", "all", "comma-separated backends to measure: "+strings.Join(builtNames(), ", "))
	fs.StringVar(&ops, "ops", "read,write", "operations: read, write")
	fs.StringVar(&blocks, "blocks", "4K-64M", "block sizes: a list (4K,64K,1M) or a range (4K-64M, stepped by -step)")
	fs.IntVar(&step, "step", 4, "factor between block sizes of a range")
	fs.StringVar(&descs, "descs", "1", "descriptors per operation (comma-separated list)")
	fs.StringVar(&inflight, "inflight", "1", "operations in flight (comma-separated list)")
	fs.StringVar(&shapes, "shapes", "", "explicit shapes BLOCKxDESCS, comma-separated, e.g. 64Kx4096,256Mx1 (replaces -blocks and -descs)")
	fs.StringVar(&c.preset, "preset", "", "kv: 4096 × 64 KiB, one KV hand-off, beside 1 × 256 MiB; model: one prompt's KV cache for -model and -tokens (replaces -blocks and -descs)")
	fs.StringVar(&model, "model", "llama3-8b", "model of -preset model: "+strings.Join(slices.Sorted(maps.Keys(models)), ", "))
	fs.IntVar(&tokens, "tokens", 2048, "prompt tokens of -preset model (blocks of 16 tokens)")
	fs.IntVar(&c.iters, "iters", 0, "measured operations per point; 0: about 1 GiB per point, between 16 and 1000")
	fs.IntVar(&c.warmup, "warmup", -1, "warm-up operations per point; -1: a tenth of -iters, at least 2")
	fs.IntVar(&c.runs, "runs", 1, "repeat the whole sweep this many times and report per-row medians (ratios: the median of each run's own ratio)")
	fs.BoolVar(&c.check, "check", false, "consistency mode: verify every byte of every transfer (timings then include nothing but are not meaningful)")
	fs.StringVar(&outputs, "o", "", "write results to these files (comma-separated; .csv or .json)")
	fs.StringVar(&c.from, "from", "", "measure nothing: render a previous run's -o .json file (table, -o, -chart)")
	fs.StringVar(&c.chart, "chart", "", "draw bandwidth against block size to this file (.svg or .png)")
	fs.BoolVar(&c.baseline, "baselines", true, "measure the raw baselines (TCP stream and ping-pong, copy, process_vm_readv)")
	fs.BoolVar(&c.control, "control", true, "measure the control plane (token over NATS, READ with its token request)")
	fs.StringVar(&c.ucx, "ucx", "auto", "auto: run ucx_perftest when it is on PATH; off: never")
	fs.StringVar(&ucxTLS, "ucx-tls", "tcp,self;posix,self", "UCX_TLS settings for ucx_perftest, separated by ';'")
	fs.StringVar(&c.ucxAlloc, "ucx-alloc", "both", "buffers of the ucx rows, on both sides: on: allocated by UCX (ucp_mem_map ALLOCATE, as ucx_perftest's); off: Go heap; both: a row of each")
	fs.DurationVar(&c.gap, "gap", 0, "pause this long after each measured operation (0: none): back to back, a target slower per operation than the initiator queues completion notifications and the done latencies grow with the batch; with a gap they are each operation's own")
	fs.BoolVar(&c.interleave, "interleave", true, "run the points of at most 64 KiB with one operation in flight in batches alternating with batches of the raw 4 KiB TCP ping-pong (with -baselines), and report the median of each pair's p50 ratio, active and passive (\"×ping\"); false: only the ping-pong measured apart")
	fs.StringVar(&c.cpuProfile, "cpuprofile", "", "write this process's CPU profile (go tool pprof) to this file, from start to end, setup included; a target spawned with -role both writes its own to FILE.target")
	fs.IntVar(&c.latIters, "latency-iters", 2000, "round trips of the 4 KiB ping-pong and the control-plane measurements")
	fs.StringVar(&c.progress, "progress", "auto", "auto: a progress bar on a terminal, one line per point otherwise; on; off")
	fs.StringVar(&initMem, "initiator-mem", "dram", "where the initiator's local buffers live: dram (the Go heap), vram (GPU memory, via the CUDA driver, or the simulator with GOXFER_DEVICE=sim) or shm (shared host memory, shm.Alloc: cma maps the peer's, path cma+shm); with vram or shm on either side each point is also measured dram/dram; with vram beside cuMemcpy D2H and H2D baselines (and D2D with vram on both sides)")
	fs.StringVar(&targetMem, "target-mem", "dram", "where the target's exposed buffers live: dram, vram or shm (allocated by the target process)")
	fs.IntVar(&c.gpu, "gpu", 0, "the GPU of vram buffers, on both sides")
	fs.StringVar(&c.staging, "staging", "4M,64M", "CHUNK,POOL: how the connectors stage GPU memory through pinned host memory (connect.WithStaging); pass the same to a target started by hand")
	fs.BoolVar(&c.deviceIPC, "device-ipc", true, "cma: move GPU memory on one host by mapping the peer's allocations (CUDA IPC, cma.WithDeviceIPC; path cma+ipc); false: stage it through pinned host memory (cma+staging); passed on to a spawned target")
	fs.DurationVar(&c.tcpSpin, "tcp-latency", 0, "tcp: latency mode (tcp.WithLatencyMode) with this spin, on both sides (passed on to a spawned target; pass the same to a target started by hand): a connection's reader polls this long after a frame before it blocks, trading CPU for latency; 0: off (the default); at most 10ms")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if c.tcpSpin < 0 || c.tcpSpin > 10*time.Millisecond {
		return nil, fmt.Errorf("-tcp-latency %v: want 0 (off) up to 10ms", c.tcpSpin)
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if !slices.Contains([]string{"both", "initiator", "target"}, c.role) {
		return nil, fmt.Errorf("-role %q: want both, initiator or target", c.role)
	}
	if c.timeout <= 0 {
		return nil, fmt.Errorf("-timeout %v: want a positive duration", c.timeout)
	}
	if c.session == "" {
		c.session = "goxfer-bench"
		if c.role == "both" {
			var b [6]byte
			_, _ = rand.Read(b[:])
			c.session = hex.EncodeToString(b[:])
		}
	}
	if strings.ContainsAny(c.session, ".*> \t") {
		return nil, fmt.Errorf("-session %q: no dots, wildcards or spaces", c.session)
	}
	var err error
	if c.backends, err = selectBackends(backends); err != nil {
		return nil, err
	}
	if c.stageChunk, c.stagePool, err = parseStaging(c.staging); err != nil {
		return nil, err
	}
	if c.role == "target" {
		return c, nil
	}
	for _, o := range strings.Split(ops, ",") {
		d, err := parseDirection(o)
		if err != nil {
			return nil, fmt.Errorf("-ops: %w", err)
		}
		c.ops = append(c.ops, d)
	}
	if c.inflight, err = parseInts("-inflight", inflight, 1, 1024); err != nil {
		return nil, err
	}
	if c.mem.init, err = parseMem(initMem); err != nil {
		return nil, fmt.Errorf("-initiator-mem: %w", err)
	}
	if c.mem.target, err = parseMem(targetMem); err != nil {
		return nil, fmt.Errorf("-target-mem: %w", err)
	}
	if c.gpu < 0 {
		return nil, fmt.Errorf("-gpu %d: want a GPU ordinal, 0 or more", c.gpu)
	}
	switch {
	case shapes != "" && c.preset != "":
		return nil, fmt.Errorf("-shapes and -preset %s: give one of them", c.preset)
	case shapes != "":
		if c.shapes, err = parseShapes(shapes); err != nil {
			return nil, err
		}
	}
	switch c.preset {
	case "":
		if c.shapes != nil {
			break
		}
		if step < 2 {
			return nil, fmt.Errorf("-step %d: want at least 2", step)
		}
		if c.blocks, err = parseBlocks(blocks, step); err != nil {
			return nil, err
		}
		if c.descs, err = parseInts("-descs", descs, 1, 1<<20); err != nil {
			return nil, err
		}
		for _, d := range c.descs {
			for _, b := range c.blocks {
				c.shapes = append(c.shapes, shape{Block: b, Descs: d})
			}
		}
	case "kv":
		c.shapes = []shape{{Block: 256 << 20, Descs: 1, Label: "1 region"}, {Block: 64 << 10, Descs: 4096, Label: "KV hand-off"}}
	case "model":
		m, ok := models[model]
		if !ok {
			return nil, fmt.Errorf("-model %q: known models are %s", model, strings.Join(slices.Sorted(maps.Keys(models)), ", "))
		}
		if tokens < 16 {
			return nil, fmt.Errorf("-tokens %d: want at least one block of 16 tokens", tokens)
		}
		block := 2 * 16 * m.kvHeads * m.headDim * 2 // K+V, 16 tokens, fp16
		n := m.layers * (tokens / 16)
		c.shapes = []shape{{Block: block * n, Descs: 1, Label: "1 region"}, {Block: block, Descs: n, Label: fmt.Sprintf("%s, %d tokens", model, tokens)}}
	default:
		return nil, fmt.Errorf("-preset %q: want kv or model", c.preset)
	}
	if c.iters < 0 {
		return nil, fmt.Errorf("-iters %d: want 0 (auto) or more", c.iters)
	}
	if c.runs < 1 || c.runs > 100 {
		return nil, fmt.Errorf("-runs %d: want 1 to 100", c.runs)
	}
	if c.latIters < 1 {
		return nil, fmt.Errorf("-latency-iters %d: want at least 1", c.latIters)
	}
	if !slices.Contains([]string{"auto", "on", "off"}, c.progress) {
		return nil, fmt.Errorf("-progress %q: want auto, on or off", c.progress)
	}
	if !slices.Contains([]string{"on", "off", "both"}, c.ucxAlloc) {
		return nil, fmt.Errorf("-ucx-alloc %q: want on, off or both", c.ucxAlloc)
	}
	if !slices.Contains([]string{"auto", "off"}, c.ucx) {
		return nil, fmt.Errorf("-ucx %q: want auto or off", c.ucx)
	}
	for _, t := range strings.Split(ucxTLS, ";") {
		if t = strings.TrimSpace(t); t != "" {
			c.ucxTLS = append(c.ucxTLS, t)
		}
	}
	if outputs != "" {
		for _, o := range strings.Split(outputs, ",") {
			if ext := strings.ToLower(fileExt(o)); ext != ".csv" && ext != ".json" {
				return nil, fmt.Errorf("-o %q: want a .csv or .json file", o)
			}
			c.outputs = append(c.outputs, o)
		}
	}
	if c.chart != "" {
		if ext := strings.ToLower(fileExt(c.chart)); ext != ".svg" && ext != ".png" {
			return nil, fmt.Errorf("-chart %q: want a .svg or .png file", c.chart)
		}
	}
	if c.from != "" {
		return c, nil
	}
	// Sizes that cannot fit fail here, before anything is allocated or
	// started.
	avail := memAvailable()
	for _, sh := range c.shapes {
		for _, n := range c.inflight {
			if err := checkMemory(sh.Block, sh.Descs, max(n, 2), 2, avail); err != nil {
				return nil, err
			}
		}
	}
	return c, nil
}

// itersFor returns the measured and warm-up operations of a point.
func (c *config) itersFor(bytes int64) (iters, warmup int) {
	iters = c.iters
	if iters == 0 {
		iters = int(min(max((1<<30)/bytes, 16), 1000))
	}
	warmup = c.warmup
	if warmup < 0 {
		warmup = max(iters/10, 2)
	}
	return iters, warmup
}

// checkMemory fails when block × descs × slots × sides bytes exceed avail
// (0: unknown, no check).
func checkMemory(block, descs, slots, sides int, avail uint64) error {
	need := float64(block) * float64(descs) * float64(slots) * float64(sides)
	if avail == 0 || need <= float64(avail) {
		return nil
	}
	what := fmt.Sprintf("block %s × %d descriptors × %d buffers", fmtSize(float64(block)), descs, slots)
	if sides > 1 {
		what += fmt.Sprintf(" × %d sides", sides)
	}
	return fmt.Errorf("%s = %s does not fit in memory: MemAvailable is %s (/proc/meminfo)", what, fmtSize(need), fmtSize(float64(avail)))
}

// parseShapes parses -shapes: "64Kx4096,256Mx1,1M" (no count: one
// descriptor).
func parseShapes(s string) ([]shape, error) {
	var out []shape
	for _, f := range strings.Split(s, ",") {
		bs, ds, ok := strings.Cut(strings.ToLower(strings.TrimSpace(f)), "x")
		b, err := parseSize(bs)
		if err != nil {
			return nil, fmt.Errorf("-shapes: %w", err)
		}
		d := 1
		if ok {
			if d, err = strconv.Atoi(ds); err != nil || d < 1 || d > 1<<20 {
				return nil, fmt.Errorf("-shapes %q: the descriptor count %q is not an integer in [1, %d]", f, ds, 1<<20)
			}
		}
		out = append(out, shape{Block: b, Descs: d})
	}
	return out, nil
}

// parseStaging parses -staging: "CHUNK,POOL" in sizes.
func parseStaging(s string) (chunk, pool int, err error) {
	cs, ps, ok := strings.Cut(s, ",")
	if !ok {
		return 0, 0, fmt.Errorf("-staging %q: want CHUNK,POOL such as 4M,64M", s)
	}
	if chunk, err = parseSize(cs); err != nil {
		return 0, 0, fmt.Errorf("-staging: chunk: %w", err)
	}
	if pool, err = parseSize(ps); err != nil {
		return 0, 0, fmt.Errorf("-staging: pool: %w", err)
	}
	return chunk, pool, nil
}

func parseInts(name, s string, lo, hi int) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < lo || n > hi {
			return nil, fmt.Errorf("%s: %q is not an integer in [%d, %d]", name, f, lo, hi)
		}
		out = append(out, n)
	}
	return out, nil
}

// parseBlocks parses "4K,64K" or "4K-64M" (stepped by step).
func parseBlocks(s string, step int) ([]int, error) {
	if lo, hi, ok := strings.Cut(s, "-"); ok && !strings.Contains(s, ",") {
		a, err := parseSize(lo)
		if err != nil {
			return nil, err
		}
		b, err := parseSize(hi)
		if err != nil {
			return nil, err
		}
		if a > b {
			return nil, fmt.Errorf("-blocks %q: the range is empty", s)
		}
		var out []int
		for n := a; n <= b; n *= step {
			out = append(out, n)
		}
		return out, nil
	}
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := parseSize(f)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// parseSize parses 4096, 4K, 4KiB, 64M, 1G (binary units).
func parseSize(s string) (int, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	t = strings.TrimSuffix(strings.TrimSuffix(t, "B"), "I")
	mult := 1.0
	if t != "" {
		switch t[len(t)-1] {
		case 'K':
			mult = 1 << 10
		case 'M':
			mult = 1 << 20
		case 'G':
			mult = 1 << 30
		case 'T':
			mult = 1 << 40
		}
		if mult > 1 {
			t = t[:len(t)-1]
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	n := v * mult
	if err != nil || v < 1 || n != math.Trunc(n) {
		return 0, fmt.Errorf("block size %q: want a size such as 4096, 4K, 64KiB, 1M", s)
	}
	if n > 1<<40 {
		return 0, fmt.Errorf("block size %q: at most 1 TiB", s)
	}
	return int(n), nil
}

// fmtSize prints a byte count in binary units.
func fmtSize(n float64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}
	i := 0
	for n >= 1024 && i < len(units)-1 {
		n /= 1024
		i++
	}
	if n == math.Trunc(n) {
		return fmt.Sprintf("%.0f %s", n, units[i])
	}
	return fmt.Sprintf("%.1f %s", n, units[i])
}

func fileExt(name string) string {
	if i := strings.LastIndexByte(name, '.'); i >= 0 && !strings.ContainsRune(name[i:], '/') {
		return name[i:]
	}
	return ""
}

// startCPUProfile starts profiling this process's CPU into file; stop ends
// it and closes the file.
func startCPUProfile(file string) (stop func() error, err error) {
	f, err := os.Create(file)
	if err != nil {
		return nil, fmt.Errorf("-cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("-cpuprofile: %w", err)
	}
	return func() error {
		pprof.StopCPUProfile()
		return f.Close()
	}, nil
}
