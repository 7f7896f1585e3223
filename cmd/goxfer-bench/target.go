package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/connect"
	gxnats "github.com/goxfer/goxfer/transport/nats"
)

// passive is what ReadableOperation and WritableOperation share.
type passive interface {
	Metadata() connect.Metadata
	Wait(ctx context.Context) error
	Close() error
}

// target exposes memory for the initiator, hands out tokens, serves the raw
// baselines, and reports when its passive operations complete.
type target struct {
	cfg  *config
	nc   *nats.Conn
	name string
	conn *connect.Connector
	// insts: the connector's backends by name, for their allocators
	insts map[string]agent.Backend
	meter meter // the connector's staging copies

	raw, ping net.Listener
	rawBuf    atomic.Pointer[[]byte] // what the raw TCP server sends from and reads into

	tok      *gxnats.Service
	tokBuf   []byte
	tokWG    sync.WaitGroup
	tokCtx   context.Context
	tokClose context.CancelFunc

	mu     sync.Mutex
	rounds map[uint64]*round
	subs   []*nats.Subscription
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup // raw servers

	quit     chan struct{}
	quitOnce sync.Once
}

type round struct {
	req   roundReq
	slots []*region
	stage stageStats // the meter when the round was prepared
	ops   []passive
	pages [][]byte
	done  []int64

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	failed   atomic.Int32
	verified atomic.Int64
	mu       sync.Mutex
	errs     []string
}

func (r *round) fail(i int, err error) {
	r.failed.Add(1)
	r.mu.Lock()
	if len(r.errs) < 5 {
		r.errs = append(r.errs, fmt.Sprintf("operation %d: %v", i, err))
	}
	r.mu.Unlock()
}

// startTarget serves the target role on nc under name until Close.
func startTarget(cfg *config, nc *nats.Conn, name string) (_ *target, err error) {
	t := &target{cfg: cfg, nc: nc, name: name, rounds: map[uint64]*round{}, conns: map[net.Conn]struct{}{}, quit: make(chan struct{})}
	defer func() {
		if err != nil {
			t.Close()
		}
	}()
	quiet := slog.New(slog.DiscardHandler)
	bcfg := *cfg
	if name != "proc" {
		bcfg.listen = anyPort(cfg.listen)
	}
	bs := agentBackends(&bcfg)
	t.insts = map[string]agent.Backend{}
	for _, b := range bs {
		t.insts[b.Name()] = b
	}
	opts := append([]connect.Option{connect.WithBackends(bs...), connect.WithLogger(quiet)}, deviceOptions(cfg, &t.meter)...)
	t.conn, err = connect.NewConnector(opts...)
	if err != nil {
		return nil, err
	}
	host, _, err := net.SplitHostPort(cfg.listen)
	if err != nil {
		return nil, fmt.Errorf("-listen %q: %w", cfg.listen, err)
	}
	if t.raw, err = net.Listen("tcp", net.JoinHostPort(host, "0")); err != nil {
		return nil, err
	}
	if t.ping, err = net.Listen("tcp", net.JoinHostPort(host, "0")); err != nil {
		return nil, err
	}
	t.wg.Add(2)
	go t.serve(t.raw, t.serveRaw)
	go t.serve(t.ping, t.servePing)

	t.tokBuf = make([]byte, 4096)
	fill(t.tokBuf, 1)
	t.tokCtx, t.tokClose = context.WithCancel(context.Background())
	t.tok, err = gxnats.Serve(nc, subject(cfg.session, name, "token1"), t.serveToken, gxnats.WithLogger(quiet))
	if err != nil {
		return nil, err
	}
	handlers := map[string]nats.MsgHandler{
		"hello":  t.onHello,
		"round":  t.onRound,
		"tokens": t.onTokens,
		"finish": t.onFinish,
		"quit":   t.onQuit,
	}
	for verb, h := range handlers {
		sub, err := nc.Subscribe(subject(cfg.session, name, verb), h)
		if err != nil {
			return nil, err
		}
		t.subs = append(t.subs, sub)
	}
	if err := nc.Flush(); err != nil {
		return nil, err
	}
	return t, nil
}

// Done is closed when the initiator asked the target to quit.
func (t *target) Done() <-chan struct{} { return t.quit }

// Close stops serving and releases everything.
func (t *target) Close() {
	for _, s := range t.subs {
		_ = s.Unsubscribe()
	}
	if t.tok != nil {
		_ = t.tok.Close()
	}
	if t.tokClose != nil {
		t.tokClose()
	}
	t.tokWG.Wait()
	for _, ln := range []net.Listener{t.raw, t.ping} {
		if ln != nil {
			_ = ln.Close()
		}
	}
	t.mu.Lock()
	for c := range t.conns {
		_ = c.Close()
	}
	rounds := t.rounds
	t.rounds = map[uint64]*round{}
	t.mu.Unlock()
	t.wg.Wait()
	for _, r := range rounds {
		r.end()
	}
	if t.conn != nil {
		_ = t.conn.Close()
	}
}

func (t *target) onHello(msg *nats.Msg) {
	var req helloReq
	_ = json.Unmarshal(msg.Data, &req) // an empty request asks nothing about GPUs
	host, _ := os.Hostname()
	h := hello{
		PID: os.Getpid(), BootID: bootID(), Host: host, Backends: t.conn.AgentInfo().Backends(),
		Raw: t.raw.Addr().String(), Ping: t.ping.Addr().String(), GOMAXPROCS: runtime.GOMAXPROCS(0),
		MemAvail: memAvailable(), Token1: t.tok.Subject(), TCPSpin: t.cfg.tcpSpin,
	}
	if req.Device {
		if d, err := gpuDriver(req.GPU); err != nil {
			h.DeviceErr = err.Error()
		} else {
			h.Device = d.Name()
		}
	}
	respond(msg, h)
}

func (t *target) onQuit(msg *nats.Msg) {
	respond(msg, struct{}{})
	t.quitOnce.Do(func() { close(t.quit) })
}

func (t *target) onRound(msg *nats.Msg) {
	var req roundReq
	if err := json.Unmarshal(msg.Data, &req); err != nil {
		respond(msg, roundReady{Err: err.Error()})
		return
	}
	ready, err := t.prepare(req)
	if err != nil {
		ready.Err = err.Error()
	}
	respond(msg, ready)
}

// prepare allocates a round's slots, fills them, and creates its passive
// operations with a waiter each.
func (t *target) prepare(req roundReq) (roundReady, error) {
	if req.Block < 1 || req.Descs < 1 || req.Slots < 1 || req.Ops < 0 {
		return roundReady{}, fmt.Errorf("bad round: %d × %d bytes, %d slots, %d operations", req.Descs, req.Block, req.Slots, req.Ops)
	}
	if err := checkMemory(req.Block, req.Descs, req.Slots, 1, memAvailable()); err != nil {
		return roundReady{}, err
	}
	r := &round{req: req, slots: make([]*region, req.Slots), done: make([]int64, req.Ops), stage: t.meter.read()}
	r.ctx, r.cancel = context.WithCancel(context.Background())
	ready, err := t.build(r)
	if err != nil {
		r.end()
		return roundReady{}, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.rounds[req.ID] != nil {
		r.end()
		return roundReady{}, fmt.Errorf("round %d exists", req.ID)
	}
	t.rounds[req.ID] = r
	if req.RawBuf {
		t.rawBuf.Store(&r.slots[0].host)
	}
	return ready, nil
}

func (t *target) build(r *round) (roundReady, error) {
	req := r.req
	size := req.Block * req.Descs
	addrs := make([]uint64, req.Slots)
	var alloc func(int) ([]byte, func() error, error)
	if req.Alloc != "" {
		def, ok := allocDef(req.Alloc)
		if !ok || t.insts[req.Alloc] == nil {
			return roundReady{}, fmt.Errorf("no allocator for backend %q here", req.Alloc)
		}
		alloc = func(n int) ([]byte, func() error, error) { return def.alloc(t.insts[req.Alloc], n) }
	}
	var drv devmem.Driver
	if req.Mem == memVRAM {
		if req.RawBuf || req.Alloc != "" {
			return roundReady{}, errors.New("a round in GPU memory serves no raw baseline and uses no backend's allocator")
		}
		var err error
		if drv, err = gpuDriver(req.GPU); err != nil {
			return roundReady{}, err
		}
	}
	for s := range r.slots {
		slot, err := newRegion(req.Mem, drv, req.GPU, size, alloc)
		if err != nil {
			return roundReady{}, err
		}
		r.slots[s] = slot
		if req.Op == dirRead {
			err = slot.fill(readSeed(req.ID, s))
		} else {
			err = slot.poison() // fault the pages in: WRITE should not pay for that
		}
		if err != nil {
			return roundReady{}, fmt.Errorf("prepare slot %d: %w", s, err)
		}
		addrs[s] = slot.addr()
	}
	descs := make([][]connect.Descriptor, req.Slots)
	for s := range descs {
		descs[s] = r.slots[s].descriptors(req.Block, req.Descs)
	}
	mds := make([]connect.Metadata, req.Ops)
	start := time.Now()
	for i := range req.Ops {
		var op passive
		var err error
		if req.Op == dirRead {
			op, err = t.conn.CreateReadable(r.ctx, descs[i%req.Slots]...)
		} else {
			op, err = t.conn.CreateWritable(r.ctx, descs[i%req.Slots]...)
		}
		if err != nil {
			return roundReady{}, fmt.Errorf("create operation %d: %w", i, err)
		}
		mds[i] = op.Metadata()
		r.ops = append(r.ops, op)
	}
	created := time.Since(start)
	// One waiter per operation records when its passive Wait returns: the
	// moment the target's application would learn of the completion.
	ackSubj := subject(t.cfg.session, t.name, fmt.Sprintf("ack.%d", req.ID))
	for i, op := range r.ops {
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			err := op.Wait(r.ctx)
			now := monoNow()
			if err != nil {
				if r.ctx.Err() == nil {
					r.fail(i, err)
				}
				return
			}
			r.done[i] = now
			if req.Check && req.Op == dirWrite {
				a := ack{I: i}
				slot := r.slots[i%req.Slots]
				if err := slot.verify(writeSeed(req.ID, i)); err != nil {
					r.fail(i, fmt.Errorf("check: %w", err))
					a.Err = err.Error()
				} else {
					r.verified.Add(int64(slot.size))
				}
				b, _ := json.Marshal(a)
				_ = t.nc.Publish(ackSubj, b)
			}
		}()
	}
	pages, err := encodeTokens(mds, int(t.nc.MaxPayload())-4096)
	if err != nil {
		return roundReady{}, err
	}
	r.pages = pages
	ready := roundReady{Tokens: len(mds), Pages: len(pages), Slots: addrs, CreateNs: created.Nanoseconds(), Mem: req.Mem}
	if len(mds) > 0 {
		b, _ := mds[0].MarshalBinary()
		ready.TokenLen = len(b)
	}
	return ready, nil
}

func (t *target) onTokens(msg *nats.Msg) {
	var req struct {
		ID   uint64 `json:"id"`
		Page int    `json:"page"`
	}
	_ = json.Unmarshal(msg.Data, &req)
	t.mu.Lock()
	r := t.rounds[req.ID]
	t.mu.Unlock()
	if r == nil || req.Page < 0 || req.Page >= len(r.pages) {
		_ = msg.Respond(nil)
		return
	}
	_ = msg.Respond(r.pages[req.Page])
}

func (t *target) onFinish(msg *nats.Msg) {
	var req finishReq
	_ = json.Unmarshal(msg.Data, &req)
	t.mu.Lock()
	r := t.rounds[req.ID]
	delete(t.rounds, req.ID)
	t.mu.Unlock()
	if r == nil {
		respond(msg, roundResult{Err: fmt.Sprintf("no round %d", req.ID)})
		return
	}
	// Every passive operation whose active peer finished has its
	// completion on the way; give them a bounded time to arrive.
	waited := make(chan struct{})
	go func() { r.wg.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(time.Duration(r.req.WaitMsec) * time.Millisecond):
	}
	if r.req.RawBuf {
		t.rawBuf.CompareAndSwap(&r.slots[0].host, nil)
	}
	r.end()
	res := roundResult{Done: r.done, Failed: int(r.failed.Load()), Errors: r.errs, Verified: r.verified.Load(), Stage: t.meter.read().sub(r.stage)}
	respond(msg, res)
}

// end stops the round's waiters and closes its operations: afterwards no
// peer can touch its slots.
func (r *round) end() {
	r.cancel()
	r.wg.Wait()
	for _, op := range r.ops {
		_ = op.Close()
	}
	r.ops = nil
	for _, slot := range r.slots { // no operation can touch the slots any more
		if slot != nil {
			_ = slot.release()
		}
	}
}

// tokenUnused is the payload of a token request whose token will not be
// used (the nats-token row): the target closes that operation at once
// instead of waiting for a peer that never comes.
const tokenUnused = "unused"

// serveToken is the per-operation token service measured by the control
// rows: each request exposes a 4 KiB buffer and answers with its token, as
// a prefill worker would. The operation stays open until its peer
// completes (at most 30 s), or is closed once answered when the request
// says its token goes unused (tokenUnused): otherwise every request of the
// nats-token row would leave an exposure open for 30 s, under the rows
// measured after it.
func (t *target) serveToken(ctx context.Context, req *gxnats.ServiceRequest) (*gxnats.Reply, error) {
	op, err := t.conn.CreateReadable(ctx, connect.NewDescriptor(t.tokBuf))
	if err != nil {
		return nil, err
	}
	md := op.Metadata() // before the operation may close
	unused := string(req.Data) == tokenUnused
	t.tokWG.Add(1)
	go func() {
		defer t.tokWG.Done()
		if !unused {
			wctx, cancel := context.WithTimeout(t.tokCtx, 30*time.Second)
			_ = op.Wait(wctx)
			cancel()
		}
		_ = op.Close()
	}()
	return &gxnats.Reply{Metadata: md}, nil
}

func (t *target) serve(ln net.Listener, h func(net.Conn)) {
	defer t.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		t.mu.Lock()
		t.conns[c] = struct{}{}
		t.mu.Unlock()
		t.wg.Add(1)
		go func() {
			defer t.wg.Done()
			h(c)
			t.mu.Lock()
			delete(t.conns, c)
			t.mu.Unlock()
			_ = c.Close()
		}()
	}
}

// serveRaw answers requests of 17 bytes (direction, offset, length): 'r'
// sends length bytes of the current raw buffer from offset, 'w' reads
// length bytes into it and answers one byte.
func (t *target) serveRaw(c net.Conn) {
	var req [17]byte
	for {
		if _, err := io.ReadFull(c, req[:]); err != nil {
			return
		}
		off, n := binary.LittleEndian.Uint64(req[1:]), binary.LittleEndian.Uint64(req[9:])
		p := t.rawBuf.Load()
		if p == nil || off+n > uint64(len(*p)) || off+n < off {
			return // the initiator sees the connection close
		}
		buf := (*p)[off : off+n]
		var err error
		if req[0] == 'r' {
			_, err = c.Write(buf)
		} else if _, err = io.ReadFull(c, buf); err == nil {
			_, err = c.Write(req[:1])
		}
		if err != nil {
			return
		}
	}
}

func (t *target) servePing(c net.Conn) {
	buf := make([]byte, 4096)
	for {
		if _, err := io.ReadFull(c, buf); err != nil {
			return
		}
		if _, err := c.Write(buf); err != nil {
			return
		}
	}
}

// descriptors cuts buf into n descriptors of block bytes.
func descriptors(buf []byte, block, n int) []connect.Descriptor {
	ds := make([]connect.Descriptor, n)
	for i := range ds {
		ds[i] = connect.NewDescriptor(buf[i*block : (i+1)*block])
	}
	return ds
}

// runTarget is the target role of a process: it serves until the initiator
// says quit, ctx ends, or (for a spawned child) its standard input closes.
func runTarget(ctx context.Context, cfg *config, stderr io.Writer) error {
	if cfg.natsURL == "" {
		return errors.New("-role target needs -nats URL (the initiator's server)")
	}
	nc, err := nats.Connect(cfg.natsURL, nats.Name("goxfer-bench target"), nats.Timeout(cfg.timeout))
	if err != nil {
		return fmt.Errorf("connect to NATS at %s: %w", cfg.natsURL, err)
	}
	defer nc.Close()
	t, err := startTarget(cfg, nc, "proc")
	if err != nil {
		return err
	}
	defer t.Close()
	stdinClosed := make(chan struct{})
	if os.Getenv(childEnv) == "1" {
		go func() { _, _ = io.Copy(io.Discard, os.Stdin); close(stdinClosed) }()
	} else {
		fmt.Fprintf(stderr, "goxfer-bench: target ready (session %q, pid %d); waiting for the initiator on %s\n", cfg.session, os.Getpid(), cfg.natsURL)
	}
	closed := make(chan struct{})
	nc.SetClosedHandler(func(*nats.Conn) { close(closed) })
	select {
	case <-t.Done():
	case <-ctx.Done():
	case <-stdinClosed:
	case <-closed:
		return errors.New("NATS connection closed")
	}
	return nil
}
