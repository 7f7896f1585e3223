//go:build unix

// The example's tests drive its worker processes with Unix signals
// (SIGTERM to shut one down, SIGKILL to crash one): Unix only.
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

	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/connect"
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
	return startEnv(t, nil, args...)
}

// startEnv runs the example with args, and env added to its environment.
func startEnv(t *testing.T, env []string, args ...string) *example {
	t.Helper()
	e := &example{t: t, line: make(chan string, 1024), done: make(chan struct{})}
	e.cmd = exec.Command(os.Args[0], args...)
	e.cmd.Env = append(append(os.Environ(), envRunMain+"=1"), env...)
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
			// Two processes on one host: cma where the kernel allows it,
			// through its lease table or not.
			backend, path := `(cma|tcp)`, `(cma(\+table)?|tcp)`
			if runtime.GOOS != "linux" {
				backend, path = "tcp", "tcp"
			}
			if mode == "read" {
				assert.Regexp(t, `backend=`+backend+` path=`+path+`  verified`, out)
			} else {
				assert.Regexp(t, `\[prefill\] request .*: wrote 16 blocks .* via `+backend+`, path `+path+`\n`, out)
			}
			assert.Contains(t, out, "KV blocks: host memory, in both workers")
			assert.NotContains(t, out, "+staging", "host memory is never staged")
		})
	}
}

// devicePath is the path of a transfer that moved GPU memory between two
// processes on one host: staged through pinned host buffers by cma or tcp,
// or over CUDA IPC.
const devicePath = `(cma|tcp)\+(staging|ipc)`

// With -device sim both workers keep their KV blocks in simulated GPU
// memory: every transfer says it moved device memory, and decode verifies
// every byte after copying its blocks back to host memory.
func TestEndToEndDeviceSim(t *testing.T) {
	for _, mode := range []string{"read", "write"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			const n = 6
			// GOXFER_DEVICE empty: the orchestrator's -device sim alone must
			// put the workers on the simulator.
			e := startEnv(t, []string{"GOXFER_DEVICE="}, append([]string{"-device", "sim", "-mode", mode, "-requests", strconv.Itoa(n)}, small...)...)
			require.Equal(t, 0, e.wait(), "exit status")
			out := e.output()
			requireAllVerified(t, out, n)
			const where = "GPU memory on cuda:0, simulated (GOXFER_DEVICE=sim)"
			assert.Contains(t, out, "KV blocks: "+where+", in both workers")
			assert.Regexp(t, `\[prefill\] agent \S+ ready: .* KV pool of 64 blocks \(256 KiB\) in `+regexp.QuoteMeta(where)+`\n`, out)
			assert.Regexp(t, `\[decode\] agent \S+: KV pool of 32 blocks \(128 KiB\) in `+regexp.QuoteMeta(where)+`; waiting`, out)
			assert.Contains(t, out, "[decode]   KV blocks: "+where+" on both sides; every block copied back to host memory and checked")
			if mode == "read" {
				// Every request's line names the path, and it is a device path.
				assert.Len(t, regexp.MustCompile(`(?m)^\[decode\] req .* backend=(cma|tcp) path=`+devicePath+`  verified$`).FindAllString(out, -1), n)
				assert.Regexp(t, `transfer, BeginRead → Wait: .* backend (cma|tcp) ×6 \(path `+devicePath+`\)`, out)
			} else {
				assert.Len(t, regexp.MustCompile(`(?m)^\[prefill\] request \S+: wrote 16 blocks .* via (cma|tcp), path `+devicePath+`$`).FindAllString(out, -1), n)
			}
		})
	}
}

// One byte flipped on the prefill side before its blocks go into the
// (simulated) GPU is caught by decode once it copies its GPU blocks back:
// the check reads what is in device memory, not a host copy of the source.
func TestMismatchDetectedDeviceSim(t *testing.T) {
	t.Parallel()
	code, out := run1(t, append([]string{"-device", "sim", "-requests", "3", "-x-corrupt-block", "5"}, small...)...)
	assert.Equal(t, 1, code, "exit status")
	assert.Regexp(t, `req \d/3 .* path=`+devicePath+`  MISMATCH: request \S+-\d: 1 of 16 blocks differ; first: layer 0 V block 1 \(descriptor 5\), byte 2048 of 4096`, out)
	assert.Contains(t, out, "summary: 2 of 3 requests verified, 1 mismatched")
}

// The workers started alone with -role and -device sim, as on two hosts,
// with no orchestrator to set GOXFER_DEVICE for them: each selects the
// simulator itself. Then a decode worker in host memory: only prefill's
// side is GPU memory, and the path still says it was staged.
func TestSeparateWorkersDeviceSim(t *testing.T) {
	srv, err := natsserver.Start(t.Context())
	require.NoError(t, err)
	t.Cleanup(srv.Shutdown)

	noEnv := []string{"GOXFER_DEVICE=", "GOXFER_SIM_DEVICES=2"}
	prefill := startEnv(t, noEnv, append([]string{"-role", "prefill", "-nats", srv.URL(), "-device", "sim:1"}, small...)...)
	prefill.await(`ready: READ requests .* in GPU memory on cuda:1, simulated`)
	e := startEnv(t, noEnv, append([]string{"-role", "decode", "-nats", srv.URL(), "-requests", "3", "-device", "sim"}, small...)...)
	assert.Equal(t, 0, e.wait(), "exit status")
	out := e.output()
	assert.Contains(t, out, "summary: 3 of 3 requests verified, 0 mismatched")
	assert.Len(t, regexp.MustCompile(`(?m)^req .* path=`+devicePath+`  verified$`).FindAllString(out, -1), 3)

	host := startEnv(t, noEnv, append([]string{"-role", "decode", "-nats", srv.URL(), "-requests", "2", "-mode", "write"}, small...)...)
	assert.Equal(t, 0, host.wait(), "exit status")
	assert.Contains(t, host.output(), "summary: 2 of 2 requests verified, 0 mismatched")

	require.NoError(t, prefill.cmd.Process.Signal(syscall.SIGTERM))
	assert.Equal(t, 0, prefill.wait(), "exit status of a prefill worker told to stop")
	assert.Regexp(t, `request \S+: wrote 16 blocks .* path `+devicePath+`\n`, prefill.output(), "writing from GPU memory into host memory is staged too")
	assert.Contains(t, prefill.output(), "stopped: 5 hand-offs served, 0 failed")
}

// hasGPU reports whether this machine has a CUDA driver that sees a GPU.
func hasGPU() bool {
	n, err := devmem.CUDA().Devices()
	return err == nil && n > 0
}

// -device cuda on a machine without a GPU stops at once with one line that
// says what is missing and what to try, before NATS or a worker starts;
// a worker started alone does the same before it connects to NATS.
func TestDeviceCUDAWithoutGPU(t *testing.T) {
	if hasGPU() {
		t.Skip("this machine has a GPU")
	}
	want := `^prefill_decode: -device cuda(:0)?: (no CUDA driver on this machine \(.+\)|the CUDA driver sees no GPU on this machine); try -device sim\n$`
	for _, args := range [][]string{
		{"-device", "cuda"},
		{"-device", "cuda:0", "-mode", "write"},
		{"-role", "decode", "-nats", "nats://127.0.0.1:1", "-device", "cuda"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			start := time.Now()
			code, out := run1(t, args...)
			assert.Equal(t, 1, code, "exit status")
			assert.Regexp(t, want, out)
			assert.NotContains(t, out, "nats")
			assert.Less(t, time.Since(start), 10*time.Second)
		})
	}
}

// With a GPU, -device cuda moves the KV blocks between two processes' GPU
// memory, every byte verified. Skipped on machines without one.
func TestEndToEndDeviceCUDA(t *testing.T) {
	if !hasGPU() {
		t.Skip("no GPU on this machine: -device cuda is tested by TestDeviceCUDAWithoutGPU; -device sim by TestEndToEndDeviceSim")
	}
	for _, mode := range []string{"read", "write"} {
		t.Run(mode, func(t *testing.T) {
			code, out := run1(t, append([]string{"-device", "cuda", "-mode", mode, "-requests", "4"}, small...)...)
			require.Equal(t, 0, code, "exit status")
			requireAllVerified(t, out, 4)
			assert.Contains(t, out, "KV blocks: GPU memory on cuda:0 (CUDA driver), in both workers")
			if mode == "read" {
				assert.Len(t, regexp.MustCompile(`(?m)^\[decode\] req .* path=(`+devicePath+`|ucx)  verified$`).FindAllString(out, -1), 4)
			} else {
				assert.Len(t, regexp.MustCompile(`(?m)^\[prefill\] request \S+: wrote 16 blocks .* path (`+devicePath+`|ucx)$`).FindAllString(out, -1), 4)
			}
		})
	}
}

// A simulated GPU the simulator does not have is refused at once.
func TestDeviceSimNoSuchGPU(t *testing.T) {
	t.Parallel()
	code, out := run1(t, "-device", "sim:64") // GOXFER_SIM_DEVICES is at most 64
	assert.Equal(t, 1, code, "exit status")
	assert.Regexp(t, `^prefill_decode: -device sim:64: the simulator has \d+ GPUs?, sim:0 to sim:\d+ \(set GOXFER_SIM_DEVICES for more\)\n$`, out)
}

// The NATS server restarts while requests are in flight: the workers
// reconnect, requests whose messages were lost are retried under the same
// ID, and every request still completes, verified.
func TestNATSServerRestart(t *testing.T) {
	for _, mode := range []string{"read", "write"} {
		t.Run(mode, func(t *testing.T) {
			srv, err := natsserver.Start(t.Context(), natsserver.WithStoreDir(t.TempDir()))
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
	srv, err := natsserver.Start(t.Context())
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
	srv, err := natsserver.Start(t.Context())
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

// requireWorkerVerified checks that each of decode worker name's n
// requests was printed verified, and its summary says so.
func requireWorkerVerified(t *testing.T, out, name string, n int) {
	t.Helper()
	for i := 1; i <= n; i++ {
		assert.Regexp(t, fmt.Sprintf(`(?m)^\[%s\] req +%d/%d .* verified$`, name, i, n), out)
	}
	assert.Contains(t, out, fmt.Sprintf("[%s] summary: %d of %d requests verified, 0 mismatched, 0 failed, 0 not run", name, n, n))
}

// reportRow matches a worker's row of the orchestrator's report.
// A row ends with "N failed" when the worker failed hand-offs.
var reportRow = regexp.MustCompile(`(?m)^  (\S+) +agent [0-9a-f-]{36} +(\d+) requests +[\d.]+ req/s +[\d.]+ \S+ +[\d.]+ GB/s(?: +(\d+) failed)?$`)

// reportRows returns the requests of each worker's row of the report; a
// row that reports failed hand-offs fails the test, saying how many.
func reportRows(t *testing.T, out string) map[string]int {
	t.Helper()
	rows := map[string]int{}
	for _, m := range reportRow.FindAllStringSubmatch(out, -1) {
		n, err := strconv.Atoi(m[2])
		require.NoError(t, err)
		rows[m[1]] = n
		assert.Empty(t, m[3], "%s failed hand-offs", m[1])
	}
	return rows
}

// Scale-out on one host, in both modes: three prefill workers and two
// decode workers, each a process of its own. The decode workers split the
// requests, the queue group spreads them over every prefill worker, and
// the report gives each worker's share and the total; each worker serves
// its metrics on a port of its own.
func TestScaleOut(t *testing.T) {
	for _, mode := range []string{"read", "write"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			// 31 requests: decode-1 sends 16, decode-2 15. The chance that
			// the queue group leaves a prefill worker out is 3 × (2/3)^31,
			// about 1 in 100,000.
			const n = 31
			code, out := run1(t, append([]string{"-mode", mode, "-prefill", "3", "-decode", "2", "-requests", strconv.Itoa(n), "-metrics", "127.0.0.1:0"}, small...)...)
			require.Equal(t, 0, code, "exit status")
			requireWorkerVerified(t, out, "decode-1", 16)
			requireWorkerVerified(t, out, "decode-2", 15)
			assert.Contains(t, out, "every request completed and every byte verified")
			assert.NotContains(t, out, "MISMATCH")
			assert.Regexp(t, `started prefill-1 \(pid \d+\), prefill-2 \(pid \d+\), prefill-3 \(pid \d+\), decode-1 \(pid \d+\) and decode-2 \(pid \d+\)\n`, out)
			assert.Contains(t, out, "KV blocks: host memory, in every worker")

			// The report: a row for each worker, then the total.
			rows := reportRows(t, out)
			served := 0
			for i := 1; i <= 3; i++ {
				name := fmt.Sprintf("prefill-%d", i)
				assert.Positive(t, rows[name], "%s served no request", name)
				served += rows[name]
				assert.Regexp(t, fmt.Sprintf(`(?m)^\[%s\] stopped: %d hand-offs served, 0 failed; `, name, rows[name]), out)
				assert.Regexp(t, fmt.Sprintf(`(?m)^\[%s\] metrics: http://127\.0\.0\.1:\d+/metrics$`, name), out)
			}
			// A retried hand-off may be served twice; none is served less.
			assert.GreaterOrEqual(t, served, n)
			assert.Equal(t, 16, rows["decode-1"])
			assert.Equal(t, 15, rows["decode-2"])
			assert.Regexp(t, fmt.Sprintf(`(?m)^  total +%d requests +[\d.]+ req/s +[\d.]+ [KMG]iB +[\d.]+ GB/s$`, n), out)
			assert.Regexp(t, fmt.Sprintf(`(?m)^report: %d requests, [\d.]+ [KMG]iB of KV cache, in \S+ \(the decode workers' first request sent → last one done\): [\d.]+ req/s, [\d.]+ GB/s$`, n), out)
			for _, name := range []string{"decode-1", "decode-2"} {
				assert.Regexp(t, fmt.Sprintf(`(?m)^\[%s\] metrics: http://127\.0\.0\.1:\d+/metrics$`, name), out)
			}
			if mode == "read" {
				// Each decode worker saw who served its requests.
				assert.Regexp(t, `(?m)^\[decode-1\]   served by: prefill-\d \([0-9a-f]{8}\) ×\d+`, out)
			}
		})
	}
}

// A prefill worker of three killed in the middle of a run loses no
// request: a hand-off it held fails or times out and is tried again, and
// the queue group hands the retry to one of the other two. The run
// succeeds, and the report says the worker left no figures. Each request
// takes 100ms to prefill, so that the worker most likely holds some when
// it is killed (with 4 in flight, about 4 times in 5).
func TestScaleOutPrefillKilled(t *testing.T) {
	for _, mode := range []string{"read", "write"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			const n = 40
			e := start(t, append([]string{"-mode", mode, "-prefill", "3", "-decode", "2", "-requests", strconv.Itoa(n),
				"-prefill-time", "100ms", "-attempt-timeout", "1s"}, small...)...)
			pid := regexp.MustCompile(`prefill-2 \(pid (\d+)\)`).FindStringSubmatch(e.await(`^started prefill-1`))
			require.Len(t, pid, 2)
			e.await(`^\[decode-\d\] req +\d+/\d+ .* verified$`)
			p, _ := strconv.Atoi(pid[1])
			require.NoError(t, syscall.Kill(p, syscall.SIGKILL))
			t.Log("killed prefill-2")

			require.Equal(t, 0, e.wait(), "exit status")
			out := e.output()
			requireWorkerVerified(t, out, "decode-1", n/2)
			requireWorkerVerified(t, out, "decode-2", n/2)
			assert.Contains(t, out, "every request completed and every byte verified")
			killed := strings.Index(out, "prefill-2 ended early (signal: killed); the other 2 prefill workers take its requests\n")
			require.Positive(t, killed)
			assert.Regexp(t, `(?m)^\[decode-\d\] req +\d+/\d+ .* verified$`, out[killed:], "the kill hit the run in its middle")
			assert.Regexp(t, `(?m)^  prefill-2 +no report: it ended with signal: killed$`, out)
			rows := reportRows(t, out)
			assert.Positive(t, rows["prefill-1"]+rows["prefill-3"])
			assert.Regexp(t, fmt.Sprintf(`(?m)^  total +%d requests `, n), out)
			t.Logf("%d attempts failed and were tried again", strings.Count(out, " failed, trying again in "))
		})
	}
}

func TestShare(t *testing.T) {
	for _, tc := range []struct{ requests, n int }{{8, 1}, {31, 2}, {48, 2}, {10, 3}, {16, 16}} {
		sum := 0
		for i := range tc.n {
			s := share(tc.requests, i, tc.n)
			assert.InDelta(t, float64(tc.requests)/float64(tc.n), s, 1, "%d requests, worker %d of %d", tc.requests, i, tc.n)
			sum += s
		}
		assert.Equal(t, tc.requests, sum)
	}
	assert.Equal(t, 16, share(31, 0, 2))
	assert.Equal(t, 15, share(31, 1, 2))
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
		{[]string{"-device", "bogus"}, `invalid value "bogus" for flag -device: want host, cuda, cuda:N, sim or sim:N`},
		{[]string{"-device", "cuda:one"}, `invalid value "cuda:one" for flag -device: want host, cuda, cuda:N, sim or sim:N, N a GPU ordinal from 0; "one" is not one`},
		{[]string{"-device", "sim:-1"}, `invalid value "sim:-1" for flag -device`},
		{[]string{"-device", "host:0"}, `invalid value "host:0" for flag -device`},
		{[]string{"-prefill", "0"}, "-prefill 0 -decode 1: want 1 to 16 of each"},
		{[]string{"-decode", "17"}, "-prefill 1 -decode 17: want 1 to 16 of each"},
		{[]string{"-decode", "3", "-requests", "2"}, "-requests 2 -decode 3: want at least one request per decode worker"},
		{[]string{"-role", "prefill", "-nats", "nats://x", "-prefill", "2"}, "-prefill and -decode are the orchestrator's (no -role)"},
		{[]string{"-prefill", "16", "-decode", "16", "-concurrency", "8", "-requests", "16"}, "the workers' KV pools would take 24.0 GiB in all (16 prefill × 2 × 8 prompts + 16 decode × 8 prompts, of 64.0 MiB each)"},
		{[]string{"-prefill", "3", "-decode", "2", "-metrics", ":65532"}, "worker 4 would need port 65536"},
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
	require.NoError(t, FillKV(l, "run-1", a, nil))
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

// A pool in (simulated) GPU memory: its descriptors are device descriptors
// inside its one allocation, Fill and Inspect go through the driver's
// copies, VerifyKV checks what is in device memory, and Close frees it.
func TestDevicePool(t *testing.T) {
	sim := devmem.NewSim(2)
	m := Model{Layers: 2, KVHeads: 1, HeadDim: 3, BlockTokens: 5, DType: "fp8"} // 15-byte blocks
	l, err := m.LayoutFor(12)
	require.NoError(t, err)
	pool, err := NewDevicePool(sim, 1, 2*l.Blocks(), m.BlockBytes())
	require.NoError(t, err)
	require.True(t, pool.OnDevice())
	_, err = pool.Alloc(context.Background(), 3) // blocks 0-2: the next ones start further in
	require.NoError(t, err)
	a, err := pool.Alloc(context.Background(), l.Blocks())
	require.NoError(t, err)

	ds := a.Descriptors()
	require.Len(t, ds, l.Blocks())
	for i, d := range ds {
		assert.Equal(t, connect.CUDA(1), d.Device(), "descriptor %d", i)
		assert.Equal(t, m.BlockBytes(), d.Size())
		assert.Nil(t, d.Bytes(), "GPU memory has no host bytes")
		assert.NoError(t, sim.Check(a.ptr(i), uint64(m.BlockBytes()), 1), "descriptor %d lies in the pool's GPU memory", i)
	}
	assert.Panics(t, func() { a.Buf(0) }, "the CPU cannot address GPU memory")

	require.NoError(t, FillKV(l, "run-1", a, nil))
	require.NoError(t, VerifyKV(l, "run-1", a))
	assert.Error(t, VerifyKV(l, "run-2", a), "another request's content")

	// A byte changed in device memory, behind the pool's back, is found.
	b := make([]byte, m.BlockBytes())
	require.NoError(t, devmem.CopyToHost(sim, 1, b, a.ptr(7)))
	b[14] ^= 1
	require.NoError(t, devmem.CopyToDevice(sim, 1, a.ptr(7), b))
	var mm *MismatchError
	require.ErrorAs(t, VerifyKV(l, "run-1", a), &mm)
	assert.Equal(t, 7, mm.Descriptor)
	assert.Equal(t, 14, mm.Offset)
	assert.Equal(t, 1, mm.Blocks)
	assert.Equal(t, mm.Want^1, mm.Got)

	// The tamper hook changes the bytes before they reach the device.
	require.NoError(t, FillKV(l, "run-3", a, func(i int, buf []byte) {
		if i == 2 {
			buf[0] ^= 0x80
		}
	}))
	require.ErrorAs(t, VerifyKV(l, "run-3", a), &mm)
	assert.Equal(t, 2, mm.Descriptor)
	assert.Equal(t, 0, mm.Offset)

	ptr := a.ptr(0)
	a.Release()
	require.NoError(t, pool.Close())
	require.NoError(t, pool.Close(), "idempotent")
	assert.ErrorIs(t, sim.Check(ptr, 1, 1), devmem.ErrNotDevice, "Close frees the GPU memory")
	_, err = pool.Alloc(context.Background(), 1)
	assert.ErrorContains(t, err, "the KV pool is closed")

	_, err = NewDevicePool(sim, 2, 4, 8)
	assert.ErrorContains(t, err, "allocate a KV pool of 4 blocks (32 B) in the memory of GPU 2 (sim driver)")
}
