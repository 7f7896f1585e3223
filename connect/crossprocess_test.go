package connect

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/internal/pattern"
	"github.com/goxfer/goxfer/internal/retry"
	"github.com/goxfer/goxfer/internal/testproc"
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

// Name names the request in failure messages.
func (r childRequest) Name() string { return r.Cmd }

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

type transferInfo struct {
	Op, Backend string
	Peer        uuid.UUID
}

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
		r.Transfer = &transferInfo{Op: te.Op, Peer: te.Peer, Backend: te.Backend}
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
		return &TransferError{Op: ti.Op, Peer: ti.Peer, Backend: ti.Backend, Err: re}
	}
	return re
}

// childPassive and childActive keep a child's memory alive while a peer or
// a backend may use it.
type childPassive struct {
	op  waiter
	mem *pattern.Slab
}

type childActive struct {
	op     active
	cancel context.CancelFunc
	kind   OperationKind
	mem    *pattern.Slab
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
		// Keepalives are tcp's: the child then talks tcp only.
		opts = append(opts, WithTCPOptions(tcp.WithKeepalive(i, t)), WithoutCMA())
	}
	c, err := NewConnector(opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, "connect child: NewConnector:", err)
		return 2
	}
	s := &childServer{c: c, passive: map[int]*childPassive{}, active: map[int]*childActive{}}
	handle := func(req childRequest) (childResponse, bool) { return s.handle(req), false }
	code := 0
	if err := testproc.Serve(in, out, handle, failed); err != nil {
		fmt.Fprintln(os.Stderr, "connect child:", err)
		code = 2
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
		mem := pattern.NewSlab(req.Sizes)
		mem.Fill(req.Seed)
		var (
			op  waiter
			err error
		)
		if req.Kind == KindWrite {
			op, err = s.c.CreateWritable(ctx, descriptors(mem.Bufs())...)
		} else {
			op, err = s.c.CreateReadable(ctx, descriptors(mem.Bufs())...)
		}
		if err != nil {
			return failed(err)
		}
		s.last++
		s.passive[s.last] = &childPassive{op: op, mem: mem}
		return childResponse{ID: s.last, Token: op.Metadata().Text()}
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
		if err := p.mem.Check(req.Seed); err != nil {
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
	a := &childActive{kind: md.Kind(), mem: pattern.NewSlab(md.Sizes()), seed: req.Seed}
	// READ memory starts with other bytes than the ones it must receive,
	// to show whether a failed transfer touched it.
	a.mem.Fill(a.initial())
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	a.cancel = cancel
	a.op, err = begin(ctx, s.c, md, a.mem.Bufs())
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
		if cerr := a.mem.Check(a.seed); cerr != nil {
			r.Check = cerr.Error()
		}
		return r
	}
	if cerr := a.mem.CheckGuards(); cerr != nil {
		r.Check = cerr.Error()
	}
	if cerr := a.mem.Check(a.initial()); cerr != nil {
		r.Touched = cerr.Error()
	}
	return r
}

// child is the parent's handle on a child process.
type child struct {
	*testproc.Child[childRequest, childResponse]
	t     *testing.T
	agent string // the child's agent ID
}

// startChild starts a child process, with env added to its environment; it
// ends when the test does. A child that exits with an error (a data race it
// detected, say) fails the test.
func startChild(t *testing.T, env ...string) *child {
	t.Helper()
	// A race-enabled child sleeps a second before exiting to let racing
	// goroutines be caught; this one has closed everything by then.
	gorace := strings.TrimSpace(os.Getenv("GORACE") + " atexit_sleep_ms=0")
	c := &child{t: t, Child: testproc.Start[childRequest, childResponse](t, childEnv, testproc.Options{
		Env:          append([]string{"GORACE=" + gorace}, env...),
		AnswerWithin: hangGuard + 5*time.Second, // the child's own guard fires first
		ExitWithin:   hangGuard,
	})}
	c.agent = c.must(childRequest{Cmd: "id"}).Agent
	return c
}

// must is Do for commands that must succeed and leave memory as expected.
func (c *child) must(req childRequest) childResponse {
	c.t.Helper()
	resp := c.Do(req)
	require.NoError(c.t, resp.err(), "child %s", req.Cmd)
	require.Empty(c.t, resp.Check, "child %s", req.Cmd)
	return resp
}

// retryKinds runs f for each kind, in a subtest named prefix and the kind,
// until it interrupts a transfer in flight (see retry.Until).
func retryKinds(t *testing.T, prefix string, f func(t *testing.T, kind OperationKind) bool) {
	for _, kind := range kinds {
		t.Run(prefix+kind.String(), func(t *testing.T) {
			retry.Until(t, attempts, func(t *testing.T) bool { return f(t, kind) })
		})
	}
}

// awaitPeer waits until a peer has used op (it is StatusInProgress).
func awaitPeer(t *testing.T, op waiter) {
	t.Helper()
	require.Eventually(t, func() bool { return op.Status() != StatusInitialized }, hangGuard, 100*time.Microsecond,
		"no peer used the operation")
}

var kinds = []OperationKind{KindRead, KindWrite}

// sameHost is the backend two processes on one host use by default.
var sameHost = map[bool]string{true: "cma", false: "tcp"}[runtime.GOOS == "linux"]

func TestCrossProcessTransfer(t *testing.T) {
	layouts := []struct {
		name  string
		sizes []int
	}{
		{"1 descriptor", []int{5<<20 + 3}},
		{"4096x4KiB", uniform(4096, 4<<10)},
		{"odd sizes", []int{1, 7, 4095, 65537, 1<<20 + 3, 333, 2}},
	}
	for _, backend := range []string{sameHost, "tcp"} {
		t.Run(backend, func(t *testing.T) {
			var opts []Option
			if backend == "tcp" {
				// Without cma on one side, both sides fall back to tcp.
				opts = append(opts, WithoutCMA())
			}
			crossProcessTransfer(t, backend, layouts, newConnector(t, opts...))
		})
	}
}

func crossProcessTransfer(t *testing.T, backend string, layouts []struct {
	name  string
	sizes []int
}, parent *Connector) {
	ctx := guarded(t)
	c := startChild(t)

	t.Run("parent passive", func(t *testing.T) {
		for _, kind := range kinds {
			for _, l := range layouts {
				t.Run(kind.String()+"/"+l.name, func(t *testing.T) {
					seed := pattern.NextSeed()
					mem := pattern.NewSlab(l.sizes)
					if kind == KindRead {
						mem.Fill(seed)
					}
					pop := expose(t, parent, kind, mem.Bufs())
					resp := c.must(childRequest{Cmd: "begin", Token: pop.Metadata().Text(), Seed: seed})
					assert.Equal(t, backend, resp.Backend)
					assert.Equal(t, "DONE", resp.Status)

					require.NoError(t, pop.Wait(ctx))
					assert.Equal(t, StatusComplete, pop.Status())
					require.NoError(t, mem.Check(seed), "the exposed memory after the child's %v", kind)
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
					seed := pattern.NextSeed()
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

					local := pattern.NewSlab(l.sizes)
					if kind == KindWrite {
						local.Fill(seed)
					}
					aop := moved(t, ctx, parent, md, local.Bufs())
					assert.Equal(t, StatusComplete, aop.Status())
					assert.Equal(t, backend, aop.Backend())
					require.NoError(t, local.Check(seed), "the local memory after the %v", kind)
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

// A cut is one attempt of a fault test: a transfer of largeTransfer bytes
// between this process and a child, interrupted by stopping the child while
// the bytes move.
type cut struct {
	parent *Connector
	c      *child
	op     interface { // the parent's operation
		Wait(context.Context) error
		Status() Status
	}
	err error // what its Wait returned
}

// cutPassive makes the child passive: it exposes memory for kind, this
// process begins the transfer, and the child is stopped (see cut.stop) once
// it sees the first access. It returns false if the transfer was not in
// flight then. opts and env configure the parent's Connector and the child.
func cutPassive(t *testing.T, kind OperationKind, stop func(*child), how string, opts []Option, env ...string) (cut, bool) {
	t.Helper()
	ctx := guarded(t)
	k := cut{parent: newConnector(t, opts...), c: startChild(t, env...)}
	r := k.c.must(childRequest{Cmd: "expose", Kind: kind, Sizes: []int{largeTransfer}})
	md, err := ParseMetadata(r.Token)
	require.NoError(t, err)
	k.op, err = begin(ctx, k.parent, md, [][]byte{make([]byte, largeTransfer)})
	require.NoError(t, err)
	k.c.must(childRequest{Cmd: "wait-access", ID: r.ID})
	if k.op.Status() != StatusInProgress {
		return k, false
	}
	return k, k.stop(t, ctx, stop, fmt.Sprintf("%v failed", kind), "passive process "+how)
}

// cutActive makes the child active: this process exposes memory for kind,
// the child begins the transfer, and the child is stopped (see cut.stop)
// once bytes move. It returns false if the transfer finished first. opts
// and env configure the parent's Connector and the child.
func cutActive(t *testing.T, kind OperationKind, stop func(*child), how string, opts []Option, env ...string) (cut, bool) {
	t.Helper()
	// A generous bound: the loss must come well before it.
	ctx := guarded(t)
	k := cut{parent: newConnector(t, opts...), c: startChild(t, env...)}
	pop := expose(t, k.parent, kind, pattern.NewSlab([]int{largeTransfer}).Bufs())
	k.op = pop
	k.c.must(childRequest{Cmd: "begin", Token: pop.Metadata().Text(), Async: true})
	awaitPeer(t, pop)
	return k, k.stop(t, ctx, stop, fmt.Sprintf("passive %v heard", kind), "active process "+how)
}

// stop stops the child with stop and awaits the parent's operation, which
// must then fail with ErrRemoteLost within lostWithin; it logs "heard <time>
// after the <what>". It returns false if the operation completed instead.
func (k *cut) stop(t *testing.T, ctx context.Context, stop func(*child), heard, what string) bool {
	t.Helper()
	start := time.Now()
	stop(k.c)
	k.err = k.op.Wait(ctx)
	lost := time.Since(start)
	if k.err == nil {
		return false // it finished before the stop
	}
	t.Logf("%s %v after the %s: %v", heard, lost, what, k.err)
	require.ErrorIs(t, k.err, ErrRemoteLost)
	assert.LessOrEqual(t, lost, lostWithin, "time to report the lost peer")
	return true
}

// requireErrored checks that the parent's operation errored with a
// *TransferError that names the child, and returns it.
func (k *cut) requireErrored(t *testing.T) *TransferError {
	t.Helper()
	var te *TransferError
	require.ErrorAs(t, k.err, &te)
	assert.Equal(t, k.c.agent, te.Peer.String())
	assert.Equal(t, StatusErrored, k.op.Status())
	return te
}

func TestCrossProcessPassiveKilled(t *testing.T) {
	retryKinds(t, "", func(t *testing.T, kind OperationKind) bool {
		k, hit := cutPassive(t, kind, (*child).Kill, "was killed", nil)
		if hit {
			assert.Equal(t, sameHost, k.requireErrored(t).Backend)
			requireUnregistered(t, k.parent)
		}
		return hit
	})
}

func TestCrossProcessActiveKilled(t *testing.T) {
	retryKinds(t, "", func(t *testing.T, kind OperationKind) bool {
		k, hit := cutActive(t, kind, (*child).Kill, "was killed", nil)
		if hit {
			k.requireErrored(t)
		}
		return hit
	})
}

func TestCrossProcessActiveCancelled(t *testing.T) {
	retryKinds(t, "", func(t *testing.T, kind OperationKind) bool {
		ctx := guarded(t)
		parent := newConnector(t)
		c := startChild(t)
		seed := pattern.NextSeed()
		mem := pattern.NewSlab([]int{stopTransfer})
		mem.Fill(seed)
		pop := expose(t, parent, kind, mem.Bufs())
		r := c.must(childRequest{Cmd: "begin", Token: pop.Metadata().Text(), Seed: seed, Async: true})
		assert.Equal(t, "PROC", r.Status, "the child's operation after Begin")
		assert.Equal(t, sameHost, r.Backend)
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
		resp := c.Do(childRequest{Cmd: "cancel", ID: r.ID})
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
		assert.Equal(t, c.agent, te.Peer.String())
		assert.Equal(t, StatusCancelled, pop.Status())
		assert.LessOrEqual(t, heard, lostWithin, "time to hear of the cancel")
		return true
	})
}

func TestCrossProcessClosedPassive(t *testing.T) {
	ctx := guarded(t)
	parent := newConnector(t)
	c := startChild(t)
	sizes := []int{4096, 100000, 3}
	for _, kind := range kinds {
		t.Run(kind.String(), func(t *testing.T) {
			seed := pattern.NextSeed()
			mem := pattern.NewSlab(sizes)
			mem.Fill(seed)
			pop := expose(t, parent, kind, mem.Bufs())
			token := pop.Metadata().Text()
			require.NoError(t, pop.Close())
			require.ErrorIs(t, pop.Wait(ctx), ErrClosed)
			requireUnregistered(t, parent)

			// The child's WRITE carries other bytes than the parent holds.
			resp := c.Do(childRequest{Cmd: "begin", Token: token, Seed: seed + 1<<32})
			err := resp.err()
			require.ErrorIs(t, err, ErrAccessDenied)
			var te *TransferError
			require.ErrorAs(t, err, &te)
			assert.Equal(t, sameHost, te.Backend)
			assert.Equal(t, parent.a.ID(), te.Peer)
			assert.Equal(t, "ERR", resp.Status)
			assert.Empty(t, resp.Check, "the guards around the child's local memory")
			assert.Empty(t, resp.Touched, "the child's local memory")
			require.NoError(t, mem.Check(seed), "the parent's memory")
		})
	}
}

// Closing a passive operation in the middle of a peer's transfer revokes
// access: once Close returns, the peer touches the memory no more, so it may
// be reused, and the peer's transfer fails with ErrAccessDenied. The race
// detector watches the reuse.
func TestCrossProcessCloseMidTransfer(t *testing.T) {
	retryKinds(t, "", func(t *testing.T, kind OperationKind) bool {
		parent := newConnector(t)
		c := startChild(t)
		seed := pattern.NextSeed()
		mem := pattern.NewSlab([]int{stopTransfer})
		pop := expose(t, parent, kind, mem.Bufs())
		r := c.must(childRequest{Cmd: "begin", Token: pop.Metadata().Text(), Seed: seed, Async: true})
		awaitPeer(t, pop)
		require.NoError(t, pop.Close())
		// The memory is ours again: reuse it while the child's
		// transfer may still run.
		mem.Fill(seed + 1<<32)

		resp := c.Do(childRequest{Cmd: "await", ID: r.ID})
		if resp.Err == "" {
			return false // it finished before the Close
		}
		t.Logf("the child's %v after the parent's Close: %v", kind, resp.Err)
		require.ErrorIs(t, resp.err(), ErrAccessDenied)
		assert.Empty(t, resp.Check, "the guards around the child's local memory")
		require.NoError(t, mem.Check(seed+1<<32), "memory reused after Close")
		requireUnregistered(t, parent)
		return true
	})
}
