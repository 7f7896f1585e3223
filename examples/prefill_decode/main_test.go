package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// The tests run the example as the user does: this test binary, with
// envRunMain set, is the example's main, which starts the workers by
// re-executing itself.
func TestMain(m *testing.M) {
	if os.Getenv(envRunMain) == "1" {
		main()
	}
	os.Exit(m.Run())
}

// small keeps the KV cache of a request small (2 layers × K,V × 4 blocks of
// 4 KiB), so that the tests stay fast under the race detector.
var small = []string{"-layers", "2", "-kv-heads", "2", "-head-dim", "64", "-prompt-tokens", "64"}

// example is the example running as a child process.
type example struct {
	t    *testing.T
	cmd  *exec.Cmd
	mu   sync.Mutex
	out  bytes.Buffer  // stdout and stderr, as they come
	line chan string   // every line, for tests that watch progress; dropped when nobody reads
	done chan struct{} // closed once it has exited
	err  error
}

// start runs the example with args.
func start(t *testing.T, args ...string) *example {
	t.Helper()
	e := &example{t: t, line: make(chan string, 1024), done: make(chan struct{})}
	e.cmd = exec.Command(os.Args[0], args...)
	e.cmd.Env = append(os.Environ(), envRunMain+"=1")
	r, w, err := os.Pipe()
	require.NoError(t, err)
	e.cmd.Stdout, e.cmd.Stderr = w, w
	require.NoError(t, e.cmd.Start())
	w.Close()
	go func() {
		defer close(e.done)
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			e.mu.Lock()
			e.out.WriteString(sc.Text() + "\n")
			e.mu.Unlock()
			select {
			case e.line <- sc.Text():
			default:
			}
		}
		e.err = e.cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = e.cmd.Process.Kill() // its workers get SIGTERM from the kernel (Pdeathsig)
		<-e.done
		if t.Failed() {
			t.Logf("output of %v:\n%s", args, e.output())
		}
	})
	return e
}

func (e *example) output() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.out.String()
}

// wait waits for the example to exit and returns its exit status.
func (e *example) wait() int {
	e.t.Helper()
	select {
	case <-e.done:
	case <-time.After(45 * time.Second):
		e.t.Fatalf("the example did not exit within 45s")
	}
	var exit *exec.ExitError
	if errors.As(e.err, &exit) {
		return exit.ExitCode()
	}
	require.NoError(e.t, e.err)
	return 0
}

// await waits for a line matching re and returns it.
func (e *example) await(re string) string {
	e.t.Helper()
	rx := regexp.MustCompile(re)
	timeout := time.After(30 * time.Second)
	for {
		select {
		case l := <-e.line:
			if rx.MatchString(l) {
				return l
			}
		case <-e.done:
			e.t.Fatalf("the example exited before printing a line matching %q", re)
		case <-timeout:
			e.t.Fatalf("no line matching %q within 30s", re)
		}
	}
}

// run runs the example with args to the end.
func run1(t *testing.T, args ...string) (int, string) {
	t.Helper()
	e := start(t, args...)
	code := e.wait()
	return code, e.output()
}

// requireAllVerified checks that each of n requests was printed verified,
// and the summary says so.
func requireAllVerified(t *testing.T, out string, n int) {
	t.Helper()
	for i := 1; i <= n; i++ {
		assert.Regexp(t, fmt.Sprintf(`(?m)^\[decode\] req +%d/%d .* verified$`, i, n), out)
	}
	assert.Contains(t, out, fmt.Sprintf("summary: %d of %d requests verified, 0 mismatched, 0 failed, 0 not run", n, n))
	assert.Contains(t, out, "every request completed and every byte verified")
	assert.NotContains(t, out, "MISMATCH")
}

// The main job, end to end in both modes: embedded NATS server, a prefill
// and a decode worker in processes of their own, every byte checked.
func TestEndToEnd(t *testing.T) {
	for _, mode := range []string{"read", "write"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			code, out := run1(t, append([]string{"-mode", mode, "-requests", "6"}, small...)...)
			require.Equal(t, 0, code, "exit status")
			requireAllVerified(t, out, 6)
			assert.Contains(t, out, "nats: embedded server")
			assert.Contains(t, out, strings.ToUpper(mode)+" mode")
			// Two processes on one host: cma where the kernel allows it.
			backend := `(cma|tcp)`
			if runtime.GOOS != "linux" {
				backend = "tcp"
			}
			if mode == "read" {
				assert.Regexp(t, `backend=`+backend, out)
			} else {
				assert.Regexp(t, `\[prefill\] request .*: wrote 16 blocks .* via `+backend, out)
			}
		})
	}
}

// The NATS server restarts while requests are in flight: the workers
// reconnect, requests whose messages were lost are retried under the same
// ID, and every request still completes, verified.
func TestNATSServerRestart(t *testing.T) {
	for _, mode := range []string{"read", "write"} {
		t.Run(mode, func(t *testing.T) {
			srv, err := natsserver.Start(natsserver.WithStoreDir(t.TempDir()))
			require.NoError(t, err)
			t.Cleanup(srv.Shutdown)

			const n = 40
			e := start(t, append([]string{"-nats", srv.URL(), "-mode", mode, "-requests", strconv.Itoa(n),
				"-decode-time", "25ms", "-attempt-timeout", "1s"}, small...)...)
			e.await(`^\[decode\] req +\d+/\d+ .* verified$`)
			require.NoError(t, srv.Restart())
			mark := len(e.output())
			t.Log("NATS server restarted")

			require.Equal(t, 0, e.wait(), "exit status")
			out := e.output()
			requireAllVerified(t, out, n)
			assert.Contains(t, out, "nats: reconnected")
			// The restart hit the run in its middle: requests were still
			// verified after it.
			assert.Regexp(t, `(?m)^\[decode\] req +\d+/\d+ .* verified$`, out[mark:])
		})
	}
}

// The workers run one at a time with -role, as on two hosts: a decode
// worker finds the prefill worker through NATS, one with another model is
// told so, and the prefill worker stops cleanly on SIGTERM.
func TestSeparateWorkers(t *testing.T) {
	srv, err := natsserver.Start()
	require.NoError(t, err)
	t.Cleanup(srv.Shutdown)

	prefill := start(t, append([]string{"-role", "prefill", "-nats", srv.URL()}, small...)...)
	prefill.await(`ready: READ requests`)

	code, out := run1(t, append([]string{"-role", "decode", "-nats", srv.URL(), "-requests", "3", "-mode", "write"}, small...)...)
	assert.Equal(t, 0, code, "exit status")
	assert.Contains(t, out, "summary: 3 of 3 requests verified, 0 mismatched")

	code, out = run1(t, "-role", "decode", "-nats", srv.URL(), "-layers", "3", "-kv-heads", "2", "-head-dim", "64", "-prompt-tokens", "64")
	assert.Equal(t, 1, code, "exit status")
	assert.Regexp(t, `serves the model 2 layers .*; this decode worker expects 3 layers .*: give both the same model flags`, out)

	require.NoError(t, prefill.cmd.Process.Signal(syscall.SIGTERM))
	assert.Equal(t, 0, prefill.wait(), "exit status of a prefill worker told to stop")
	assert.Contains(t, prefill.output(), "stopped: 3 hand-offs served, 0 failed")
}

// A decode worker alone, with no prefill worker to answer, gives up after
// -wait with an error that says what is missing.
func TestDecodeWithoutPrefill(t *testing.T) {
	srv, err := natsserver.Start()
	require.NoError(t, err)
	t.Cleanup(srv.Shutdown)

	start := time.Now()
	code, out := run1(t, append([]string{"-role", "decode", "-nats", srv.URL(), "-wait", "1s"}, small...)...)
	assert.Equal(t, 1, code, "exit status")
	assert.Contains(t, out, `no prefill worker answered on "goxfer.example.prefill.hello" within 1s`)
	assert.Contains(t, out, "start one with -role prefill")
	assert.Less(t, time.Since(start), 20*time.Second)
}

// One byte flipped on the prefill side is caught on the decode side, named
// down to the block and byte, and fails the run.
func TestMismatchDetected(t *testing.T) {
	t.Parallel()
	code, out := run1(t, append([]string{"-requests", "3", "-x-corrupt-block", "5"}, small...)...)
	assert.Equal(t, 1, code, "exit status")
	// Descriptor 5 is layer 0's V block 1 (4 blocks of K, then 4 of V).
	assert.Regexp(t, `req \d/3 .* MISMATCH: request \S+-\d: 1 of 16 blocks differ; first: layer 0 V block 1 \(descriptor 5\), byte 2048 of 4096: got 0x[0-9a-f]{2}, want 0x[0-9a-f]{2}`, out)
	assert.Contains(t, out, "summary: 2 of 3 requests verified, 1 mismatched")
	assert.Contains(t, out, "differ from what prefill computed")
	assert.NotContains(t, out, "every byte verified")
}

// Ctrl-C: the orchestrator passes the signal on, everything shuts down in
// order, it exits with status 130 and no worker outlives it.
func TestInterrupt(t *testing.T) {
	t.Parallel()
	e := start(t, append([]string{"-requests", "100000", "-decode-time", "10ms"}, small...)...)
	pids := regexp.MustCompile(`pid (\d+)\) and the decode worker \(pid (\d+)\)`).FindStringSubmatch(e.await(`started the prefill worker`))
	require.Len(t, pids, 3)
	e.await(`^\[decode\] req +\d+/\d+ .* verified$`)
	require.NoError(t, e.cmd.Process.Signal(os.Interrupt))
	assert.Equal(t, 130, e.wait(), "exit status")
	out := e.output()
	assert.Contains(t, out, "orchestrator: interrupt: shutting down")
	assert.Contains(t, out, "[decode] decode: interrupt: shutting down")
	assert.Contains(t, out, "[prefill] stopped:")
	assert.NotContains(t, out, "MISMATCH")
	for _, p := range pids[1:] {
		pid, _ := strconv.Atoi(p)
		assert.ErrorIs(t, syscall.Kill(pid, 0), syscall.ESRCH, "worker pid %d still exists", pid)
	}
}

// Bad flags are refused before anything starts, with exit status 2.
func TestBadFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-mode", "sideways"}, `-mode "sideways": want read or write`},
		{[]string{"-role", "decode"}, "-role decode needs -nats"},
		{[]string{"-role", "both", "-nats", "nats://x"}, `-role "both": want prefill or decode`},
		{[]string{"-dtype", "int4"}, `dtype "int4": want fp32, fp16, bf16 or fp8`},
		{[]string{"-prompt-tokens", "0"}, "prompt of 0 tokens: want 1 to"},
		{[]string{"-concurrency", "0"}, "-concurrency 0: want 1 to 64"},
		{[]string{"extra"}, "unexpected arguments"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			assert.Equal(t, 2, run(tc.args, &stdout, &stderr))
			assert.Contains(t, stderr.String(), tc.want)
			assert.Contains(t, stderr.String(), "Usage: prefill_decode")
			assert.NotContains(t, stderr.String(), "x-corrupt-block", "test hooks stay out of -help")
		})
	}
}

func TestLayout(t *testing.T) {
	l, err := llama3_8B.LayoutFor(512)
	require.NoError(t, err)
	assert.Equal(t, 32<<10, l.BlockBytes())
	assert.Equal(t, 32, l.BlocksPerSeq)
	assert.Equal(t, 2048, l.Blocks())
	assert.Equal(t, int64(64<<20), l.Bytes())
	assert.Equal(t, BlockID{Layer: 0, V: false, Block: 0}, l.Locate(0))
	assert.Equal(t, BlockID{Layer: 0, V: true, Block: 1}, l.Locate(33))
	assert.Equal(t, BlockID{Layer: 31, V: true, Block: 31}, l.Locate(2047))
	assert.Equal(t, "layer 31 V block 31", l.Locate(2047).String())

	l, err = llama3_8B.LayoutFor(17) // a partial last block still takes a block
	require.NoError(t, err)
	assert.Equal(t, 2, l.BlocksPerSeq)
}

// Filling and checking: equal for the same request, different for another
// request or another block, and a single flipped byte is found, also in a
// block whose size is no multiple of 8.
func TestFillVerify(t *testing.T) {
	m := Model{Layers: 2, KVHeads: 1, HeadDim: 3, BlockTokens: 5, DType: "fp8"} // 15-byte blocks
	l, err := m.LayoutFor(12)
	require.NoError(t, err)
	pool := NewPool(2*l.Blocks(), m.BlockBytes())
	a, err := pool.Alloc(context.Background(), l.Blocks())
	require.NoError(t, err)
	FillKV(l, "run-1", a)
	require.NoError(t, VerifyKV(l, "run-1", a))
	assert.Error(t, VerifyKV(l, "run-2", a), "another request's content")
	assert.NotEqual(t, a.Buf(0), a.Buf(1), "blocks differ")

	a.Buf(7)[14] ^= 1
	var mm *MismatchError
	require.ErrorAs(t, VerifyKV(l, "run-1", a), &mm)
	assert.Equal(t, 7, mm.Descriptor)
	assert.Equal(t, l.Locate(7), mm.Block)
	assert.Equal(t, 14, mm.Offset)
	assert.Equal(t, 1, mm.Blocks)
	assert.Equal(t, mm.Want^1, mm.Got)
}

func TestPoolAllocWaitsForRelease(t *testing.T) {
	pool := NewPool(4, 8)
	a, err := pool.Alloc(context.Background(), 3)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err = pool.Alloc(ctx, 2)
	require.ErrorIs(t, err, context.DeadlineExceeded, "only one block is free")

	got := make(chan *Blocks)
	go func() {
		b, err := pool.Alloc(context.Background(), 4)
		assert.NoError(t, err)
		got <- b
	}()
	a.Release()
	a.Release() // idempotent
	b := <-got
	assert.Equal(t, 4, b.Len())

	_, err = pool.Alloc(context.Background(), 5)
	assert.ErrorContains(t, err, "want 5 blocks, the pool holds only 4")
}
