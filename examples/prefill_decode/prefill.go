package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/connect"
	gxnats "github.com/goxfer/goxfer/transport/nats"
)

// exposeTimeout bounds how long the prefill worker keeps a prompt's blocks
// exposed for a decode worker that never reads them (it crashed, or its
// reply was lost and it asked again): then it closes the operation and
// takes the blocks back.
const exposeTimeout = 30 * time.Second

// prefillWorker serves KV caches: READ requests on subjectRead, WRITE offers
// on subjectOffer, and "which model?" on subjectHello.
type prefillWorker struct {
	cfg  config
	out  io.Writer
	nc   *nats.Conn
	conn *connect.Connector
	pool *Pool

	wg sync.WaitGroup // exposures awaiting their reader, and offers being written

	mu        sync.Mutex
	exposures map[string]*exposure // by request ID: the latest attempt only
	arrivals  uint64               // orders the attempts of a request

	corrupted atomic.Bool // the x-corrupt-block test hook has fired
	served    atomic.Int64
	failed    atomic.Int64
	moved     atomic.Int64 // bytes of KV cache in the hand-offs served

	spanMu      sync.Mutex
	first, last time.Time // the first request taken, the last hand-off done
}

// exposure is a prompt's KV cache, exposed for reading.
type exposure struct {
	arrival uint64
	op      *connect.ReadableOperation
}

func runPrefill(ctx context.Context, cfg config, drv devmem.Driver, out io.Writer) (err error) {
	l, _ := cfg.model.LayoutFor(cfg.promptTokens)
	// Room for the prompts being prefilled and those exposed, awaiting
	// their reader.
	pool, err := newKVPool(cfg, drv, 2*cfg.concurrency*l.Blocks())
	if err != nil {
		return err
	}
	// Freed last, once the Connector is closed: no peer can reach it then.
	defer func() { err = errors.Join(err, pool.Close()) }()
	p := &prefillWorker{cfg: cfg, out: out, pool: pool, exposures: make(map[string]*exposure)}
	ep, err := openEndpoint(ctx, cfg, drv, out)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, ep.Close()) }()
	nc, conn := ep.nc, ep.conn
	p.nc, p.conn = nc, conn

	me, _ := json.Marshal(helloReply{Agent: conn.AgentInfo().ID().String(), Worker: cfg.name, Model: cfg.model})
	hello, err := nc.QueueSubscribe(subjectHello, queuePrefill, func(m *nats.Msg) { _ = m.Respond(me) })
	if err != nil {
		return fmt.Errorf("subscribe to %s: %w", subjectHello, err)
	}
	defer func() { _ = hello.Unsubscribe() }()

	svc, err := gxnats.Serve(nc, subjectRead, p.serveRead, gxnats.WithQueue(queuePrefill), gxnats.WithConcurrency(2*cfg.concurrency))
	if err != nil {
		return err
	}
	offers, err := gxnats.Subscribe(nc, subjectOffer, gxnats.WithQueue(queuePrefill))
	if err != nil {
		_ = svc.Close()
		return err
	}
	p.wg.Add(1)
	go p.takeOffers(ctx, offers)

	fmt.Fprintf(out, "agent %s ready: READ requests on %q, WRITE offers on %q, KV pool of %d blocks (%s) in %s\n",
		conn.AgentInfo().ID(), subjectRead, subjectOffer, p.pool.Cap(), sizeString(int64(p.pool.Cap())*int64(cfg.model.BlockBytes())), cfg.device.describe())
	// For an orchestrator waiting to start its decode workers; nobody may
	// listen, and a message lost only makes it wait -wait.
	_ = nc.Publish(subjectReady, me)

	<-ctx.Done()
	// Stop taking work, revoke the exposures nobody has read yet, and wait
	// for the work in hand to end (writes in progress see ctx done).
	err = errors.Join(svc.Close(), offers.Close())
	p.closeExposures()
	p.wg.Wait()
	r := p.report()
	fmt.Fprintf(out, "stopped: %d hand-offs served, %d failed; %s of KV cache, %s, %s from the first request taken to the last hand-off done (%v)\n",
		r.Requests, r.Failed, sizeString(r.Bytes), reqRate(r.Requests, r.End.Sub(r.Start)), rate(r.Bytes, r.End.Sub(r.Start)), ms(r.End.Sub(r.Start)))
	return errors.Join(err, r.write(cfg.report))
}

// report returns the worker's figures.
func (p *prefillWorker) report() workerReport {
	p.spanMu.Lock()
	defer p.spanMu.Unlock()
	return workerReport{
		Name: p.cfg.name, Role: "prefill", Agent: p.conn.AgentInfo().ID().String(),
		Requests: int(p.served.Load()), Failed: int(p.failed.Load()), Bytes: p.moved.Load(),
		Start: p.first, End: p.last,
	}
}

// took notes that a request was taken, at its arrival.
func (p *prefillWorker) took() {
	p.spanMu.Lock()
	defer p.spanMu.Unlock()
	if p.first.IsZero() {
		p.first = time.Now()
	}
}

// handedOff counts a hand-off of l's KV cache served.
func (p *prefillWorker) handedOff(l Layout) {
	p.served.Add(1)
	p.moved.Add(l.Bytes())
	p.spanMu.Lock()
	p.last = time.Now()
	p.spanMu.Unlock()
}

// prefill does the prefill worker's actual work for one request: it takes
// blocks from the pool and computes the prompt's KV cache into them (in
// host memory, then copied into the GPU when the pool is GPU memory).
func (p *prefillWorker) prefill(ctx context.Context, r kvRequest, l Layout) (*Blocks, error) {
	blocks, err := p.pool.Alloc(ctx, l.Blocks())
	if err != nil {
		return nil, err
	}
	var tamper func(i int, b []byte)
	if c := p.cfg.corruptBlock; c >= 0 && c < blocks.Len() && p.corrupted.CompareAndSwap(false, true) {
		tamper = func(i int, b []byte) {
			if i == c {
				b[len(b)/2] ^= 0xff
				fmt.Fprintf(p.out, "test hook: flipped byte %d of %s (descriptor %d) of request %s\n", len(b)/2, l.Locate(i), i, r.ID)
			}
		}
	}
	if err := FillKV(l, r.ID, blocks, tamper); err != nil {
		blocks.Release()
		return nil, err
	}
	if !sleep(ctx, p.cfg.prefillTime) {
		blocks.Release()
		return nil, context.Cause(ctx)
	}
	return blocks, nil
}

// newKVPool allocates a worker's KV pool of n blocks: in host memory, or in
// the memory of the -device GPU when drv is not nil.
func newKVPool(cfg config, drv devmem.Driver, n int) (*Pool, error) {
	if drv == nil {
		return NewPool(n, cfg.model.BlockBytes()), nil
	}
	return NewDevicePool(drv, cfg.device.gpu, n, cfg.model.BlockBytes())
}

// parseRequest decodes a request, which is remote input, and returns its
// layout.
func (p *prefillWorker) parseRequest(data []byte) (kvRequest, Layout, error) {
	var r kvRequest
	if err := json.Unmarshal(data, &r); err != nil {
		return r, Layout{}, fmt.Errorf("want a JSON kvRequest: %w", err)
	}
	if r.ID == "" {
		return r, Layout{}, errors.New("the request has no id")
	}
	l, err := p.cfg.model.LayoutFor(r.PromptTokens)
	if err != nil {
		return r, Layout{}, err
	}
	if l.Blocks() > p.pool.Cap() {
		return r, Layout{}, fmt.Errorf("a prompt of %d tokens needs %d blocks; this worker's KV pool holds %d", r.PromptTokens, l.Blocks(), p.pool.Cap())
	}
	return r, l, nil
}

// serveRead answers a READ request: it prefills the prompt, exposes its
// blocks and replies with the token. A goroutine then waits for the decode
// worker to read them and takes the blocks back.
func (p *prefillWorker) serveRead(ctx context.Context, req *gxnats.ServiceRequest) (*gxnats.Reply, error) {
	r, l, err := p.parseRequest(req.Data)
	if err != nil {
		return nil, &gxnats.HandlerError{Code: "bad-request", Message: err.Error()}
	}
	arrival := p.arrive()
	p.took()
	blocks, err := p.prefill(ctx, r, l)
	if err != nil {
		return nil, fmt.Errorf("request %s: %w", r.ID, err)
	}
	op, err := p.conn.CreateReadable(ctx, blocks.Descriptors()...)
	if err != nil {
		blocks.Release()
		return nil, fmt.Errorf("request %s: expose its blocks: %w", r.ID, err)
	}
	md := op.Metadata()
	full := md.EncodedLen()
	if p.cfg.compact {
		md = md.Compact()
	}
	if max := p.nc.MaxPayload() - 1024; int64(md.EncodedLen()) > max {
		p.release(op, blocks)
		return nil, fmt.Errorf("request %s: the token for %d blocks takes %d bytes, more than NATS carries (max payload %d): use a larger -block-tokens", r.ID, l.Blocks(), md.EncodedLen(), p.nc.MaxPayload())
	}
	if !p.track(r.ID, &exposure{arrival: arrival, op: op}) {
		p.release(op, blocks)
		return nil, &gxnats.HandlerError{Code: "bad-request", Message: fmt.Sprintf("request %s: a later attempt of this request has arrived", r.ID)}
	}
	p.wg.Add(1)
	go p.awaitRead(r, l, op, blocks, md.EncodedLen(), full)
	data, _ := json.Marshal(kvReply{ID: r.ID, Blocks: l.Blocks(), Worker: p.cfg.name})
	return &gxnats.Reply{Metadata: md, Data: data}, nil
}

// arrive numbers the attempts of requests in the order they arrive.
func (p *prefillWorker) arrive() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.arrivals++
	return p.arrivals
}

// track records x as the exposure of request id. A retried request
// replaces its earlier attempt: the decode worker asks again only when it
// never got (or could not use) the earlier token, so nobody will read the
// earlier exposure, which is closed now rather than at its timeout. track
// reports false if x is itself an earlier attempt than the one recorded.
func (p *prefillWorker) track(id string, x *exposure) bool {
	p.mu.Lock()
	prev := p.exposures[id]
	if prev != nil && prev.arrival > x.arrival {
		p.mu.Unlock()
		return false
	}
	p.exposures[id] = x
	p.mu.Unlock()
	if prev != nil {
		fmt.Fprintf(p.out, "request %s: asked again; closing the earlier attempt's exposure\n", id)
		_ = prev.op.Close() // its awaitRead gives the blocks back
	}
	return true
}

// closeExposures closes every exposure still awaiting its reader, whose
// awaitRead then takes its blocks back.
func (p *prefillWorker) closeExposures() {
	p.mu.Lock()
	ops := make([]*connect.ReadableOperation, 0, len(p.exposures))
	for _, x := range p.exposures {
		ops = append(ops, x.op)
	}
	p.mu.Unlock()
	for _, op := range ops {
		_ = op.Close()
	}
}

// awaitRead waits until the decode worker has read request r's blocks (or
// failed, or went away, or exposeTimeout passed), then revokes access and
// takes the blocks back.
func (p *prefillWorker) awaitRead(r kvRequest, l Layout, op *connect.ReadableOperation, blocks *Blocks, tokenSize, fullSize int) {
	defer p.wg.Done()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), exposeTimeout)
	defer cancel()
	err := op.Wait(ctx)
	p.mu.Lock()
	x := p.exposures[r.ID]
	superseded := x != nil && x.op != op
	if x != nil && x.op == op {
		delete(p.exposures, r.ID)
	}
	p.mu.Unlock()
	p.release(op, blocks)
	switch {
	case err != nil && superseded:
		fmt.Fprintf(p.out, "request %s: the earlier attempt's blocks are back in the pool\n", r.ID)
		return
	case err != nil:
		p.failed.Add(1)
		fmt.Fprintf(p.out, "request %s: %d blocks not read, released: %v\n", r.ID, l.Blocks(), err)
		return
	}
	p.handedOff(l)
	fmt.Fprintf(p.out, "request %s: %d blocks (%s) exposed with a %s token (%s full), read by decode in %v, released\n",
		r.ID, l.Blocks(), sizeString(l.Bytes()), sizeString(int64(tokenSize)), sizeString(int64(fullSize)), ms(time.Since(start)))
}

// release revokes access to a prompt's blocks and puts them back in the
// pool: Close returns only once no peer can touch them any more.
func (p *prefillWorker) release(op *connect.ReadableOperation, blocks *Blocks) {
	if err := op.Close(); err != nil {
		fmt.Fprintf(p.out, "close an exposure: %v\n", err)
	}
	blocks.Release()
}

// takeOffers takes WRITE offers one at a time from the subscription and
// writes each on a goroutine of its own, at most cfg.concurrency at once.
func (p *prefillWorker) takeOffers(ctx context.Context, offers *gxnats.Subscription) {
	defer p.wg.Done()
	slots := make(chan struct{}, p.cfg.concurrency)
	for {
		offer, err := offers.Next(ctx)
		switch {
		case ctx.Err() != nil || errors.Is(err, gxnats.ErrClosed) || errors.Is(err, nats.ErrConnectionClosed):
			return
		case err != nil:
			fmt.Fprintf(p.out, "offer: %v\n", err) // a bad message; the next may be fine
			continue
		}
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			return
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer func() { <-slots }()
			if err := p.write(ctx, offer); err != nil {
				p.failed.Add(1)
				fmt.Fprintf(p.out, "offer: %v\n", err)
			}
		}()
	}
}

// write answers a WRITE offer: it prefills the prompt and writes its blocks
// into the decode worker's, whose Wait then returns.
func (p *prefillWorker) write(ctx context.Context, offer *gxnats.Offer) error {
	r, l, err := p.parseRequest(offer.Data)
	if err != nil {
		return err
	}
	md := offer.Metadata
	if md.Kind() != connect.KindWrite {
		return fmt.Errorf("request %s: want a WRITE token, found a %v token", r.ID, md.Kind())
	}
	if md.Len() != l.Blocks() {
		return fmt.Errorf("request %s: want a token for %d blocks, found %d", r.ID, l.Blocks(), md.Len())
	}
	p.took()
	ctx, cancel := context.WithTimeout(ctx, exposeTimeout)
	defer cancel()
	blocks, err := p.prefill(ctx, r, l)
	if err != nil {
		return fmt.Errorf("request %s: %w", r.ID, err)
	}
	defer blocks.Release()
	start := time.Now()
	op, err := p.conn.BeginWrite(ctx, md, blocks.Descriptors()...)
	if err != nil {
		return fmt.Errorf("request %s: %w", r.ID, err)
	}
	if err := op.Wait(ctx); err != nil {
		return fmt.Errorf("request %s: write: %w", r.ID, err)
	}
	d := time.Since(start)
	p.handedOff(l)
	fmt.Fprintf(p.out, "request %s: wrote %d blocks (%s) into decode's in %v, %s via %s, path %s\n",
		r.ID, l.Blocks(), sizeString(l.Bytes()), ms(d), rate(l.Bytes(), d), op.Backend(), op.Path())
	return nil
}

// ms rounds a duration for printing: "12.3ms".
func ms(d time.Duration) time.Duration {
	switch {
	case d >= time.Second:
		return d.Round(time.Millisecond)
	case d >= 10*time.Millisecond:
		return d.Round(100 * time.Microsecond)
	}
	return d.Round(10 * time.Microsecond)
}

// rate formats a throughput in GB/s (10^9 bytes a second).
func rate(n int64, d time.Duration) string {
	if d <= 0 {
		return "- GB/s"
	}
	return fmt.Sprintf("%.2f GB/s", float64(n)/d.Seconds()/1e9)
}
