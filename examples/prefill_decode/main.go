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
//	go run ./examples/prefill_decode -prefill 3 -decode 2 -requests 48   # scale out: 3 prefill and 2 decode workers
//	go run ./examples/prefill_decode -nats nats://127.0.0.1:4222   # an existing server (nats-server -js)
//	go run ./examples/prefill_decode -device cuda     # the KV blocks in GPU 0's memory, on both sides
//	go run ./examples/prefill_decode -device sim      # the same on simulated GPUs, on a machine without one
//	go run ./examples/prefill_decode -metrics :9090   # Prometheus metrics: prefill's at :9090/metrics, decode's at :9091
//
//	# workers on several hosts, against a shared NATS server: any number
//	# of each role, each started alone with -role (and a -name of its own)
//	go run ./examples/prefill_decode -role prefill -name prefill-a -nats nats://10.0.0.1:4222 -listen :0
//	go run ./examples/prefill_decode -role prefill -name prefill-b -nats nats://10.0.0.1:4222 -listen :0
//	go run ./examples/prefill_decode -role decode  -name decode-a  -nats nats://10.0.0.1:4222 -listen :0 -requests 24
//
// With -prefill M and -decode N the orchestrator starts M prefill workers
// (prefill-1 to prefill-M) and N decode workers (decode-1 to decode-N),
// each a process, and starts the decode workers once every prefill worker
// has said it is ready. The decode workers split -requests between them;
// the prefill workers serve in one NATS queue group, which hands each
// request (or WRITE offer) to one of them at random, so the load spreads,
// and a prefill worker that dies leaves its requests to the others: a
// hand-off it held times out or fails and is tried again, and the queue
// group picks another. At the end the orchestrator prints a report: each
// worker's requests, requests/s, KV cache moved and GB/s, all over the
// same span (the decode workers' first request sent to their last one
// done), and the total. A worker started alone with -role prints its own
// figures instead: a decode worker in its summary (in READ mode with the
// prefill workers that served it), a prefill worker when it stops.
//
// With -metrics each worker serves its Connector's counters and
// per-operation histograms (metrics/promconnect, docs/metrics.md), the Go
// runtime's and the process's at /metrics, for as long as it runs. The
// orchestrator's worker i takes the port after worker i-1's, the prefill
// workers first: with -prefill 3 -decode 2 -metrics :9090, prefill-1 to
// prefill-3 serve on 9090 to 9092, decode-1 and decode-2 on 9093 and 9094.
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
// Exit status: 0 when every request completed and every byte matched (a
// prefill worker that ended early does not fail the run while another
// serves), 1 on any failure or mismatch (and for -device cuda without a
// GPU), 2 for bad flags, 130 when interrupted (Ctrl-C).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// config is what the flags say.
type config struct {
	role           string // "" (the orchestrator: start the workers), "prefill" or "decode"
	name           string // the worker's name; "": its role
	prefills       int    // the orchestrator's prefill workers
	decodes        int    // the orchestrator's decode workers
	natsURL        string
	mode           string // "read" or "write"
	requests       int    // in all (orchestrator), or this decode worker's
	concurrency    int
	promptTokens   int
	model          Model
	device         kvDevice
	compact        bool
	listen         string
	metrics        string // -metrics: where to serve /metrics; "": nowhere
	wait           time.Duration
	attemptTimeout time.Duration
	prefillTime    time.Duration
	decodeTime     time.Duration
	corruptBlock   int    // test hook: flip a byte of this block of the first request; -1: none
	report         string // the orchestrator's: where a worker writes its workerReport; "": nowhere
}

// hiddenFlags are test hooks and the orchestrator's plumbing, left out of
// -help.
var hiddenFlags = map[string]bool{"x-corrupt-block": true, "x-report": true}

// maxWorkers bounds -prefill and -decode: every worker is a process with a
// KV pool of its own on this host.
const maxWorkers = 16

func parseFlags(args []string, stderr io.Writer) (config, *flag.FlagSet, error) {
	c := config{model: llama3_8B}
	fs := flag.NewFlagSet("prefill_decode", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.role, "role", "", "run one worker only: prefill or decode (default: start an orchestrator that runs the workers, -prefill and -decode of them)")
	fs.IntVar(&c.prefills, "prefill", 1, fmt.Sprintf("prefill workers the orchestrator starts (without -role), 1 to %d; the NATS queue group %q spreads the requests among them", maxWorkers, queuePrefill))
	fs.IntVar(&c.decodes, "decode", 1, fmt.Sprintf("decode workers the orchestrator starts (without -role), 1 to %d; -requests is split among them", maxWorkers))
	fs.StringVar(&c.name, "name", "", "this worker's name in its output and the report (default: its role; the orchestrator names its workers prefill-1, prefill-2, ..., decode-1, ... when it runs several of a role)")
	fs.StringVar(&c.natsURL, "nats", "", "NATS server URL (default: start an embedded server; required with -role)")
	fs.StringVar(&c.mode, "mode", "read", "read: decode READs prefill's blocks; write: prefill WRITEs into decode's blocks")
	fs.IntVar(&c.requests, "requests", 8, "requests in all, split among the decode workers; with -role decode, the requests this worker sends")
	fs.IntVar(&c.concurrency, "concurrency", 2, "requests in flight at once; the decode pool holds this many prompts, the prefill pool twice as many")
	fs.IntVar(&c.promptTokens, "prompt-tokens", 512, "tokens in each prompt")
	fs.IntVar(&c.model.Layers, "layers", c.model.Layers, "model: transformer layers")
	fs.IntVar(&c.model.KVHeads, "kv-heads", c.model.KVHeads, "model: KV heads per layer")
	fs.IntVar(&c.model.HeadDim, "head-dim", c.model.HeadDim, "model: dimensions per head")
	fs.IntVar(&c.model.BlockTokens, "block-tokens", c.model.BlockTokens, "model: tokens per KV block")
	fs.StringVar(&c.model.DType, "dtype", c.model.DType, "model: element type: fp32, fp16, bf16 or fp8")
	fs.Var(&c.device, "device", "where the workers keep their KV blocks: host (the default), cuda (GPU 0), cuda:N, or sim / sim:N (simulated GPUs, GOXFER_DEVICE=sim, for machines without one)")
	fs.BoolVar(&c.compact, "compact-tokens", true, "hand out compact tokens, resolved through the presence registry")
	fs.StringVar(&c.listen, "listen", "127.0.0.1:0", "address the tcp backend listens on; use :0 when the workers are on different hosts")
	fs.StringVar(&c.metrics, "metrics", "", "serve Prometheus metrics at http://ADDR/metrics, e.g. :9090 (default: none); without -role worker i takes ADDR's port + i, the prefill workers first: with -prefill 3 -decode 2, prefill-1 to prefill-3 on :9090 to :9092, decode-1 and decode-2 on :9093 and :9094 (port 0: each worker a free port)")
	fs.DurationVar(&c.wait, "wait", 15*time.Second, "how long the decode worker waits for a prefill worker to answer")
	fs.DurationVar(&c.attemptTimeout, "attempt-timeout", 5*time.Second, "how long one attempt of a hand-off may take before it is retried")
	fs.DurationVar(&c.prefillTime, "prefill-time", 0, "simulated prefill (forward pass) time per request, holding its KV blocks, before they are handed off")
	fs.DurationVar(&c.decodeTime, "decode-time", 0, "simulated decoding time per request, holding its KV blocks, after they are verified")
	fs.IntVar(&c.corruptBlock, "x-corrupt-block", -1, "test hook: the prefill worker flips one byte of this block of the first request it fills")
	fs.StringVar(&c.report, "x-report", "", "the orchestrator's: write this worker's figures as JSON to this file when it ends")
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
	if c.name == "" {
		c.name = c.role
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
	case c.role != "" && (c.prefills != 1 || c.decodes != 1):
		return fmt.Errorf("-prefill and -decode are the orchestrator's (no -role): with -role, start one process per worker")
	case c.prefills < 1 || c.prefills > maxWorkers || c.decodes < 1 || c.decodes > maxWorkers:
		return fmt.Errorf("-prefill %d -decode %d: want 1 to %d of each", c.prefills, c.decodes, maxWorkers)
	case c.requests < 1:
		return fmt.Errorf("-requests %d: want at least 1", c.requests)
	case c.requests < c.decodes:
		return fmt.Errorf("-requests %d -decode %d: want at least one request per decode worker", c.requests, c.decodes)
	case c.concurrency < 1 || c.concurrency > 64:
		return fmt.Errorf("-concurrency %d: want 1 to 64", c.concurrency)
	case c.wait <= 0 || c.attemptTimeout <= 0 || c.prefillTime < 0 || c.decodeTime < 0:
		return fmt.Errorf("-wait, -attempt-timeout, -prefill-time and -decode-time must be positive durations")
	}
	if c.metrics != "" {
		if _, err := metricsAddr(c.metrics, c.prefills+c.decodes-1); err != nil {
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
	if c.role == "" {
		// The orchestrator's workers all run on this host.
		prompts := int64(c.concurrency) * int64(2*c.prefills+c.decodes)
		if all := prompts * l.Bytes(); all > 16<<30 {
			return fmt.Errorf("the workers' KV pools would take %s in all (%d prefill × 2 × %d prompts + %d decode × %d prompts, of %s each): lower -prefill, -decode, -concurrency or -prompt-tokens",
				sizeString(all), c.prefills, c.concurrency, c.decodes, c.concurrency, sizeString(l.Bytes()))
		}
	}
	return nil
}

// workerName returns the name of the orchestrator's i-th worker (from 0)
// of count in role: the role alone when it is the only one.
func workerName(role string, i, count int) string {
	if count == 1 {
		return role
	}
	return fmt.Sprintf("%s-%d", role, i+1)
}

// share returns how many of requests the i-th of n decode workers sends:
// an even split, the first ones taking one more when it does not divide.
func share(requests, i, n int) int {
	s := requests / n
	if i < requests%n {
		s++
	}
	return s
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
	name := cfg.name
	if cfg.role == "" {
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

// signalOf returns the signal that cancelled ctx; SIGTERM if none did.
func signalOf(ctx context.Context) os.Signal {
	var sig signalError
	if errors.As(context.Cause(ctx), &sig) {
		return sig.Signal
	}
	return syscall.SIGTERM
}

// orchestrator runs the default job: an embedded NATS server (unless
// -nats), -prefill prefill workers and -decode decode workers, each a
// child process running this binary with -role.
type orchestrator struct {
	cfg         config
	fs          *flag.FlagSet
	out, errOut io.Writer

	mu      sync.Mutex
	workers []*child
	exited  chan *child // each worker once it has exited; room for all
}

// stopGrace is how long a worker asked to stop may take before it is killed.
const stopGrace = 10 * time.Second

func (o *orchestrator) run(ctx context.Context) error {
	cfg := o.cfg
	l, _ := cfg.model.LayoutFor(cfg.promptTokens)
	fmt.Fprintf(o.out, "goxfer prefill → decode: %s mode, %d requests of %d tokens, %d in flight\n",
		strings.ToUpper(cfg.mode), cfg.requests, cfg.promptTokens, cfg.concurrency)
	if cfg.prefills > 1 || cfg.decodes > 1 {
		fmt.Fprintf(o.out, "workers: %d prefill, %d decode; each decode worker sends its share of the requests, %d in flight, and the NATS queue group %q picks the prefill worker of each\n",
			cfg.prefills, cfg.decodes, cfg.concurrency, queuePrefill)
	}
	fmt.Fprintf(o.out, "model: %v\n", cfg.model)
	fmt.Fprintf(o.out, "KV cache of one prompt: %d layers × (K + V) × %d blocks = %d blocks, %s\n",
		l.Layers, l.BlocksPerSeq, l.Blocks(), sizeString(l.Bytes()))
	every := "both workers"
	if cfg.prefills+cfg.decodes > 2 {
		every = "every worker"
	}
	if cfg.device.gpuMemory() {
		fmt.Fprintf(o.out, "KV blocks: %s, in %s; decode copies them back to host memory to verify every byte\n", cfg.device.describe(), every)
	} else {
		fmt.Fprintf(o.out, "KV blocks: host memory, in %s\n", every)
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
	// The orchestrator hears the prefill workers say they are ready, so
	// that the decode workers start once all of them take requests; then
	// it needs NATS no more.
	nc, err := connectNATS(url, "goxfer-example-orchestrator", o.out)
	if err != nil {
		return err
	}
	defer nc.Close()
	readyMsgs := make(chan *nats.Msg, cfg.prefills)
	if _, err := nc.ChanSubscribe(subjectReady, readyMsgs); err != nil {
		return fmt.Errorf("subscribe to %s: %w", subjectReady, err)
	}
	if err := nc.Flush(); err != nil {
		return fmt.Errorf("subscribe to %s: %w", subjectReady, err)
	}

	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find this program to start the workers: %w", err)
	}
	reports, err := os.MkdirTemp("", "prefill_decode-")
	if err != nil {
		return fmt.Errorf("make a folder for the workers' reports: %w", err)
	}
	defer os.RemoveAll(reports)
	// The workers get the flags given here, except those that say which
	// workers to run, and each its name, -metrics address and report file;
	// each decode worker its share of the requests.
	var args []string
	o.fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "role", "nats", "metrics", "name", "prefill", "decode", "requests", "x-report":
		default:
			args = append(args, "-"+f.Name+"="+f.Value.String())
		}
	})
	o.exited = make(chan *child, cfg.prefills+cfg.decodes)
	start := time.Now()
	var prefills, decodes []*child
	startWorker := func(role string, i, count, n int, extra ...string) error {
		name := workerName(role, i, count)
		wargs := append(slices.Clip(args), "-name="+name, "-x-report="+filepath.Join(reports, name+".json"))
		if cfg.metrics != "" {
			addr, _ := metricsAddr(cfg.metrics, n) // validated with the flags
			wargs = append(wargs, "-metrics="+addr)
		}
		w, err := o.start(exe, role, name, url, append(wargs, extra...))
		if err != nil {
			return err
		}
		if role == "prefill" {
			prefills = append(prefills, w)
		} else {
			decodes = append(decodes, w)
		}
		return nil
	}
	for i := range cfg.prefills {
		if err = startWorker("prefill", i, cfg.prefills, i); err != nil {
			break
		}
	}
	if err == nil {
		o.awaitReady(ctx, readyMsgs, cfg.prefills)
		nc.Close()
		if ctx.Err() != nil {
			o.stopAll(signalOf(ctx))
			return nil
		}
		for i := range cfg.decodes {
			n := share(cfg.requests, i, cfg.decodes)
			if err = startWorker("decode", i, cfg.decodes, cfg.prefills+i, "-requests="+strconv.Itoa(n)); err != nil {
				break
			}
		}
	}
	if err != nil {
		o.stopAll(syscall.SIGTERM)
		return err
	}
	o.mu.Lock()
	var started []string
	for _, w := range o.workers {
		started = append(started, fmt.Sprintf("%s (pid %d)", w.who(), w.pid()))
	}
	o.mu.Unlock()
	fmt.Fprintf(o.out, "started %s\n", andList(started))

	// The run ends when every decode worker has sent its requests. The
	// prefill workers serve until told to stop; one that ends first leaves
	// its requests to the others (a request it held is retried, and the
	// queue group hands it to another), but with none left the decode
	// workers cannot finish.
	var errs []error
	early := map[*child]bool{} // prefill workers that ended before they were told to stop
	for left := len(decodes); left > 0; {
		select {
		case w := <-o.exited:
			if w.role == "decode" {
				left--
				if w.err != nil {
					errs = append(errs, fmt.Errorf("%s failed: %w", w.who(), w.err))
				}
				continue
			}
			early[w] = true
			live := len(prefills) - len(early)
			switch {
			case len(prefills) == 1:
				errs = append(errs, fmt.Errorf("the prefill worker ended before the decode %s finished: %v", plural(len(decodes), "worker"), exitString(w.err)))
				left = 0
			case live == 0:
				errs = append(errs, fmt.Errorf("every prefill worker ended before the decode %s finished; the last, %s: %v", plural(len(decodes), "worker"), w.name, exitString(w.err)))
				left = 0
			default:
				fmt.Fprintf(o.out, "%s ended early (%v); the other %d prefill %s take its requests\n", w.name, exitString(w.err), live, plural(live, "worker"))
			}
		case <-ctx.Done():
			// Pass the signal on: the workers run in process groups of
			// their own, so a Ctrl-C in the terminal reaches only this
			// process.
			o.stopAll(signalOf(ctx))
			return nil
		}
	}
	elapsed := time.Since(start)
	// The decode workers have all exited, unless every prefill worker
	// ended first.
	for _, w := range decodes {
		w.stop(syscall.SIGTERM)
		<-w.done
	}
	for _, w := range prefills {
		select {
		case <-w.done: // it ended before its exit reached the loop above
			early[w] = true
		default:
			w.stop(syscall.SIGTERM)
		}
	}
	for _, w := range prefills {
		<-w.done
		if !early[w] && w.err != nil {
			errs = append(errs, fmt.Errorf("%s failed while stopping: %w", w.who(), w.err))
		}
	}
	o.mu.Lock()
	workers := slices.Clone(o.workers)
	o.mu.Unlock()
	printReport(o.out, workers, reports)
	if err := errors.Join(errs...); err != nil {
		return err
	}
	fmt.Fprintf(o.out, "done in %v: every request completed and every byte verified\n", elapsed.Round(time.Millisecond))
	return nil
}

// awaitReady waits until n prefill workers have said they are ready on
// msgs, or -wait has passed, or one of them has exited. The decode workers
// start either way: they wait for a prefill worker themselves, and say so
// if none comes.
func (o *orchestrator) awaitReady(ctx context.Context, msgs <-chan *nats.Msg, n int) {
	timeout := time.NewTimer(o.cfg.wait)
	defer timeout.Stop()
	ours := map[string]bool{}
	for i := range n {
		ours[workerName("prefill", i, n)] = true
	}
	// A prefill worker of someone else's on the same NATS server may speak
	// too: only ours count.
	ready := map[string]bool{}
	for len(ready) < n {
		select {
		case m := <-msgs:
			var h helloReply
			if json.Unmarshal(m.Data, &h) == nil && ours[h.Worker] {
				ready[h.Worker] = true
			}
		case w := <-o.exited:
			o.exited <- w // for run, which looks at every exit; there is room
			return
		case <-timeout.C:
			fmt.Fprintf(o.out, "%d of %d prefill workers said they were ready within %v (-wait); starting the decode workers anyway\n", len(ready), n, o.cfg.wait)
			return
		case <-ctx.Done():
			return
		}
	}
}

// stopAll asks every worker to stop with sig and waits until they have.
func (o *orchestrator) stopAll(sig os.Signal) {
	o.mu.Lock()
	workers := slices.Clone(o.workers)
	o.mu.Unlock()
	for _, w := range workers {
		w.stop(sig)
	}
	for _, w := range workers {
		<-w.done
	}
}

// plural returns word, with an s unless n is 1.
func plural(n int, word string) string {
	if n == 1 {
		return word
	}
	return word + "s"
}

// andList joins items as a sentence does: "a", "a and b", "a, b and c".
func andList(items []string) string {
	if len(items) <= 1 {
		return strings.Join(items, "")
	}
	return strings.Join(items[:len(items)-1], ", ") + " and " + items[len(items)-1]
}

// start runs this program as a worker in role, named name, its output
// prefixed with the name.
func (o *orchestrator) start(exe, role, name, url string, args []string) (*child, error) {
	cmd := exec.Command(exe, append([]string{"-role", role, "-nats", url}, args...)...)
	cmd.Env = append(os.Environ(), o.cfg.device.env()...)
	cmd.Stdout = &prefixWriter{prefix: "[" + name + "] ", w: o.out}
	cmd.Stderr = &prefixWriter{prefix: "[" + name + "] ", w: o.errOut}
	cmd.SysProcAttr = workerProcAttr()
	cmd.WaitDelay = time.Second // for the output pipes, once the worker has exited
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the %s worker %s: %w", role, name, err)
	}
	w := &child{role: role, name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		w.err = cmd.Wait()
		cmd.Stdout.(*prefixWriter).Flush()
		cmd.Stderr.(*prefixWriter).Flush()
		close(w.done)
		o.exited <- w
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
	name string
	cmd  *exec.Cmd
	done chan struct{} // closed once it has exited and its output is flushed
	err  error         // how it exited; read after done
	once sync.Once
}

func (w *child) pid() int { return w.cmd.Process.Pid }

// who names the worker in a sentence: "the prefill worker" when it is the
// only one of its role, else its name.
func (w *child) who() string {
	if w.name == w.role {
		return "the " + w.role + " worker"
	}
	return w.name
}

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
