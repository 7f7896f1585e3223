package backendtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/internal/testproc"
)

// A child process runs one agent and obeys commands, one JSON request per
// line on stdin, answering each with one JSON response line on stdout:
//
//	info                              -> info: the child agent's Info
//	add-peer   info                   -> remember info for later posts
//	expose     access sizes seed dev  -> id key regions: buffers filled with pattern seed, registered, exposed
//	verify     id seed                -> whether exposure id's buffers hold pattern seed, guards intact
//	revoke     id                     -> Revoke
//	forget     id                     -> Revoke, and free exposure id's memory
//	wait-event id                     -> event: the exposure's next event
//	wait-access id                    -> once a peer has accessed the exposure
//	post       op peer key regions seed notify async dev
//	                                  -> a transfer from fresh local buffers (WRITE: filled with pattern
//	                                     seed; READ: checked against it when done); async answers once posted
//	stats                             -> stats: the agent's Stats
//	exit                              -> closes the agent and exits
//
// dev, when given, says which descriptors of the child's memory (the
// exposed buffers, or a transfer's local ones) live in device memory of
// the process's driver (devmem.Default: the simulator, in a child that
// startDevChild started). A failed command answers err (and is: the agent
// sentinels it matches).
// When stdin closes the child closes its agent and exits.
type request struct {
	Cmd     string         `json:"cmd"`
	ID      int            `json:"id,omitempty"`
	Access  agent.Access   `json:"access,omitempty"`
	Op      agent.Op       `json:"op,omitempty"`
	Sizes   []int          `json:"sizes,omitempty"`
	Seed    uint64         `json:"seed,omitempty"`
	Info    *agent.Info    `json:"info,omitempty"`
	Peer    uuid.UUID      `json:"peer,omitzero"`
	Key     []byte         `json:"key,omitempty"`
	Regions []agent.Region `json:"regions,omitempty"`
	Notify  []byte         `json:"notify"`
	Async   bool           `json:"async,omitempty"`
	Dev     []bool         `json:"dev,omitempty"`
}

// Name names the request in failure messages.
func (r request) Name() string { return r.Cmd }

type response struct {
	Err     string         `json:"err,omitempty"`
	Is      []string       `json:"is,omitempty"`
	Info    *agent.Info    `json:"info,omitempty"`
	ID      int            `json:"id,omitempty"`
	Key     []byte         `json:"key,omitempty"`
	Regions []agent.Region `json:"regions,omitempty"`
	Event   *childEvent    `json:"event,omitempty"`
	Stats   *agent.Stats   `json:"stats,omitempty"`
}

type childEvent struct {
	Kind agent.EventKind `json:"kind"`
	From uuid.UUID       `json:"from"`
	Msg  []byte          `json:"msg"`
	Err  string          `json:"err,omitempty"`
	Is   []string        `json:"is,omitempty"`
}

var sentinels = []struct {
	name string
	err  error
}{
	{"ErrClosed", agent.ErrClosed},
	{"ErrCancelled", agent.ErrCancelled},
	{"ErrRemoteLost", agent.ErrRemoteLost},
	{"ErrAccessDenied", agent.ErrAccessDenied},
	{"ErrNoBackend", agent.ErrNoBackend},
	{"ErrInvalid", agent.ErrInvalid},
}

// classify names the agent sentinels err matches, for the parent to check
// with errors.Is semantics across the process boundary.
func classify(err error) []string {
	var is []string
	for _, s := range sentinels {
		if errors.Is(err, s.err) {
			is = append(is, s.name)
		}
	}
	return is
}

// childMem is a child's memory for an exposure or a transfer: buffers,
// or a devSide.
type childMem interface {
	Check(seed uint64) error
	regions() []agent.Region
}

// childExposure and childXfer keep a child's memory alive while a peer may
// use it.
type childExposure struct {
	e    *agent.Exposure
	bufs childMem
	regs []*agent.Registration
	free func() error // frees the device memory, if any
}

type childXfer struct {
	x    *agent.Xfer
	bufs childMem
	regs []*agent.Registration
	free func() error
}

func release(regs []*agent.Registration) {
	for _, r := range regs {
		_ = r.Release()
	}
}

type childAgent struct {
	a     *agent.Agent
	peers map[uuid.UUID]agent.Info // from add-peer; posts name peers by ID
	exps  map[int]*childExposure
	xfers []*childXfer
	last  int // the last exposure's id
}

// runChild is the child process: it serves requests from in until exit or
// end of input and returns the exit status.
func runChild(f Factory, in io.Reader, out io.Writer) int {
	bs, err := f()
	if err != nil {
		fmt.Fprintln(os.Stderr, "backendtest child: factory:", err)
		return 2
	}
	opts, err := childStaging()
	if err != nil {
		fmt.Fprintln(os.Stderr, "backendtest child:", err)
		return 2
	}
	a, err := agent.New(append(opts, agent.WithBackends(bs...))...)
	if err != nil {
		fmt.Fprintln(os.Stderr, "backendtest child: agent.New:", err)
		return 2
	}
	c := &childAgent{a: a, peers: map[uuid.UUID]agent.Info{}, exps: map[int]*childExposure{}}
	defer c.close()
	handle := func(req request) (response, bool) { return c.handle(req), req.Cmd == "exit" }
	if err := testproc.Serve(in, out, handle, fail); err != nil {
		fmt.Fprintln(os.Stderr, "backendtest child:", err)
		return 2
	}
	return 0
}

func fail(err error) response { return response{Err: err.Error(), Is: classify(err)} }

func (c *childAgent) close() {
	if err := c.a.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "backendtest child: agent.Close:", err)
	}
	for _, x := range c.xfers {
		<-x.x.Done()
		release(x.regs)
		freeDev(x.free)
	}
	for _, e := range c.exps {
		release(e.regs)
		freeDev(e.free)
	}
}

func freeDev(free func() error) {
	if err := free(); err != nil {
		fmt.Fprintln(os.Stderr, "backendtest child: free device memory:", err)
	}
}

// childMemory is memory a command laid out: what checks it, its
// descriptors, their registrations, and what frees its device memory.
type childMemory struct {
	m      childMem
	locals []agent.Local
	regs   []*agent.Registration
	free   func() error
}

func noFree() error { return nil }

// memory lays out a child's memory of sizes, in device memory of GPU gpu
// where dev says so, filled with pattern seed (0: zeros), and registers
// it.
func (c *childAgent) memory(sizes []int, dev []bool, gpu int, seed uint64) (childMemory, error) {
	if len(dev) == 0 {
		b := newBuffers(sizes)
		b.Fill(seed)
		regs, err := b.registerAll(c.a)
		return childMemory{m: b, locals: b.locals, regs: regs, free: func() error { b.free(); return nil }}, err
	}
	if len(dev) != len(sizes) {
		return childMemory{}, fmt.Errorf("dev names %d descriptors, sizes %d", len(dev), len(sizes))
	}
	drv, err := devmem.Default()
	if err != nil {
		return childMemory{}, err
	}
	d, err := newDevSide(drv, gpu, sizes, func(i int) bool { return dev[i] })
	if err != nil {
		return childMemory{}, err
	}
	if err := d.Fill(seed); err != nil {
		_ = d.free()
		return childMemory{}, err
	}
	regs, err := registerAll(c.a, d.locals)
	if err != nil {
		_ = d.free()
		return childMemory{}, err
	}
	return childMemory{m: d, locals: d.locals, regs: regs, free: d.free}, nil
}

func (c *childAgent) handle(req request) response {
	switch req.Cmd {
	case "info":
		info := c.a.Info()
		return response{Info: &info}
	case "add-peer":
		if req.Info == nil {
			return fail(errors.New("add-peer without info"))
		}
		c.peers[req.Info.ID] = *req.Info
		return response{}
	case "expose":
		m, err := c.memory(req.Sizes, req.Dev, passiveGPU, req.Seed)
		if err != nil {
			return fail(err)
		}
		e, err := c.a.Expose(req.Access, m.locals)
		if err != nil {
			release(m.regs)
			freeDev(m.free)
			return fail(err)
		}
		c.last++
		id := c.last
		c.exps[id] = &childExposure{e: e, bufs: m.m, regs: m.regs, free: m.free}
		k := e.Key()
		return response{ID: id, Key: k[:], Regions: m.m.regions()}
	case "stats":
		s := c.a.Stats()
		return response{Stats: &s}
	case "post":
		return c.post(req)
	case "exit":
		return response{}
	}
	ce, ok := c.exps[req.ID]
	if !ok {
		return fail(fmt.Errorf("%q: no exposure %d", req.Cmd, req.ID))
	}
	switch req.Cmd {
	case "verify":
		if err := ce.bufs.Check(req.Seed); err != nil {
			return fail(err)
		}
		return response{}
	case "revoke":
		ce.e.Revoke()
		return response{}
	case "forget":
		ce.e.Revoke()
		release(ce.regs)
		delete(c.exps, req.ID)
		if err := ce.free(); err != nil {
			return fail(err)
		}
		return response{}
	case "wait-event":
		select {
		case ev := <-ce.e.Events():
			ce := &childEvent{Kind: ev.Kind, From: ev.From, Msg: ev.Msg}
			if ev.Err != nil {
				ce.Err, ce.Is = ev.Err.Error(), classify(ev.Err)
			}
			return response{Event: ce}
		case <-time.After(hangGuard):
			return fail(fmt.Errorf("no event within %v", hangGuard))
		}
	case "wait-access":
		deadline := time.Now().Add(hangGuard)
		for ce.e.Peer() == uuid.Nil {
			if time.Now().After(deadline) {
				return fail(fmt.Errorf("exposure not accessed within %v", hangGuard))
			}
			time.Sleep(100 * time.Microsecond)
		}
		return response{}
	}
	return fail(fmt.Errorf("unknown command %q", req.Cmd))
}

func (c *childAgent) post(req request) response {
	if len(req.Key) != len(agent.Key{}) {
		return fail(fmt.Errorf("key of %d bytes", len(req.Key)))
	}
	sizes := make([]int, len(req.Regions))
	for i, r := range req.Regions {
		sizes[i] = int(r.Len)
	}
	var seed uint64 // a READ's memory starts zeroed
	if req.Op == agent.OpWrite {
		seed = req.Seed
	}
	peer, ok := c.peers[req.Peer]
	if !ok {
		return fail(fmt.Errorf("post to peer %s, never added", req.Peer))
	}
	m, err := c.memory(sizes, req.Dev, activeGPU, seed)
	if err != nil {
		return fail(err)
	}
	x, err := c.a.Post(context.Background(), agent.Request{Op: req.Op, Peer: peer, Key: agent.Key(req.Key), Segments: segmentsOf(m.locals, req.Regions, req.Seed), Notify: req.Notify})
	if err != nil {
		release(m.regs)
		freeDev(m.free)
		return fail(err)
	}
	if req.Async {
		c.xfers = append(c.xfers, &childXfer{x: x, bufs: m.m, regs: m.regs, free: m.free})
		return response{}
	}
	defer freeDev(m.free) // after the transfer is done: deferred first, run last
	defer release(m.regs)
	b := m.m
	select {
	case <-x.Done():
	case <-time.After(hangGuard):
		x.Cancel(nil)
		<-x.Done()
		return fail(fmt.Errorf("transfer still running after %v", hangGuard))
	}
	if err := x.Err(); err != nil {
		return fail(err)
	}
	if req.Op == agent.OpRead {
		if err := b.Check(req.Seed); err != nil {
			return fail(err)
		}
	}
	return response{}
}

// child is the parent's handle on a child process.
type child struct {
	*testproc.Child[request, response]
	t    *testing.T
	info agent.Info
}

// needMain fails t unless TestMain went through Main or Child.
func needMain(t *testing.T) {
	t.Helper()
	if !childReady {
		t.Fatal("backendtest: cross-process cases re-execute the test binary: call backendtest.Main or backendtest.Child from TestMain")
	}
}

// startChild starts a child process running an agent on the factory's
// backends; it ends when the test does. env is added to its environment.
func startChild(t *testing.T, env ...string) *child {
	t.Helper()
	needMain(t)
	c := &child{t: t, Child: testproc.Start[request, response](t, childEnv, testproc.Options{
		Env:          env,
		AnswerWithin: hangGuard,
		ExitWithin:   30 * time.Second,
	})}
	c.info = *c.must(request{Cmd: "info"}).Info
	return c
}

// startDevChild is startChild for the device cases: the child's device
// memory is simulated (GOXFER_DEVICE=sim), its agent stages it as the
// suite's agents do.
func startDevChild(t *testing.T) *child {
	t.Helper()
	return startChild(t, devmem.EnvDevice+"=sim", fmt.Sprintf("%s=%d,%d", stagingEnv, devChunk, devPool))
}

// must is Do for commands that must succeed.
func (c *child) must(req request) response {
	c.t.Helper()
	resp := c.Do(req)
	if resp.Err != "" {
		c.t.Fatalf("child %s: %s", req.Cmd, resp.Err)
	}
	return resp
}
