//go:build linux

package connect

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/shm"
	"github.com/goxfer/goxfer/internal/pattern"
	"github.com/goxfer/goxfer/internal/testproc"
)

// Shared host memory across processes (docs/shm.md): a child whose exposed
// memory comes from AllocHost is read and written through the parent's
// mapping of it (path "cma+shm"), and the mapping's lifetime follows the
// exposure's: revoked by Close, gone with a killed peer.

// shmChildEnv, when set, makes the test binary a child process like
// runChild's that also exposes shared host memory: besides every command of
// childRequest it serves
//
//	expose-shm kind sizes seed -> ID, Token: as expose, the memory from
//	                              AllocHost, one segment
//	free       ID              -> Free's result for that memory, once
//	                              closed
//
// It is dispatched from init, before TestMain: TestMain knows runChild's
// environment variable only.
const shmChildEnv = "GOXFER_CONNECT_SHM_CHILD"

func init() {
	if os.Getenv(shmChildEnv) != "" {
		os.Exit(runShmChild(os.Stdin, os.Stdout))
	}
}

// shmServer is childServer with memory from AllocHost.
type shmServer struct {
	*childServer
	bufs map[int]*shm.Buffer
}

func runShmChild(in io.Reader, out io.Writer) int {
	c, err := NewConnector(WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))))
	if err != nil {
		fmt.Fprintln(os.Stderr, "connect shm child: NewConnector:", err)
		return 2
	}
	s := &shmServer{
		childServer: &childServer{c: c, passive: map[int]*childPassive{}, active: map[int]*childActive{}},
		bufs:        map[int]*shm.Buffer{},
	}
	code := 0
	if err := testproc.Serve(in, out, func(req childRequest) (childResponse, bool) { return s.handle(req), false }, failed); err != nil {
		fmt.Fprintln(os.Stderr, "connect shm child:", err)
		code = 2
	}
	for _, a := range s.active {
		a.cancel()
	}
	if err := c.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "connect shm child: Close:", err)
		code = 2
	}
	return code
}

func (s *shmServer) handle(req childRequest) childResponse {
	switch req.Cmd {
	case "expose-shm":
		ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
		defer cancel()
		buf, err := s.c.AllocHost(slabSize(req.Sizes))
		if err != nil {
			return failed(err)
		}
		mem := pattern.NewSlabIn(func(int) []byte { return buf.Bytes() }, req.Sizes)
		mem.Fill(req.Seed)
		op, err := createOp(ctx, s.c, req.Kind, mem.Bufs())
		if err != nil {
			return failed(errors.Join(err, buf.Free()))
		}
		s.last++
		s.passive[s.last] = &childPassive{op: op, mem: mem}
		s.bufs[s.last] = buf
		return childResponse{ID: s.last, Token: op.Metadata().Text()}
	case "free":
		buf, ok := s.bufs[req.ID]
		if !ok {
			return failed(fmt.Errorf("free: no shared memory %d", req.ID))
		}
		if _, open := s.passive[req.ID]; open {
			return failed(fmt.Errorf("free: operation %d is not closed", req.ID))
		}
		delete(s.bufs, req.ID)
		return failed(buf.Free())
	}
	return s.childServer.handle(req)
}

// createOp exposes bufs for kind.
func createOp(ctx context.Context, c *Connector, kind OperationKind, bufs [][]byte) (waiter, error) {
	if kind == KindWrite {
		return c.CreateWritable(ctx, descriptors(bufs)...)
	}
	return c.CreateReadable(ctx, descriptors(bufs)...)
}

// slabSize is the size of a pattern.Slab of descriptors of sizes.
func slabSize(sizes []int) int {
	n := pattern.GuardLen
	for _, size := range sizes {
		n += size + pattern.GuardLen
	}
	return n
}

// startShmChild starts a child process that serves shmServer's commands;
// it ends when the test does.
func startShmChild(t *testing.T) *child {
	t.Helper()
	gorace := strings.TrimSpace(os.Getenv("GORACE") + " atexit_sleep_ms=0")
	c := &child{t: t, Child: testproc.Start[childRequest, childResponse](t, shmChildEnv, testproc.Options{
		Env:          []string{"GORACE=" + gorace},
		AnswerWithin: hangGuard + 5*time.Second,
		ExitWithin:   hangGuard,
	})}
	c.agent = c.must(childRequest{Cmd: "id"}).Agent
	return c
}

// sharedSlab returns a Slab in memory from c.AllocHost, freed when the test
// ends; the test must have closed everything that uses it by then.
func sharedSlab(t *testing.T, c *Connector, sizes []int) *pattern.Slab {
	t.Helper()
	buf, err := c.AllocHost(slabSize(sizes))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, buf.Free(), "freeing the parent's shared memory") })
	return pattern.NewSlabIn(func(int) []byte { return buf.Bytes() }, sizes)
}

// pathed is an active operation that tells its path.
type pathed interface {
	active
	Path() string
}

// requireCMA skips the test where transfers between two processes do not
// go over cma (ptrace restrictions, containers): the shared-memory path is
// cma's.
func requireCMA(t *testing.T, op active) {
	t.Helper()
	if op.Backend() != "cma" {
		t.Skipf("transfers between two processes go over %s here, not cma (see docs/cma.md)", op.Backend())
	}
}

func TestShmCrossProcessTransfer(t *testing.T) {
	layouts := []struct {
		name  string
		sizes []int
	}{
		{"1 descriptor", []int{5<<20 + 3}}, // more than the 1 MiB copied inline
		{"4096x4KiB", uniform(4096, 4<<10)},
		{"odd sizes", []int{1, 7, 4095, 65537, 1<<20 + 3, 333, 2}},
	}
	ctx := guarded(t)
	parent := newConnector(t)
	c := startShmChild(t)

	// The child exposes shared memory: the parent copies through its
	// mapping, whatever its own memory.
	for _, local := range []string{"heap", "shm"} {
		for _, kind := range kinds {
			for _, l := range layouts {
				t.Run("child shm/local "+local+"/"+kind.String()+"/"+l.name, func(t *testing.T) {
					seed := pattern.NextSeed()
					exposed := seed
					if kind == KindWrite {
						exposed = 0
					}
					r := c.must(childRequest{Cmd: "expose-shm", Kind: kind, Sizes: l.sizes, Seed: exposed})
					md, err := ParseMetadata(r.Token)
					require.NoError(t, err)

					mem := pattern.NewSlab(l.sizes)
					if local == "shm" {
						mem = sharedSlab(t, parent, l.sizes)
					}
					if kind == KindWrite {
						mem.Fill(seed)
					}
					op := moved(t, ctx, parent, md, mem.Bufs())
					requireCMA(t, op)
					assert.Equal(t, "cma+shm", op.(pathed).Path())
					require.NoError(t, mem.Check(seed), "the parent's memory after its %v", kind)
					requireUnregistered(t, parent)

					w := c.must(childRequest{Cmd: "wait", ID: r.ID})
					assert.Equal(t, "DONE", w.Status)
					c.must(childRequest{Cmd: "verify", ID: r.ID, Seed: seed})
					c.must(childRequest{Cmd: "close", ID: r.ID})
					c.must(childRequest{Cmd: "free", ID: r.ID})
				})
			}
		}
	}

	// The child's exposed memory is the Go heap: cma's leases, even with
	// the parent's own memory shared.
	for _, kind := range kinds {
		t.Run("child heap/local shm/"+kind.String(), func(t *testing.T) {
			sizes := layouts[2].sizes
			seed := pattern.NextSeed()
			exposed := seed
			if kind == KindWrite {
				exposed = 0
			}
			r := c.must(childRequest{Cmd: "expose", Kind: kind, Sizes: sizes, Seed: exposed})
			md, err := ParseMetadata(r.Token)
			require.NoError(t, err)
			mem := sharedSlab(t, parent, sizes)
			if kind == KindWrite {
				mem.Fill(seed)
			}
			op := moved(t, ctx, parent, md, mem.Bufs())
			requireCMA(t, op)
			assert.Equal(t, "cma", op.(pathed).Path())
			require.NoError(t, mem.Check(seed), "the parent's memory after its %v", kind)
			c.must(childRequest{Cmd: "wait", ID: r.ID})
			c.must(childRequest{Cmd: "verify", ID: r.ID, Seed: seed})
			c.must(childRequest{Cmd: "close", ID: r.ID})
		})
	}
	// Every exposure closed, every buffer freed: no segment stays mapped.
	requireUnmapped(t, false)
}

// A child killed while the parent copies through its shared memory: the
// parent's mapping keeps the pages alive, and the transfer fails with
// ErrRemoteLost (the peer's connection ended) in bounded time, or succeeds
// if it finished first; it never hangs.
func TestShmCrossProcessPassiveKilled(t *testing.T) {
	// A copy through shared memory takes no lease the child could see, and
	// needs nothing of the child's process while it runs: the kill is
	// noticed only once the killed process's memory is torn down and its
	// socket closes, and a 256 MiB copy often ends first. Either outcome is
	// right: it fails with ErrRemoteLost in time, or it finished through
	// the mapping (the bytes of a process that is gone by now). Never a
	// hang, and the peer's segment and lease table go with its connection.
	lost := 0
	for attempt := range 6 {
		for _, kind := range kinds {
			ctx := guarded(t)
			k := cut{parent: newConnector(t), c: startShmChild(t)}
			r := k.c.must(childRequest{Cmd: "expose-shm", Kind: kind, Sizes: []int{largeTransfer}})
			md, err := ParseMetadata(r.Token)
			require.NoError(t, err)
			op, err := begin(ctx, k.parent, md, [][]byte{make([]byte, largeTransfer)})
			require.NoError(t, err)
			k.op = op
			time.Sleep(time.Duration(attempt%3) * time.Millisecond)
			if k.stop(t, ctx, (*child).Kill, fmt.Sprintf("%v failed", kind), "passive process was killed") {
				assert.Equal(t, "cma", k.requireErrored(t).Backend)
				lost++
			} else {
				requireCMA(t, op)
			}
			requireUnregistered(t, k.parent)
			requireUnmapped(t, true)
		}
	}
	t.Logf("%d of %d transfers failed with ErrRemoteLost; the others finished first", lost, 6*len(kinds))
}

// Closing an exposure of shared memory while the parent reads it in a loop
// revokes it: every read begun after Close returned fails with
// ErrAccessDenied, and the child may then free the memory.
func TestShmCrossProcessCloseWhileReading(t *testing.T) {
	ctx := guarded(t)
	parent := newConnector(t)
	c := startShmChild(t)
	sizes := []int{256 << 10, 3, 1 << 20}
	seed := pattern.NextSeed()
	r := c.must(childRequest{Cmd: "expose-shm", Kind: KindRead, Sizes: sizes, Seed: seed})
	md, err := ParseMetadata(r.Token)
	require.NoError(t, err)

	// closed is set once the child's Close returned; reads begun after it
	// count in after.
	type result struct {
		err   error
		after bool
		path  string
		check error
	}
	var (
		closedMu sync.Mutex
		closed   bool
	)
	isClosed := func() bool {
		closedMu.Lock()
		defer closedMu.Unlock()
		return closed
	}
	results := make(chan result, 16)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		defer close(results)
		for {
			select {
			case <-stop:
				return
			default:
			}
			after := isClosed()
			mem := pattern.NewSlab(sizes)
			op, err := begin(ctx, parent, md, mem.Bufs())
			res := result{after: after}
			if err == nil {
				err = op.Wait(ctx)
				res.path = op.(pathed).Path()
			}
			res.err = err
			if err == nil {
				res.check = mem.Check(seed)
			} else {
				res.check = mem.CheckGuards()
			}
			select {
			case results <- res:
			case <-stop:
				return
			}
		}
	})
	t.Cleanup(func() {
		close(stop)
		wg.Wait()
	})

	const (
		before = 5 // reads that succeed before the Close
		denied = 5 // reads begun after it, all refused
	)
	var ok, refused int
	for res := range results {
		require.NoError(t, res.check, "the parent's memory after a read (error %v)", res.err)
		switch {
		case res.after:
			require.ErrorIs(t, res.err, ErrAccessDenied, "a read begun after the child's Close returned")
			refused++
		case res.err == nil:
			if res.path != "cma+shm" {
				if res.path == "tcp" {
					t.Skip("transfers between two processes go over tcp here, not cma (see docs/cma.md)")
				}
				require.Equal(t, "cma+shm", res.path)
			}
			ok++
		default:
			// Begun before the Close returned: it may lose the race.
			require.ErrorIs(t, res.err, ErrAccessDenied, "a read racing the child's Close")
		}
		if ok == before && !isClosed() {
			c.must(childRequest{Cmd: "close", ID: r.ID})
			closedMu.Lock()
			closed = true
			closedMu.Unlock()
			// Nothing holds the memory any more: the child frees it while
			// the parent keeps trying.
			c.must(childRequest{Cmd: "free", ID: r.ID})
		}
		if refused == denied {
			break
		}
	}
	require.Equal(t, denied, refused, "reads refused after the Close")
	t.Logf("%d reads before the child's Close, %d refused after it", ok, refused)
	// The revoked mapping is dropped; the connection, and its lease
	// table, stay.
	requireUnmapped(t, false)
}

// requireUnmapped waits until this process maps no shared-memory segment
// (memfd:goxfer-shm), and with tables no lease table (memfd:goxfer-leases)
// either: a peer's mapping goes once the peer revoked it or its connection
// ended, each handled on a goroutine of the Connector.
func requireUnmapped(t *testing.T, tables bool) {
	t.Helper()
	var left []string
	mapped := func() bool {
		maps, err := os.ReadFile("/proc/self/maps")
		require.NoError(t, err)
		left = left[:0]
		for _, l := range strings.Split(string(maps), "\n") {
			if strings.Contains(l, "memfd:goxfer-shm") || tables && strings.Contains(l, "memfd:goxfer-leases") {
				left = append(left, l)
			}
		}
		return len(left) > 0
	}
	deadline := time.Now().Add(lostWithin)
	for mapped() && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	require.Empty(t, left, "shared memory still mapped %v later", lostWithin)
}
