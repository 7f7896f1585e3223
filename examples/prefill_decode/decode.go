package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/connect"
	gxnats "github.com/goxfer/goxfer/transport/nats"
)

const (
	// maxAttempts bounds the attempts of one hand-off: a transfer that
	// fails, an offer NATS could not take, or a WRITE offer nobody takes
	// is tried again from the start under the same request ID, after a
	// pause that doubles from firstBackoff (so the attempts span a NATS
	// server restart).
	maxAttempts  = 5
	firstBackoff = 100 * time.Millisecond
	// requestRetries bounds the tries of one READ request over NATS
	// (transport/nats WithRetry): it is sent again when nobody serves the
	// subject (yet), when the connection drops, or when no reply comes
	// within -attempt-timeout.
	requestRetries = 5
)

// errBadReply reports a reply the decode worker cannot use; asking again
// would not help.
var errBadReply = errors.New("unusable reply")

// decodeWorker sends the requests and checks what arrives.
type decodeWorker struct {
	cfg    config
	out    io.Writer
	nc     *nats.Conn
	conn   *connect.Connector
	pool   *Pool
	layout Layout
	runID  string // prefix of the request IDs, unique to this run
}

// result is how one hand-off went.
type result struct {
	n        int // 1-based
	id       string
	attempts int
	err      error // the hand-off did not complete
	mismatch error // it completed, but the bytes differ

	tokenSize int
	latency   time.Duration // request sent → every byte in place
	prefill   time.Duration // READ: request sent → token received
	transfer  time.Duration // READ: BeginRead → Wait returned
	backend   string        // READ: the backend that moved the bytes
	path      string        // READ: how it moved them (ReadOperation.Path)
	server    string        // READ: the prefill worker that served it, by name and agent
}

func runDecode(ctx context.Context, cfg config, drv devmem.Driver, out io.Writer) (err error) {
	l, _ := cfg.model.LayoutFor(cfg.promptTokens)
	var id [4]byte
	_, _ = rand.Read(id[:])
	// One prompt's blocks for each request in flight: a request keeps its
	// blocks until it is verified (and "decoded").
	pool, err := newKVPool(cfg, drv, cfg.concurrency*l.Blocks())
	if err != nil {
		return err
	}
	// Freed last, once the Connector is closed: no peer can reach it then.
	defer func() { err = errors.Join(err, pool.Close()) }()
	d := &decodeWorker{cfg: cfg, out: out, layout: l, runID: hex.EncodeToString(id[:]), pool: pool}
	ep, err := openEndpoint(ctx, cfg, drv, out)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, ep.Close()) }()
	d.nc, d.conn = ep.nc, ep.conn

	fmt.Fprintf(out, "agent %s: KV pool of %d blocks (%s) in %s; waiting up to %v for a prefill worker\n",
		d.conn.AgentInfo().ID(), pool.Cap(), sizeString(int64(pool.Cap())*int64(cfg.model.BlockBytes())), cfg.device.describe(), cfg.wait)
	if err := d.awaitPrefill(ctx); err != nil {
		return err
	}
	start := time.Now()
	results := d.runAll(ctx)
	end := time.Now()
	err = d.summarize(results, end.Sub(start))
	r := workerReport{Name: cfg.name, Role: "decode", Agent: d.conn.AgentInfo().ID().String(), Start: start, End: end}
	for _, res := range results {
		switch {
		case res.err != nil:
			r.Failed++
		default:
			r.Requests++
			r.Bytes += l.Bytes()
		}
	}
	return errors.Join(err, r.write(cfg.report))
}

// awaitPrefill asks on subjectHello until a prefill worker answers, and
// checks that it serves the same model.
func (d *decodeWorker) awaitPrefill(ctx context.Context) error {
	wctx, cancel := context.WithTimeout(ctx, d.cfg.wait)
	defer cancel()
	var last error
	for {
		m, err := d.nc.RequestWithContext(wctx, subjectHello, nil)
		if err == nil {
			var h helloReply
			if err := json.Unmarshal(m.Data, &h); err != nil {
				return fmt.Errorf("the prefill worker's answer on %s: want a JSON helloReply: %w", subjectHello, err)
			}
			if h.Model != d.cfg.model {
				return fmt.Errorf("the prefill worker (agent %s) serves the model %v; this decode worker expects %v: give both the same model flags", h.Agent, h.Model, d.cfg.model)
			}
			who := "prefill worker"
			if h.Worker != "" && h.Worker != "prefill" {
				who += " " + h.Worker
			}
			fmt.Fprintf(d.out, "%s (agent %s) is ready; sending %d requests, %s mode, %d in flight\n",
				who, h.Agent, d.cfg.requests, strings.ToUpper(d.cfg.mode), d.cfg.concurrency)
			return nil
		}
		if !errors.Is(err, nats.ErrNoResponders) && wctx.Err() == nil {
			last = err // disconnected, say; it may pass
		}
		if !sleep(wctx, 100*time.Millisecond) {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			msg := fmt.Sprintf("no prefill worker answered on %q within %v (-wait): start one with -role prefill -nats %s, or run without -role to start both", subjectHello, d.cfg.wait, d.cfg.natsURL)
			if last != nil {
				msg += fmt.Sprintf(" (last error: %v)", last)
			}
			return errors.New(msg)
		}
	}
}

// runAll runs the requests, cfg.concurrency at a time, and prints each
// result as it comes. A hand-off that fails stops the run; a mismatch does
// not (the next requests may show whether it is systematic).
func (d *decodeWorker) runAll(ctx context.Context) []result {
	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	jobs := make(chan int)
	results := make(chan result)
	var wg sync.WaitGroup
	for range d.cfg.concurrency {
		wg.Go(func() {
			for n := range jobs {
				results <- d.handoff(ctx, n)
			}
		})
	}
	go func() {
		defer close(jobs)
		for n := 1; n <= d.cfg.requests; n++ {
			select {
			case jobs <- n:
			case <-ctx.Done():
				return
			}
		}
	}()
	go func() {
		wg.Wait()
		close(results)
	}()

	var all []result
	for r := range results {
		if r.err != nil && ctx.Err() != nil {
			continue // cut short by the run's end, not failed by itself
		}
		d.print(r)
		if r.err != nil {
			stop(fmt.Errorf("request %s failed", r.id))
		}
		all = append(all, r)
	}
	return all
}

// handoff gets request n's KV cache into blocks of the decode worker's pool
// and verifies it.
func (d *decodeWorker) handoff(ctx context.Context, n int) result {
	r := result{n: n, id: fmt.Sprintf("%s-%d", d.runID, n)}
	blocks, err := d.pool.Alloc(ctx, d.layout.Blocks())
	if err != nil {
		r.err = err
		return r
	}
	defer blocks.Release()

	start := time.Now()
	backoff := firstBackoff
	for r.attempts = 1; ; r.attempts++ {
		if d.cfg.mode == "read" {
			err = d.read(ctx, &r, blocks)
		} else {
			err = d.write(ctx, &r, blocks)
		}
		if err == nil {
			break
		}
		if ctx.Err() != nil || r.attempts == maxAttempts || permanent(err) {
			r.err = err
			return r
		}
		fmt.Fprintf(d.out, "req %d/%d %s: attempt %d failed, trying again in %v: %v\n", n, d.cfg.requests, r.id, r.attempts, backoff, err)
		if !sleep(ctx, backoff) {
			r.err = err
			return r
		}
		backoff *= 2
	}
	r.latency = time.Since(start)

	// Check every byte: what arrived must be exactly what the prefill
	// worker computed for this request ID. Blocks in GPU memory are copied
	// back to host memory for it.
	var mm *MismatchError
	switch err := VerifyKV(d.layout, r.id, blocks); {
	case errors.As(err, &mm):
		r.mismatch = err
	case err != nil:
		r.err = fmt.Errorf("verify: %w", err)
		return r
	}

	// A real decode worker would now generate tokens, attending to the
	// KV cache in its blocks.
	sleep(ctx, d.cfg.decodeTime)
	return r
}

// sleep pauses for d, or until ctx is done; it reports whether it slept
// the whole time.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// permanent reports errors that another attempt would meet again.
func permanent(err error) bool {
	var he *gxnats.HandlerError
	return errors.Is(err, errBadReply) ||
		(errors.As(err, &he) && he.Code == "bad-request") ||
		errors.Is(err, gxnats.ErrPayloadTooLarge) ||
		errors.Is(err, connect.ErrKindMismatch) ||
		errors.Is(err, connect.ErrSizeMismatch) ||
		errors.Is(err, connect.ErrInvalidMetadata)
}

// read is one attempt of a READ-mode hand-off: ask a prefill worker for the
// prompt's KV cache, then read it into blocks with the token it returns.
func (d *decodeWorker) read(ctx context.Context, r *result, blocks *Blocks) error {
	req, _ := json.Marshal(kvRequest{ID: r.id, PromptTokens: d.layout.PromptTokens})
	start := time.Now()
	rctx, cancel := context.WithTimeout(ctx, requestRetries*d.cfg.attemptTimeout)
	reply, err := gxnats.Request(rctx, d.nc, subjectRead, req,
		gxnats.WithRetry(requestRetries), gxnats.WithAttemptTimeout(d.cfg.attemptTimeout))
	cancel()
	if err != nil {
		return err
	}
	// The reply is remote input: check it before pointing a transfer at
	// our memory.
	var rep kvReply
	if err := json.Unmarshal(reply.Data, &rep); err != nil {
		return fmt.Errorf("%w: want a JSON kvReply: %v", errBadReply, err)
	}
	md := reply.Metadata
	switch {
	case rep.ID != r.id:
		return fmt.Errorf("%w: asked for request %s, the reply is for request %s", errBadReply, r.id, rep.ID)
	case md.Kind() != connect.KindRead:
		return fmt.Errorf("%w: want a READ token, found a %v token", errBadReply, md.Kind())
	case md.Len() != d.layout.Blocks():
		return fmt.Errorf("%w: want a token for %d blocks, found %d", errBadReply, d.layout.Blocks(), md.Len())
	}
	for i, size := range md.Sizes() {
		if size != d.layout.BlockBytes() {
			return fmt.Errorf("%w: block %d (%s): want %d bytes, the token says %d", errBadReply, i, d.layout.Locate(i), d.layout.BlockBytes(), size)
		}
	}
	r.prefill, r.tokenSize = time.Since(start), md.EncodedLen()
	r.server = workerLabel(rep.Worker, md.Agent().String())

	start = time.Now()
	xctx, cancel := context.WithTimeout(ctx, exposeTimeout)
	defer cancel()
	op, err := d.conn.BeginRead(xctx, md, blocks.Descriptors()...)
	if err != nil {
		return err
	}
	if err := op.Wait(xctx); err != nil {
		return err
	}
	r.transfer, r.backend, r.path = time.Since(start), op.Backend(), op.Path()
	return nil
}

// write is one attempt of a WRITE-mode hand-off: expose blocks for writing,
// offer the token to the prefill workers, and wait until one has written
// the prompt's KV cache into them.
func (d *decodeWorker) write(ctx context.Context, r *result, blocks *Blocks) error {
	op, err := d.conn.CreateWritable(ctx, blocks.Descriptors()...)
	if err != nil {
		return err
	}
	// Close revokes the token: a prefill worker that took the offer late
	// fails to write, and the blocks can be offered again.
	defer op.Close()
	md := op.Metadata()
	if d.cfg.compact {
		md = md.Compact()
	}
	r.tokenSize = md.EncodedLen()
	req, _ := json.Marshal(kvRequest{ID: r.id, PromptTokens: d.layout.PromptTokens})
	if err := gxnats.Publish(ctx, d.nc, subjectOffer, md, req); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, d.cfg.attemptTimeout)
	defer cancel()
	err = op.Wait(wctx)
	if err != nil && wctx.Err() != nil && ctx.Err() == nil {
		// NATS delivers an offer at most once: it may have been lost.
		return fmt.Errorf("no prefill worker wrote the KV cache within %v of the offer (-attempt-timeout)", d.cfg.attemptTimeout)
	}
	return err
}

// print shows one result on a line.
func (d *decodeWorker) print(r result) {
	var b strings.Builder
	fmt.Fprintf(&b, "req %*d/%d  %s  %s in %d blocks  token %s", digits(d.cfg.requests), r.n, d.cfg.requests, r.id,
		sizeString(d.layout.Bytes()), d.layout.Blocks(), sizeString(int64(r.tokenSize)))
	if r.err == nil {
		if d.cfg.mode == "read" {
			fmt.Fprintf(&b, "  latency %v (prefill %v + read %v at %s)  backend=%s path=%s",
				ms(r.latency), ms(r.prefill), ms(r.transfer), rate(d.layout.Bytes(), r.transfer), r.backend, r.path)
		} else {
			fmt.Fprintf(&b, "  latency %v (offer → written, %s)", ms(r.latency), rate(d.layout.Bytes(), r.latency))
		}
	}
	if r.attempts > 1 {
		fmt.Fprintf(&b, "  attempts=%d", r.attempts)
	}
	switch {
	case r.err != nil:
		fmt.Fprintf(&b, "  FAILED: %v", r.err)
	case r.mismatch != nil:
		fmt.Fprintf(&b, "  MISMATCH: %v", r.mismatch)
	default:
		b.WriteString("  verified")
	}
	fmt.Fprintln(d.out, b.String())
}

// summarize prints the run's figures and returns an error unless every
// request completed with every byte right.
func (d *decodeWorker) summarize(rs []result, elapsed time.Duration) error {
	var ok, mismatched, failed, retried int
	var latencies, transfers []time.Duration
	type via struct{ backend, path string }
	backends := map[via]int{}
	servers := map[string]int{} // READ: requests completed, by the prefill worker that served them; shown if several did
	for _, r := range rs {
		if r.attempts > 1 {
			retried++
		}
		switch {
		case r.err != nil:
			failed++
			continue
		case r.mismatch != nil:
			mismatched++
		default:
			ok++
		}
		latencies = append(latencies, r.latency)
		if r.server != "" {
			servers[r.server]++
		}
		if r.backend != "" {
			transfers = append(transfers, r.transfer)
			backends[via{r.backend, r.path}]++
		}
	}
	total := d.cfg.requests
	moved := int64(len(latencies)) * d.layout.Bytes()
	fmt.Fprintf(d.out, "summary: %d of %d requests verified, %d mismatched, %d failed, %d not run, %d retried\n",
		ok, total, mismatched, failed, total-len(rs), retried)
	if len(latencies) > 0 {
		fmt.Fprintf(d.out, "  KV cache moved: %s in %d blocks, %s and %s overall (%v for all requests)\n",
			sizeString(moved), len(latencies)*d.layout.Blocks(), rate(moved, elapsed), reqRate(len(latencies), elapsed), ms(elapsed))
		fmt.Fprintf(d.out, "  latency, request sent → KV cache in place: p50 %v  p99 %v  max %v\n",
			ms(percentile(latencies, 50)), ms(percentile(latencies, 99)), ms(slices.Max(latencies)))
	}
	if len(transfers) > 0 {
		var names []string
		for v, n := range backends {
			names = append(names, fmt.Sprintf("%s ×%d (path %s)", v.backend, n, v.path))
		}
		slices.Sort(names)
		fmt.Fprintf(d.out, "  transfer, BeginRead → Wait: p50 %v (%s)  p99 %v  backend %s\n",
			ms(percentile(transfers, 50)), rate(d.layout.Bytes(), percentile(transfers, 50)), ms(percentile(transfers, 99)), strings.Join(names, ", "))
	}
	if len(servers) > 1 {
		var names []string
		for s, n := range servers {
			names = append(names, fmt.Sprintf("%s ×%d", s, n))
		}
		slices.Sort(names)
		fmt.Fprintf(d.out, "  served by: %s\n", strings.Join(names, ", "))
	}
	if d.pool.OnDevice() {
		fmt.Fprintf(d.out, "  KV blocks: %s on both sides; every block copied back to host memory and checked\n", d.cfg.device.describe())
	}
	switch {
	case failed > 0:
		return fmt.Errorf("%d of %d requests failed (see above)", failed, total)
	case mismatched > 0:
		return fmt.Errorf("%d of %d requests arrived with bytes that differ from what prefill computed (see MISMATCH above)", mismatched, total)
	case ok < total:
		return fmt.Errorf("only %d of %d requests completed", ok, total)
	}
	return nil
}

// percentile returns the p-th percentile of ds (nearest rank).
func percentile(ds []time.Duration, p float64) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(math.Ceil(p/100*float64(len(s)))) - 1
	return s[max(i, 0)]
}

// workerLabel names a prefill worker in the summary: its name, if it has
// one other than its role, and the start of its agent ID, which tells apart
// workers on several hosts with the same name.
func workerLabel(name, agent string) string {
	short := agent[:min(len(agent), 8)]
	if name == "" || name == "prefill" {
		return "agent " + short
	}
	return name + " (" + short + ")"
}

// digits returns how many decimal digits n has, to align columns.
func digits(n int) int { return len(fmt.Sprint(n)) }
