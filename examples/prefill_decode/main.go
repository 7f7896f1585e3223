// Command prefill_decode runs a disaggregated prefill → decode KV-cache
// hand-off, the way NVIDIA Dynamo splits LLM inference: a prefill worker
// computes the KV cache of a prompt, a decode worker, in another process or
// on another host, needs it to generate tokens, and goxfer moves the blocks
// between them one-sidedly while NATS carries only small tokens.
//
// With no flags it starts an embedded NATS server and two worker processes
// (re-executions of this binary with -role), then sends 8 requests:
//
//	go run ./examples/prefill_decode                  # READ mode: decode reads prefill's blocks
//	go run ./examples/prefill_decode -mode write      # WRITE mode: prefill writes into decode's blocks
//	go run ./examples/prefill_decode -nats nats://127.0.0.1:4222   # an existing server (nats-server -js)
//	go run ./examples/prefill_decode -device cuda     # the KV blocks in GPU 0's memory, on both sides
//	go run ./examples/prefill_decode -device sim      # the same on simulated GPUs, on a machine without one
//	go run ./examples/prefill_decode -metrics :9090   # Prometheus metrics: prefill's at :9090/metrics, decode's at :9091
//
//	# one worker per host, against a shared NATS server:
//	go run ./examples/prefill_decode -role prefill -nats nats://10.0.0.1:4222 -listen :0
//	go run ./examples/prefill_decode -role decode  -nats nats://10.0.0.1:4222 -listen :0
//
// With -metrics each worker serves its Connector's counters and
// per-operation histograms (metrics/promconnect, docs/metrics.md), the Go
// runtime's and the process's at /metrics, for as long as it runs.
//
// One request, in READ mode (the default):
//
//  1. decode → prefill, over NATS (transport/nats Request): "the KV cache of
//     prompt r-3, 512 tokens, please".
//  2. prefill takes the blocks from its KV pool, fills them (a real engine
//     runs the model's forward pass here; this one writes deterministic
//     bytes derived from the request ID), exposes them with CreateReadable
//     and replies with the operation's token.
//  3. decode takes blocks from its own pool and BeginReads the token into
//     them: the bytes move over the best backend the two agents share (tcp
//     between processes), without involving the prefill worker's code.
//  4. decode's Wait returns once every byte has landed; decode checks every
//     byte. prefill's Wait returns once decode reported completion; prefill
//     Closes the operation and puts the blocks back in its pool.
//
// In WRITE mode the roles of the memory turn: decode exposes empty blocks
// with CreateWritable and offers the token (transport/nats Publish, queue
// group "prefill"); a prefill worker takes the offer, fills its blocks and
// BeginWrites them into decode's, and decode's Wait returns once they are in
// place.
//
// Both workers join the transport/nats presence registry, so tokens may be
// compact (Metadata.Compact: the agent's ID without its endpoints, which
// the receiver resolves through the registry) and a worker that vanishes is
// noticed within a couple of heartbeats. Requests are retried when NATS
// hiccups, under the same request ID, which makes them idempotent: a retry
// replaces the earlier attempt, and the decode worker verifies whatever
// arrives against that ID.
//
// With -device cuda (GPU 0) or cuda:N, both workers keep their KV blocks in
// GPU memory: prefill computes a prompt's blocks in host memory and copies
// them into its GPU, exposes them (or writes them) with device descriptors,
// and decode receives them into its own GPU's memory, then copies them back
// to host memory to check every byte. Each transfer says which path moved
// the bytes (ReadOperation.Path, WriteOperation.Path): "cma+staging" or
// "tcp+staging" where the backend goes through pinned host buffers. With
// -device sim the GPUs are simulated (devmem.Sim, GOXFER_DEVICE=sim in
// every worker), so the same run works on a machine without a GPU; there
// -device cuda stops at once, saying so.
//
// Exit status: 0 when every request completed and every byte matched, 1 on
// any failure or mismatch (and for -device cuda without a GPU), 2 for bad
// flags, 130 when interrupted (Ctrl-C).
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// config is what the flags say.
type config struct {
	role           string // "" (run both workers), "prefill" or "decode"
	natsURL        string
	mode           string // "read" or "write"
	requests       int
	concurrency    int
	promptTokens   int
	model          Model
	device         kvDevice
	compact        bool
	listen         string
	metrics        string // -metrics: where to serve /metrics; "": nowhere
	wait           time.Duration
	attemptTimeout time.Duration
	decodeTime     time.Duration
	corruptBlock   int // test hook: flip a byte of this block of the first request; -1: none
}

// hiddenFlags are test hooks, left out of -help.
var hiddenFlags = map[string]bool{"x-corrupt-block": true}

func parseFlags(args []string, stderr io.Writer) (config, *flag.FlagSet, error) {
	c := config{model: llama3_8B}
	fs := flag.NewFlagSet("prefill_decode", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.role, "role", "", "run one worker only: prefill or decode (default: start an orchestrator that runs both)")
	fs.StringVar(&c.natsURL, "nats", "", "NATS server URL (default: start an embedded server; required with -role)")
	fs.StringVar(&c.mode, "mode", "read", "read: decode READs prefill's blocks; write: prefill WRITEs into decode's blocks")
	fs.IntVar(&c.requests, "requests", 8, "requests the decode worker sends")
	fs.IntVar(&c.concurrency, "concurrency", 2, "requests in flight at once; the decode pool holds this many prompts, the prefill pool twice as many")
	fs.IntVar(&c.promptTokens, "prompt-tokens", 512, "tokens in each prompt")
	fs.IntVar(&c.model.Layers, "layers", c.model.Layers, "model: transformer layers")
	fs.IntVar(&c.model.KVHeads, "kv-heads", c.model.KVHeads, "model: KV heads per layer")
	fs.IntVar(&c.model.HeadDim, "head-dim", c.model.HeadDim, "model: dimensions per head")
	fs.IntVar(&c.model.BlockTokens, "block-tokens", c.model.BlockTokens, "model: tokens per KV block")
	fs.StringVar(&c.model.DType, "dtype", c.model.DType, "model: element type: fp32, fp16, bf16 or fp8")
	fs.Var(&c.device, "device", "where both workers keep their KV blocks: host (the default), cuda (GPU 0), cuda:N, or sim / sim:N (simulated GPUs, GOXFER_DEVICE=sim, for machines without one)")
	fs.BoolVar(&c.compact, "compact-tokens", true, "hand out compact tokens, resolved through the presence registry")
	fs.StringVar(&c.listen, "listen", "127.0.0.1:0", "address the tcp backend listens on; use :0 when the workers are on different hosts")
	fs.StringVar(&c.metrics, "metrics", "", "serve Prometheus metrics at http://ADDR/metrics, e.g. :9090 (default: none); without -role the prefill worker takes ADDR and the decode worker the next port")
	fs.DurationVar(&c.wait, "wait", 15*time.Second, "how long the decode worker waits for a prefill worker to answer")
	fs.DurationVar(&c.attemptTimeout, "attempt-timeout", 5*time.Second, "how long one attempt of a hand-off may take before it is retried")
	fs.DurationVar(&c.decodeTime, "decode-time", 0, "simulated decoding time per request, holding its KV blocks, after they are verified")
	fs.IntVar(&c.corruptBlock, "x-corrupt-block", -1, "test hook: the prefill worker flips one byte of this block of the first request it fills")
	fs.Usage = func() {
		w := fs.Output()
		fmt.Fprintf(w, "Usage: prefill_decode [flags]\n\nRuns a disaggregated prefill → decode KV-cache hand-off over goxfer and NATS.\n\nFlags:\n")
		visible := flag.NewFlagSet("", flag.ContinueOnError)
		visible.SetOutput(w)
		fs.VisitAll(func(f *flag.Flag) {
			if !hiddenFlags[f.Name] {
				visible.Var(f.Value, f.Name, f.Usage)
				visible.Lookup(f.Name).DefValue = f.DefValue
			}
		})
		visible.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return c, fs, err
	}
	if err := c.validate(fs); err != nil {
		fmt.Fprintf(stderr, "prefill_decode: %v\n", err)
		fs.Usage()
		return c, fs, err
	}
	return c, fs, nil
}

func (c config) validate(fs *flag.FlagSet) error {
	switch {
	case fs.NArg() > 0:
		return fmt.Errorf("unexpected arguments %q: all settings are flags", fs.Args())
	case c.role != "" && c.role != "prefill" && c.role != "decode":
		return fmt.Errorf("-role %q: want prefill or decode (or no -role, to run both)", c.role)
	case c.role != "" && c.natsURL == "":
		return fmt.Errorf("-role %s needs -nats: the URL of the NATS server both workers use", c.role)
	case c.mode != "read" && c.mode != "write":
		return fmt.Errorf("-mode %q: want read or write", c.mode)
	case c.requests < 1:
		return fmt.Errorf("-requests %d: want at least 1", c.requests)
	case c.concurrency < 1 || c.concurrency > 64:
		return fmt.Errorf("-concurrency %d: want 1 to 64", c.concurrency)
	case c.wait <= 0 || c.attemptTimeout <= 0 || c.decodeTime < 0:
		return fmt.Errorf("-wait, -attempt-timeout and -decode-time must be positive durations")
	}
	if c.metrics != "" {
		if _, err := metricsAddr(c.metrics, 1); err != nil {
			return fmt.Errorf("-metrics %q: want host:port or :port: %w", c.metrics, err)
		}
	}
	if err := c.model.Validate(); err != nil {
		return err
	}
	l, err := c.model.LayoutFor(c.promptTokens)
	if err != nil {
		return fmt.Errorf("-prompt-tokens: %w", err)
	}
	if pool := 2 * int64(c.concurrency) * l.Bytes(); pool > 16<<30 {
		return fmt.Errorf("the prefill worker's KV pool would take %s (2 × %d prompts of %s): lower -concurrency or -prompt-tokens", sizeString(pool), c.concurrency, sizeString(l.Bytes()))
	}
	return nil
}

// envRunMain, set to 1, makes the package's test binary run main: the tests
// run the example as a child process, which re-executes itself for workers.
const envRunMain = "PREFILL_DECODE_RUN_MAIN"

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run runs the example with command-line arguments args and returns the
// exit status.
func run(args []string, stdout, stderr io.Writer) int {
	cfg, fs, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		return 2
	}
	// GPU memory: a machine without the GPU asked for stops here, before
	// NATS or any worker starts.
	drv, err := cfg.device.open()
	if err != nil {
		fmt.Fprintf(stderr, "prefill_decode: %v\n", err)
		return 1
	}
	out := &lineWriter{w: stdout}
	name := cfg.role
	if name == "" {
		name = "orchestrator"
	}

	// The first SIGINT or SIGTERM cancels ctx, with the signal as its
	// cause, and everything shuts down in order; a second one ends the
	// process at once (the orchestrator kills its workers first).
	var orch *orchestrator
	force := func() {}
	if cfg.role == "" {
		orch = &orchestrator{cfg: cfg, fs: fs, out: out, errOut: &lineWriter{w: stderr}}
		force = orch.kill
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	done := make(chan struct{})
	defer func() {
		signal.Stop(sigs)
		close(done)
	}()
	go func() {
		select {
		case s := <-sigs:
			fmt.Fprintf(out, "%s: %v: shutting down (a second signal forces exit)\n", name, s)
			cancel(signalError{s})
		case <-done:
			return
		}
		select {
		case <-sigs:
			fmt.Fprintf(out, "%s: second signal: exiting now\n", name)
			force()
			os.Exit(130)
		case <-done:
		}
	}()

	// The workers' logs (goxfer's, on stderr) need no timestamps: the
	// orchestrator prefixes each line with the worker's role.
	log.SetFlags(0)

	switch cfg.role {
	case "prefill":
		err = runPrefill(ctx, cfg, drv, out)
	case "decode":
		err = runDecode(ctx, cfg, drv, out)
	default:
		err = orch.run(ctx)
	}

	var sig signalError
	interrupted := errors.As(context.Cause(ctx), &sig)
	switch {
	case err != nil && !interrupted:
		fmt.Fprintf(stderr, "prefill_decode: %s: %v\n", name, err)
		return 1
	case interrupted && cfg.role == "prefill" && sig.Signal == syscall.SIGTERM && err == nil:
		return 0 // a serving worker asked to stop has done its job
	case interrupted:
		if err != nil {
			fmt.Fprintf(stderr, "prefill_decode: %s: interrupted: %v\n", name, err)
		}
		return 130
	}
	return 0
}

// signalError is the cause of a context cancelled by a signal.
type signalError struct{ os.Signal }

func (e signalError) Error() string { return "interrupted by " + e.Signal.String() }

// orchestrator runs the default job: an embedded NATS server (unless
// -nats), a prefill worker and a decode worker, each a child process
// running this binary with -role.
type orchestrator struct {
	cfg         config
	fs          *flag.FlagSet
	out, errOut io.Writer

	mu      sync.Mutex
	workers []*child
}

// stopGrace is how long a worker asked to stop may take before it is killed.
const stopGrace = 10 * time.Second

func (o *orchestrator) run(ctx context.Context) error {
	cfg := o.cfg
	l, _ := cfg.model.LayoutFor(cfg.promptTokens)
	fmt.Fprintf(o.out, "goxfer prefill → decode: %s mode, %d requests of %d tokens, %d in flight\n",
		strings.ToUpper(cfg.mode), cfg.requests, cfg.promptTokens, cfg.concurrency)
	fmt.Fprintf(o.out, "model: %v\n", cfg.model)
	fmt.Fprintf(o.out, "KV cache of one prompt: %d layers × (K + V) × %d blocks = %d blocks, %s\n",
		l.Layers, l.BlocksPerSeq, l.Blocks(), sizeString(l.Bytes()))
	if cfg.device.gpuMemory() {
		fmt.Fprintf(o.out, "KV blocks: %s, in both workers; decode copies them back to host memory to verify every byte\n", cfg.device.describe())
	} else {
		fmt.Fprintf(o.out, "KV blocks: host memory, in both workers\n")
	}

	url := cfg.natsURL
	if url == "" {
		srv, err := natsserver.Start(ctx)
		if err != nil {
			return fmt.Errorf("start the embedded NATS server: %w", err)
		}
		defer srv.Shutdown()
		url = srv.URL()
		fmt.Fprintf(o.out, "nats: embedded server with JetStream at %s\n", url)
	} else {
		fmt.Fprintf(o.out, "nats: using %s\n", url)
	}

	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find this program to start the workers: %w", err)
	}
	// The workers get the flags given here, except the role and NATS URL,
	// and each its own -metrics address.
	var args []string
	o.fs.Visit(func(f *flag.Flag) {
		if f.Name != "role" && f.Name != "nats" && f.Name != "metrics" {
			args = append(args, "-"+f.Name+"="+f.Value.String())
		}
	})
	start := time.Now()
	prefill, err := o.start(exe, "prefill", url, withMetrics(args, cfg.metrics, 0))
	if err != nil {
		return err
	}
	decode, err := o.start(exe, "decode", url, withMetrics(args, cfg.metrics, 1))
	if err != nil {
		prefill.stop(syscall.SIGTERM)
		<-prefill.done
		return err
	}
	fmt.Fprintf(o.out, "started the prefill worker (pid %d) and the decode worker (pid %d)\n", prefill.pid(), decode.pid())

	// The run ends when the decode worker has sent every request. The
	// prefill worker serves until told to stop; if it ends first, the
	// decode worker cannot finish.
	var runErr error
	select {
	case <-decode.done:
		if decode.err != nil {
			runErr = fmt.Errorf("the decode worker failed: %w", decode.err)
		}
	case <-prefill.done:
		runErr = fmt.Errorf("the prefill worker ended before the decode worker finished: %v", exitString(prefill.err))
	case <-ctx.Done():
		// Pass the signal on: the workers run in process groups of their
		// own, so a Ctrl-C in the terminal reaches only this process.
		var sig signalError
		errors.As(context.Cause(ctx), &sig)
		prefill.stop(sig.Signal)
		decode.stop(sig.Signal)
		<-prefill.done
		<-decode.done
		return nil
	}
	decode.stop(syscall.SIGTERM)
	prefill.stop(syscall.SIGTERM)
	<-decode.done
	<-prefill.done
	if runErr == nil && prefill.err != nil {
		runErr = fmt.Errorf("the prefill worker failed while stopping: %w", prefill.err)
	}
	if runErr != nil {
		return runErr
	}
	fmt.Fprintf(o.out, "done in %v: every request completed and every byte verified\n", time.Since(start).Round(time.Millisecond))
	return nil
}

// withMetrics returns args with the -metrics flag of the i-th worker
// (metricsAddr), if base is not empty.
func withMetrics(args []string, base string, i int) []string {
	if base == "" {
		return args
	}
	addr, _ := metricsAddr(base, i) // validated with the flags
	return append(args[:len(args):len(args)], "-metrics="+addr)
}

// start runs this program as a worker in role, its output prefixed with
// the role.
func (o *orchestrator) start(exe, role, url string, args []string) (*child, error) {
	cmd := exec.Command(exe, append([]string{"-role", role, "-nats", url}, args...)...)
	cmd.Env = append(os.Environ(), o.cfg.device.env()...)
	cmd.Stdout = &prefixWriter{prefix: "[" + role + "] ", w: o.out}
	cmd.Stderr = &prefixWriter{prefix: "[" + role + "] ", w: o.errOut}
	cmd.SysProcAttr = workerProcAttr()
	cmd.WaitDelay = time.Second // for the output pipes, once the worker has exited
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the %s worker: %w", role, err)
	}
	w := &child{role: role, cmd: cmd, done: make(chan struct{})}
	go func() {
		w.err = cmd.Wait()
		cmd.Stdout.(*prefixWriter).Flush()
		cmd.Stderr.(*prefixWriter).Flush()
		close(w.done)
	}()
	o.mu.Lock()
	o.workers = append(o.workers, w)
	o.mu.Unlock()
	return w, nil
}

// kill ends every worker at once, for a forced exit.
func (o *orchestrator) kill() {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, w := range o.workers {
		_ = w.cmd.Process.Kill()
	}
}

// child is a worker running as a child process.
type child struct {
	role string
	cmd  *exec.Cmd
	done chan struct{} // closed once it has exited and its output is flushed
	err  error         // how it exited; read after done
	once sync.Once
}

func (w *child) pid() int { return w.cmd.Process.Pid }

// stop asks the worker to stop with sig, and kills it if it has not within
// stopGrace.
func (w *child) stop(sig os.Signal) {
	w.once.Do(func() {
		_ = w.cmd.Process.Signal(sig)
		go func() {
			t := time.NewTimer(stopGrace)
			defer t.Stop()
			select {
			case <-w.done:
			case <-t.C:
				_ = w.cmd.Process.Kill()
			}
		}()
	})
}

func exitString(err error) string {
	if err == nil {
		return "exit status 0"
	}
	return err.Error()
}

// lineWriter serializes writes from several goroutines, so that lines do
// not interleave.
type lineWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lineWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// prefixWriter writes every line it is given to w, after prefix.
type prefixWriter struct {
	prefix string
	w      io.Writer
	buf    []byte // the partial last line
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	p.buf = append(p.buf, b...)
	for {
		i := bytes.IndexByte(p.buf, '\n')
		if i < 0 {
			return len(b), nil
		}
		line := append([]byte(p.prefix), p.buf[:i+1]...)
		p.buf = p.buf[i+1:]
		if _, err := p.w.Write(line); err != nil {
			return len(b), err
		}
	}
}

// Flush writes a last line that had no newline.
func (p *prefixWriter) Flush() {
	if len(p.buf) > 0 {
		_, _ = p.Write([]byte("\n"))
	}
}
