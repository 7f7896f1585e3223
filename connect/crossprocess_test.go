package connect

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/tcp"
)

// Cross-process tests: the test binary re-executes itself as a child
// process (childEnv set) that runs a Connector with the default backends and
// obeys the parent's commands, one JSON line on stdin answered by one JSON
// line on stdout. Tokens cross the process boundary as their text form,
// exactly as a user's own channel would carry them, and the two Connectors
// share no address space: every transfer goes through the tcp backend.

// childEnv, when set, makes the test binary a child process (see TestMain).
// childKeepaliveEnv, "interval/timeout", sets the child's tcp keepalive.
const (
	childEnv          = "GOXFER_CONNECT_CHILD"
	childKeepaliveEnv = "GOXFER_CONNECT_CHILD_KEEPALIVE"
)

const (
	// largeTransfer is the size of the transfers interrupted by killing a
	// process: large enough to be caught in flight.
	largeTransfer = 256 << 20
	// stopTransfer is the size of the transfers cancelled or revoked in
	// flight.
	stopTransfer = 64 << 20
	// lostWithin bounds how long a lost peer, or a peer's cancel, may go
	// unnoticed: the contract's "bounded time". The kernel closes a dead
	// process's connections, and frozen peers run with a 1 s keepalive
	// timeout, so this is far more than detection needs; it is no
	// performance bound.
	lostWithin = 5 * time.Second
	// attempts bounds how often a fault test retries when the transfer it
	// meant to interrupt finished first.
	attempts = 5
)

// childRequest is one command to a child process:
//
//	id                      -> Agent: the child's agent ID
//	expose  kind sizes seed -> ID, Token: memory filled with pattern seed
//	                           (0: zeros), exposed for kind
//	wait-access ID          -> once a peer has used the exposure (Status PROC)
//	wait    ID              -> the passive Wait's result and Status
//	verify  ID seed         -> whether the exposed memory holds pattern seed
//	close   ID              -> the passive Close's result
//	begin   token seed      -> a READ or WRITE (the token's kind) between the
//	                           exposed memory and fresh local memory (WRITE:
//	                           filled with pattern seed), awaited and checked
//	                           (see childActive.finish); with Async it
//	                           answers once posted, ID naming the operation
//	cancel  ID              -> cancels an async operation's Begin context
//	                           and answers its Wait's result, checked
//	await   ID              -> an async operation's Wait's result, checked
//
// When stdin closes the child closes its Connector and exits.
type childRequest struct {
	Cmd   string        `json:"cmd"`
	ID    int           `json:"id,omitempty"`
	Kind  OperationKind `json:"kind,omitempty"`
	Sizes []int         `json:"sizes,omitempty"`
	Seed  uint64        `json:"seed,omitempty"`
	Token string        `json:"token,omitempty"`
	Async bool          `json:"async,omitempty"`
}

type childResponse struct {
	Err      string        `json:"err,omitempty"`
	Is       []string      `json:"is,omitempty"`
	Transfer *transferInfo `json:"transfer,omitempty"` // the error's *TransferError
	ID       int           `json:"id,omitempty"`
	Agent    string        `json:"agent,omitempty"`
	Token    string        `json:"token,omitempty"`
	Backend  string        `json:"backend,omitempty"`
	Status   string        `json:"status,omitempty"`
	Check    string        `json:"check,omitempty"`   // what is wrong with the memory, "" if nothing
	Touched  string        `json:"touched,omitempty"` // how a failed operation changed its local memory
}

type transferInfo struct{ Op, Remote, Backend string }

// childSentinels are the errors a child reports its errors matching.
var childSentinels = []struct {
	name string
	err  error
}{
	{"ErrClosed", ErrClosed},
	{"ErrCancelled", ErrCancelled},
	{"ErrRemoteLost", ErrRemoteLost},
	{"ErrAccessDenied", ErrAccessDenied},
	{"ErrNoBackend", ErrNoBackend},
	{"ErrKindMismatch", ErrKindMismatch},
	{"ErrSizeMismatch", ErrSizeMismatch},
	{"ErrInvalidMetadata", ErrInvalidMetadata},
	{"context.Canceled", context.Canceled},
	{"context.DeadlineExceeded", context.DeadlineExceeded},
}

func failed(err error) childResponse {
	if err == nil {
		return childResponse{}
	}
	r := childResponse{Err: err.Error()}
	for _, s := range childSentinels {
		if errors.Is(err, s.err) {
			r.Is = append(r.Is, s.name)
		}
	}
	var te *TransferError
	if errors.As(err, &te) {
		r.Transfer = &transferInfo{Op: te.Op, Remote: te.Remote, Backend: te.Backend}
	}
	return r
}

// remoteError is a child's error rebuilt in the parent: it matches, with
// errors.Is, the sentinels the original matched.
type remoteError struct {
	msg string
	is  []error
}

func (e *remoteError) Error() string   { return "child: " + e.msg }
func (e *remoteError) Unwrap() []error { return e.is }

// err rebuilds the child's error, as a *TransferError if it was one.
func (r childResponse) err() error {
	if r.Err == "" {
		return nil
	}
	re := &remoteError{msg: r.Err}
	for _, name := range r.Is {
		for _, s := range childSentinels {
			if s.name == name {
				re.is = append(re.is, s.err)
			}
		}
	}
	if ti := r.Transfer; ti != nil {
		return &TransferError{Op: ti.Op, Remote: ti.Remote, Backend: ti.Backend, Err: re}
	}
	return re
}

// childPassive and childActive keep a child's memory alive while a peer or
// a backend may use it.
type childPassive struct {
	op  waiter
	mem *slab
}

type childActive struct {
	op     active
	cancel context.CancelFunc
	kind   OperationKind
	mem    *slab
	seed   uint64
}

type childServer struct {
	c       *Connector
	passive map[int]*childPassive
	active  map[int]*childActive
	last    int
}

// runChild is the child process: it serves requests from in until end of
// input and returns the exit status.
func runChild(in io.Reader, out io.Writer) int {
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	opts := []Option{WithLogger(log)}
	if ka := os.Getenv(childKeepaliveEnv); ka != "" {
		interval, timeout, _ := strings.Cut(ka, "/")
		i, err1 := time.ParseDuration(interval)
		t, err2 := time.ParseDuration(timeout)
		if err := errors.Join(err1, err2); err != nil {
			fmt.Fprintf(os.Stderr, "connect child: %s=%q: %v\n", childKeepaliveEnv, ka, err)
			return 2
		}
		opts = append(opts, WithTCPOptions(tcp.WithKeepalive(i, t)))
	}
	c, err := NewConnector(opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, "connect child: NewConnector:", err)
		return 2
	}
	s := &childServer{c: c, passive: map[int]*childPassive{}, active: map[int]*childActive{}}
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 64<<10), 64<<20)
	enc := json.NewEncoder(out)
	code := 0
	for sc.Scan() {
		var req childRequest
		resp := failed(json.Unmarshal(sc.Bytes(), &req))
		if resp.Err == "" {
			resp = s.handle(req)
		}
		if err := enc.Encode(resp); err != nil {
			fmt.Fprintln(os.Stderr, "connect child: write response:", err)
			code = 2
			break
		}
	}
	for _, a := range s.active {
		a.cancel()
	}
	if err := c.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "connect child: Close:", err)
		code = 2
	}
	return code
}

func (s *childServer) handle(req childRequest) childResponse {
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	switch req.Cmd {
	case "id":
		return childResponse{Agent: s.c.a.ID().String()}
	case "expose":
		mem := newSlab(req.Sizes)
		mem.fill(req.Seed)
		var (
			op  waiter
			err error
		)
		if req.Kind == KindWrite {
			op, err = s.c.CreateWritable(ctx, mem.descriptors()...)
		} else {
			op, err = s.c.CreateReadable(ctx, mem.descriptors()...)
		}
		if err != nil {
			return failed(err)
		}
		s.last++
		s.passive[s.last] = &childPassive{op: op, mem: mem}
		return childResponse{ID: s.last, Token: op.Metadata().String()}
	case "begin":
		return s.begin(req)
	case "cancel", "await":
		a, ok := s.active[req.ID]
		if !ok {
			return failed(fmt.Errorf("%s: no active operation %d", req.Cmd, req.ID))
		}
		delete(s.active, req.ID)
		if req.Cmd == "cancel" {
			a.cancel()
		}
		return a.finish(ctx)
	}
	p, ok := s.passive[req.ID]
	if !ok {
		return failed(fmt.Errorf("%s: no passive operation %d", req.Cmd, req.ID))
	}
	switch req.Cmd {
	case "wait-access":
		// A test's wait for the peer's first access; the SDK has no event
		// for it, so poll.
		for p.op.Status() == StatusInitialized {
			select {
			case <-ctx.Done():
				return failed(fmt.Errorf("no peer used the operation: %w", ctx.Err()))
			case <-time.After(100 * time.Microsecond):
			}
		}
		return childResponse{Status: p.op.Status().String()}
	case "wait":
		r := failed(p.op.Wait(ctx))
		r.Status = p.op.Status().String()
		return r
	case "verify":
		if err := p.mem.check(req.Seed); err != nil {
			return childResponse{Check: err.Error()}
		}
		return childResponse{}
	case "close":
		delete(s.passive, req.ID)
		return failed(p.op.Close())
	}
	return failed(fmt.Errorf("unknown command %q", req.Cmd))
}

func (s *childServer) begin(req childRequest) childResponse {
	md, err := ParseMetadata(req.Token)
	if err != nil {
		return failed(err)
	}
	a := &childActive{kind: md.Kind(), mem: newSlab(md.Sizes()), seed: req.Seed}
	// READ memory starts with other bytes than the ones it must receive,
	// to show whether a failed transfer touched it.
	a.mem.fill(a.initial())
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	a.cancel = cancel
	a.op, err = begin(ctx, s.c, md, a.mem.bufs)
	if err != nil {
		cancel()
		return failed(err)
	}
	if !req.Async {
		return a.finish(ctx)
	}
	s.last++
	s.active[s.last] = a
	return childResponse{ID: s.last, Backend: a.op.Backend(), Status: a.op.Status().String()}
}

// initial is the pattern the local memory starts with.
func (a *childActive) initial() uint64 {
	if a.kind == KindWrite || a.seed == 0 {
		return a.seed
	}
	return a.seed ^ 0x5eed
}

// finish awaits the operation and checks its local memory: a completed one
// holds the pattern, a failed one may hold anything (a READ cancelled
// half-way) between intact guards, and Touched tells whether it changed.
func (a *childActive) finish(ctx context.Context) childResponse {
	defer a.cancel()
	err := a.op.Wait(ctx)
	r := failed(err)
	r.Backend, r.Status = a.op.Backend(), a.op.Status().String()
	if err == nil {
		if cerr := a.mem.check(a.seed); cerr != nil {
			r.Check = cerr.Error()
		}
		return r
	}
	if cerr := a.mem.checkGuards(); cerr != nil {
		r.Check = cerr.Error()
	}
	if cerr := a.mem.check(a.initial()); cerr != nil {
		r.Touched = cerr.Error()
	}
	return r
}

// child is the parent's handle on a child process.
type child struct {
	t      *testing.T
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan []byte
	quit   chan struct{}
	eof    chan struct{}
	stderr lockedBuffer
	killed bool
	agent  string // the child's agent ID
}

// startChild starts a child process, with env added to its environment; it
// ends when the test does.
func startChild(t *testing.T, env ...string) *child {
	t.Helper()
	c := &child{t: t, lines: make(chan []byte), quit: make(chan struct{}), eof: make(chan struct{})}
	c.cmd = exec.Command(os.Args[0], "-test.run=^$")
	// A race-enabled child sleeps a second before exiting to let racing
	// goroutines be caught; this one has closed everything by then.
	gorace := strings.TrimSpace(os.Getenv("GORACE") + " atexit_sleep_ms=0")
	c.cmd.Env = append(append(os.Environ(), childEnv+"=1", "GORACE="+gorace), env...)
	c.cmd.Stderr = &c.stderr
	var err error
	c.stdin, err = c.cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := c.cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, c.cmd.Start(), "start child process")
	go c.read(stdout)
	t.Cleanup(c.stop)
	c.agent = c.must(childRequest{Cmd: "id"}).Agent
	return c
}

func (c *child) read(stdout io.Reader) {
	defer close(c.eof)
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 64<<10), 64<<20)
	for sc.Scan() {
		select {
		case c.lines <- slices.Clone(sc.Bytes()):
		case <-c.quit:
		}
	}
}

// stop ends the child: closing its stdin makes it close its Connector and
// exit; one that does not is killed. A child that exits with an error (a
// data race it detected, say) fails the test.
func (c *child) stop() {
	close(c.quit)
	_ = c.stdin.Close()
	select {
	case <-c.eof:
	case <-time.After(hangGuard):
		c.t.Errorf("child process did not exit within %v of its stdin closing; killing it", hangGuard)
		c.kill()
		<-c.eof
	}
	if err := c.cmd.Wait(); err != nil && !c.killed {
		c.t.Errorf("child process: %v", err)
	}
	if c.t.Failed() {
		c.t.Logf("child process stderr:\n%s", c.stderr.String())
	}
}

// kill kills the child with SIGKILL: no goodbye, no Close.
func (c *child) kill() {
	c.killed = true
	_ = c.cmd.Process.Kill()
}

// do sends req to the child and returns its answer.
func (c *child) do(req childRequest) childResponse {
	c.t.Helper()
	line, err := json.Marshal(req)
	require.NoError(c.t, err)
	if _, err := c.stdin.Write(append(line, '\n')); err != nil {
		c.t.Fatalf("child %s: %v\nstderr:\n%s", req.Cmd, err, c.stderr.String())
	}
	select {
	case l := <-c.lines:
		var resp childResponse
		require.NoError(c.t, json.Unmarshal(l, &resp), "child answered %q", l)
		return resp
	case <-c.eof:
		c.t.Fatalf("child %s: child exited\nstderr:\n%s", req.Cmd, c.stderr.String())
	case <-time.After(hangGuard + 5*time.Second): // the child's own guard fires first
		c.kill()
		c.t.Fatalf("child %s: no answer within %v", req.Cmd, hangGuard)
	}
	return childResponse{}
}

// must is do for commands that must succeed and leave memory as expected.
func (c *child) must(req childRequest) childResponse {
	c.t.Helper()
	resp := c.do(req)
	require.NoError(c.t, resp.err(), "child %s", req.Cmd)
	require.Empty(c.t, resp.Check, "child %s", req.Cmd)
	return resp
}

// lockedBuffer collects a child's stderr.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// The pattern is deterministic in (seed, descriptor index, offset), so two
// processes produce and check the same bytes, and a misplaced, shifted,
// swapped or missing byte shows: descriptor d is a random base block (per
// seed) rotated by a hash of d, and the first 8 bytes of each 64 KiB block
// are a hash of the seed, d and the block index. Filling copies whole runs,
// which keeps it cheap under the race detector. Seed 0 is all zeros.
const patternBlock = 64 << 10

var patternBases sync.Map // seed -> []byte

func patternBase(seed uint64) []byte {
	if b, ok := patternBases.Load(seed); ok {
		return b.([]byte)
	}
	var s [32]byte
	binary.LittleEndian.PutUint64(s[:], seed)
	b := make([]byte, patternBlock)
	_, _ = rand.NewChaCha8(s).Read(b)
	v, _ := patternBases.LoadOrStore(seed, b)
	return v.([]byte)
}

func mix(x uint64) uint64 { // splitmix64 finalizer
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

func fillPattern(b []byte, seed uint64, desc int) {
	if seed == 0 {
		clear(b)
		return
	}
	base := patternBase(seed)
	rot := int(mix(seed^mix(uint64(desc))) % patternBlock)
	for i := 0; i < len(b); {
		i += copy(b[i:], base[(i+rot)%patternBlock:])
	}
	for blk := 0; blk*patternBlock < len(b); blk++ {
		var stamp [8]byte
		binary.LittleEndian.PutUint64(stamp[:], mix(seed^mix(uint64(desc)+1)^mix(uint64(blk)+0x51ed27)))
		copy(b[blk*patternBlock:], stamp[:])
	}
}

var seedCounter struct {
	sync.Mutex
	n uint64
}

// nextSeed returns a seed not used before in this process.
func nextSeed() uint64 {
	seedCounter.Lock()
	defer seedCounter.Unlock()
	seedCounter.n++
	return seedCounter.n
}

// guardLen bytes of guardByte surround every descriptor of a slab: a
// backend that writes past a descriptor's end or before its start hits
// them. guardLen is odd, so descriptors are not aligned as allocations are.
const (
	guardLen  = 7
	guardByte = 0xa5
)

// slab is the memory of one side of a transfer: descriptors carved from one
// allocation, with guard bytes around each.
type slab struct {
	mem  []byte
	offs []int
	bufs [][]byte
}

func newSlab(sizes []int) *slab {
	total := guardLen
	for _, n := range sizes {
		total += n + guardLen
	}
	s := &slab{mem: make([]byte, total)}
	for i := range s.mem[:guardLen] {
		s.mem[i] = guardByte
	}
	off := guardLen
	for _, n := range sizes {
		s.offs = append(s.offs, off)
		s.bufs = append(s.bufs, s.mem[off:off+n:off+n])
		for i := off + n; i < off+n+guardLen; i++ {
			s.mem[i] = guardByte
		}
		off += n + guardLen
	}
	return s
}

func (s *slab) descriptors() []Descriptor { return descriptors(s.bufs) }

func (s *slab) fill(seed uint64) {
	for i, b := range s.bufs {
		fillPattern(b, seed, i)
	}
}

// check reports the first descriptor that does not hold pattern seed, or
// the first guard byte overwritten.
func (s *slab) check(seed uint64) error {
	var want []byte
	for i, b := range s.bufs {
		if cap(want) < len(b) {
			want = make([]byte, len(b))
		}
		w := want[:len(b)]
		fillPattern(w, seed, i)
		if !bytes.Equal(b, w) {
			// Find the first difference a page at a time: a loop over every
			// byte is slow under the race detector.
			page := 0
			for bytes.Equal(b[page:min(page+4096, len(b))], w[page:min(page+4096, len(w))]) {
				page += 4096
			}
			first := page
			for b[first] == w[first] {
				first++
			}
			return fmt.Errorf("descriptor %d of %d bytes, pattern %d: the first difference at offset %d: got 0x%02x, want 0x%02x",
				i, len(b), seed, first, b[first], w[first])
		}
	}
	return s.checkGuards()
}

// checkGuards reports the first guard byte overwritten.
func (s *slab) checkGuards() error {
	prev := 0
	for i, off := range s.offs {
		if err := checkGuard(s.mem[prev:off], i); err != nil {
			return err
		}
		prev = off + len(s.bufs[i])
	}
	return checkGuard(s.mem[prev:], len(s.offs))
}

func checkGuard(g []byte, i int) error {
	for j, c := range g {
		if c != guardByte {
			return fmt.Errorf("guard bytes before descriptor %d overwritten: byte %d is 0x%02x", i, j, c)
		}
	}
	return nil
}

// createOp creates a passive operation of kind over mem, closed when the
// test ends.
func createOp(t *testing.T, c *Connector, kind OperationKind, mem *slab) waiter {
	t.Helper()
	var (
		op  waiter
		err error
	)
	if kind == KindRead {
		op, err = c.CreateReadable(t.Context(), mem.descriptors()...)
	} else {
		op, err = c.CreateWritable(t.Context(), mem.descriptors()...)
	}
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, op.Close()) })
	return op
}

// retry runs f until it reports that it interrupted a transfer in flight,
// each time in a subtest of its own, so that the processes and memory of an
// attempt are gone before the next.
func retry(t *testing.T, f func(t *testing.T) bool) {
	t.Helper()
	for i := 1; i <= attempts; i++ {
		var hit bool
		if !t.Run(fmt.Sprintf("attempt%d", i), func(t *testing.T) { hit = f(t) }) {
			return
		}
		if hit {
			return
		}
	}
	t.Fatalf("no transfer was still in flight when interrupted, in %d attempts", attempts)
}

// awaitPeer waits until a peer has used op (it is StatusInProgress).
func awaitPeer(t *testing.T, op waiter) {
	t.Helper()
	require.Eventually(t, func() bool { return op.Status() != StatusInitialized }, hangGuard, 100*time.Microsecond,
		"no peer used the operation")
}

var kinds = []OperationKind{KindRead, KindWrite}

func TestCrossProcessTransfer(t *testing.T) {
	layouts := []struct {
		name  string
		sizes []int
	}{
		{"1 descriptor", []int{5<<20 + 3}},
		{"4096x4KiB", uniform(4096, 4<<10)},
		{"odd sizes", []int{1, 7, 4095, 65537, 1<<20 + 3, 333, 2}},
	}
	ctx := guarded(t)
	parent := newConnector(t)
	c := startChild(t)

	t.Run("parent passive", func(t *testing.T) {
		for _, kind := range kinds {
			for _, l := range layouts {
				t.Run(kind.String()+"/"+l.name, func(t *testing.T) {
					seed := nextSeed()
					mem := newSlab(l.sizes)
					if kind == KindRead {
						mem.fill(seed)
					}
					pop := createOp(t, parent, kind, mem)
					resp := c.must(childRequest{Cmd: "begin", Token: pop.Metadata().String(), Seed: seed})
					assert.Equal(t, "tcp", resp.Backend)
					assert.Equal(t, "DONE", resp.Status)

					require.NoError(t, pop.Wait(ctx))
					assert.Equal(t, StatusComplete, pop.Status())
					require.NoError(t, mem.check(seed), "the exposed memory after the child's %v", kind)
					require.NoError(t, pop.Close())
					requireUnregistered(t, parent)
				})
			}
		}
	})

	t.Run("child passive", func(t *testing.T) {
		for _, kind := range kinds {
			for _, l := range layouts {
				t.Run(kind.String()+"/"+l.name, func(t *testing.T) {
					seed := nextSeed()
					exposed := seed
					if kind == KindWrite {
						exposed = 0
					}
					r := c.must(childRequest{Cmd: "expose", Kind: kind, Sizes: l.sizes, Seed: exposed})
					md, err := ParseMetadata(r.Token)
					require.NoError(t, err)
					require.Equal(t, kind, md.Kind())
					require.Equal(t, l.sizes, md.Sizes())
					assert.Equal(t, c.agent, md.peer.ID.String())

					local := newSlab(l.sizes)
					if kind == KindWrite {
						local.fill(seed)
					}
					aop, err := begin(ctx, parent, md, local.bufs)
					require.NoError(t, err)
					require.NoError(t, aop.Wait(ctx))
					assert.Equal(t, StatusComplete, aop.Status())
					assert.Equal(t, "tcp", aop.Backend())
					require.NoError(t, local.check(seed), "the local memory after the %v", kind)
					requireUnregistered(t, parent)

					w := c.must(childRequest{Cmd: "wait", ID: r.ID})
					assert.Equal(t, "DONE", w.Status)
					c.must(childRequest{Cmd: "verify", ID: r.ID, Seed: seed})
					c.must(childRequest{Cmd: "close", ID: r.ID})
				})
			}
		}
	})
}

func TestCrossProcessPassiveKilled(t *testing.T) {
	for _, kind := range kinds {
		t.Run(kind.String(), func(t *testing.T) {
			retry(t, func(t *testing.T) bool {
				ctx := guarded(t)
				parent := newConnector(t)
				c := startChild(t)
				r := c.must(childRequest{Cmd: "expose", Kind: kind, Sizes: []int{largeTransfer}})
				md, err := ParseMetadata(r.Token)
				require.NoError(t, err)
				aop, err := begin(ctx, parent, md, [][]byte{make([]byte, largeTransfer)})
				require.NoError(t, err)
				c.must(childRequest{Cmd: "wait-access", ID: r.ID})
				if aop.Status() != StatusInProgress {
					return false
				}
				start := time.Now()
				c.kill()
				err = aop.Wait(ctx)
				lost := time.Since(start)
				if err == nil {
					return false // it finished before the kill
				}
				t.Logf("%v failed %v after the passive process was killed: %v", kind, lost, err)
				require.ErrorIs(t, err, ErrRemoteLost)
				var te *TransferError
				require.ErrorAs(t, err, &te)
				assert.Equal(t, "tcp", te.Backend)
				assert.Equal(t, c.agent, te.Remote)
				assert.Equal(t, StatusErrored, aop.Status())
				assert.LessOrEqual(t, lost, lostWithin, "time to report the lost peer")
				requireUnregistered(t, parent)
				return true
			})
		})
	}
}

func TestCrossProcessActiveKilled(t *testing.T) {
	for _, kind := range kinds {
		t.Run(kind.String(), func(t *testing.T) {
			retry(t, func(t *testing.T) bool {
				// A generous bound: the loss must come well before it.
				ctx := guarded(t)
				parent := newConnector(t)
				c := startChild(t)
				pop := createOp(t, parent, kind, newSlab([]int{largeTransfer}))
				c.must(childRequest{Cmd: "begin", Token: pop.Metadata().String(), Async: true})
				awaitPeer(t, pop)
				start := time.Now()
				c.kill()
				err := pop.Wait(ctx)
				lost := time.Since(start)
				if err == nil {
					return false // it finished before the kill
				}
				t.Logf("passive %v heard %v after the active process was killed: %v", kind, lost, err)
				require.ErrorIs(t, err, ErrRemoteLost)
				var te *TransferError
				require.ErrorAs(t, err, &te)
				assert.Equal(t, c.agent, te.Remote)
				assert.Equal(t, StatusErrored, pop.Status())
				assert.LessOrEqual(t, lost, lostWithin, "time to report the lost peer")
				return true
			})
		})
	}
}

func TestCrossProcessActiveCancelled(t *testing.T) {
	for _, kind := range kinds {
		t.Run(kind.String(), func(t *testing.T) {
			retry(t, func(t *testing.T) bool {
				ctx := guarded(t)
				parent := newConnector(t)
				c := startChild(t)
				seed := nextSeed()
				mem := newSlab([]int{stopTransfer})
				mem.fill(seed)
				pop := createOp(t, parent, kind, mem)
				r := c.must(childRequest{Cmd: "begin", Token: pop.Metadata().String(), Seed: seed, Async: true})
				assert.Equal(t, "PROC", r.Status, "the child's operation after Begin")
				assert.Equal(t, "tcp", r.Backend)
				awaitPeer(t, pop) // bytes are moving

				type waited struct {
					err error
					at  time.Time
				}
				passiveDone := make(chan waited, 1)
				go func() {
					err := pop.Wait(ctx)
					passiveDone <- waited{err, time.Now()}
				}()
				start := time.Now()
				resp := c.do(childRequest{Cmd: "cancel", ID: r.ID})
				pw := <-passiveDone
				if resp.Err == "" {
					require.NoError(t, pw.err)
					return false // it finished before the cancel
				}
				aerr := resp.err()
				require.ErrorIs(t, aerr, ErrCancelled)
				require.ErrorIs(t, aerr, context.Canceled)
				assert.Equal(t, "STOP", resp.Status)
				assert.Empty(t, resp.Check, "the guards around the child's local memory")

				err, heard := pw.err, pw.at.Sub(start)
				t.Logf("passive %v heard %v after the child was told to cancel: %v", kind, heard, err)
				require.ErrorIs(t, err, ErrCancelled)
				var te *TransferError
				require.ErrorAs(t, err, &te)
				assert.Equal(t, c.agent, te.Remote)
				assert.Equal(t, StatusCancelled, pop.Status())
				assert.LessOrEqual(t, heard, lostWithin, "time to hear of the cancel")
				return true
			})
		})
	}
}

func TestCrossProcessClosedPassive(t *testing.T) {
	ctx := guarded(t)
	parent := newConnector(t)
	c := startChild(t)
	sizes := []int{4096, 100000, 3}
	for _, kind := range kinds {
		t.Run(kind.String(), func(t *testing.T) {
			seed := nextSeed()
			mem := newSlab(sizes)
			mem.fill(seed)
			pop := createOp(t, parent, kind, mem)
			token := pop.Metadata().String()
			require.NoError(t, pop.Close())
			require.ErrorIs(t, pop.Wait(ctx), ErrClosed)
			requireUnregistered(t, parent)

			// The child's WRITE carries other bytes than the parent holds.
			resp := c.do(childRequest{Cmd: "begin", Token: token, Seed: seed + 1<<32})
			err := resp.err()
			require.ErrorIs(t, err, ErrAccessDenied)
			var te *TransferError
			require.ErrorAs(t, err, &te)
			assert.Equal(t, "tcp", te.Backend)
			assert.Equal(t, parent.a.ID().String(), te.Remote)
			assert.Equal(t, "ERR", resp.Status)
			assert.Empty(t, resp.Check, "the guards around the child's local memory")
			assert.Empty(t, resp.Touched, "the child's local memory")
			require.NoError(t, mem.check(seed), "the parent's memory")
		})
	}
}

// Closing a passive operation in the middle of a peer's transfer revokes
// access: once Close returns, the peer touches the memory no more, so it may
// be reused, and the peer's transfer fails with ErrAccessDenied. The race
// detector watches the reuse.
func TestCrossProcessCloseMidTransfer(t *testing.T) {
	for _, kind := range kinds {
		t.Run(kind.String(), func(t *testing.T) {
			retry(t, func(t *testing.T) bool {
				parent := newConnector(t)
				c := startChild(t)
				seed := nextSeed()
				mem := newSlab([]int{stopTransfer})
				pop := createOp(t, parent, kind, mem)
				r := c.must(childRequest{Cmd: "begin", Token: pop.Metadata().String(), Seed: seed, Async: true})
				awaitPeer(t, pop)
				require.NoError(t, pop.Close())
				// The memory is ours again: reuse it while the child's
				// transfer may still run.
				mem.fill(seed + 1<<32)

				resp := c.do(childRequest{Cmd: "await", ID: r.ID})
				if resp.Err == "" {
					return false // it finished before the Close
				}
				t.Logf("the child's %v after the parent's Close: %v", kind, resp.Err)
				require.ErrorIs(t, resp.err(), ErrAccessDenied)
				assert.Empty(t, resp.Check, "the guards around the child's local memory")
				require.NoError(t, mem.check(seed+1<<32), "memory reused after Close")
				requireUnregistered(t, parent)
				return true
			})
		})
	}
}
