package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// ucx_perftest, UCX's own benchmark, run as two processes on loopback: the
// transport NIXL itself runs on. READ is ucp_get, WRITE ucp_put_bw.

type ucxRun struct {
	op    direction
	tls   string
	size  int
	iters int
}

func (in *initiator) ucxPlan() []ucxRun {
	if in.cfg.ucx == "off" {
		return nil
	}
	if _, err := exec.LookPath("ucx_perftest"); err != nil {
		in.baselineNotice["ucx_perftest"] = "not installed (apt-get install ucx-utils), not measured"
		return nil
	}
	var runs []ucxRun
	for _, op := range in.cfg.ops {
		for _, tls := range in.cfg.ucxTLS {
			for _, sh := range in.cfg.shapes {
				if sh.Descs != 1 {
					continue
				}
				// UCX's tcp get moves about 60 MB/s here: bound each run to
				// about 64 MiB.
				iters := int(min(max((64<<20)/sh.bytes(), 4), 1000))
				runs = append(runs, ucxRun{op: op, tls: tls, size: sh.Block, iters: iters})
			}
		}
	}
	return runs
}

func (in *initiator) runUCX(ctx context.Context, runs []ucxRun) {
	for _, u := range runs {
		in.prog.step(fmt.Sprintf("ucx_perftest %s %s %s", u.tls, u.op, fmtSize(float64(u.size))))
		r, err := runPerftest(ctx, u, in.cfg.timeout)
		if err != nil {
			in.baselineNotice["ucx_perftest "+u.tls+" "+u.op.String()+" "+fmtSize(float64(u.size))] = err.Error()
			in.prog.done("failed: " + err.Error())
			continue
		}
		in.results = append(in.results, r)
		in.prog.done(r.summary())
	}
}

func runPerftest(ctx context.Context, u ucxRun, timeout time.Duration) (Result, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return Result{}, err
	}
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	_ = ln.Close()
	ctx, cancel := context.WithTimeout(ctx, timeout+time.Duration(u.iters)*10*time.Millisecond)
	defer cancel()
	env := append(os.Environ(), "UCX_TLS="+u.tls, "UCX_WARN_UNUSED_ENV_VARS=n")
	srv := exec.CommandContext(ctx, "ucx_perftest", "-p", port)
	srv.Env = env
	var srvOut bytes.Buffer
	srv.Stdout, srv.Stderr = &srvOut, &srvOut
	if err := srv.Start(); err != nil {
		return Result{}, err
	}
	defer func() { _ = srv.Process.Kill(); _ = srv.Wait() }()
	test := "ucp_get"
	if u.op == dirWrite {
		test = "ucp_put_bw"
	}
	warm := max(u.iters/10, 2)
	var out []byte
	for attempt := 0; ; attempt++ {
		cl := exec.CommandContext(ctx, "ucx_perftest", "127.0.0.1", "-p", port, "-t", test,
			"-s", strconv.Itoa(u.size), "-n", strconv.Itoa(u.iters), "-w", strconv.Itoa(warm), "-v")
		cl.Env = env
		out, err = cl.CombinedOutput()
		if err == nil || attempt >= 20 || ctx.Err() != nil {
			break
		}
		time.Sleep(100 * time.Millisecond) // the server may not listen yet
	}
	if err != nil {
		return Result{}, fmt.Errorf("ucx_perftest %s (UCX_TLS=%s): %v: %s", test, u.tls, err, lastLine(out))
	}
	return parsePerftest(out, u)
}

// parsePerftest reads the final CSV line of ucx_perftest -v:
// iterations, p50 latency, average latency, overall latency (µs), average
// and overall bandwidth (MB/s, 2^20 bytes), average and overall message
// rate.
func parsePerftest(out []byte, u ucxRun) (Result, error) {
	var fields []string
	for _, line := range strings.Split(string(out), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "[") {
			continue
		}
		f := strings.Split(line, ",")
		if len(f) != 8 {
			continue
		}
		if _, err := strconv.ParseFloat(f[0], 64); err == nil {
			fields = f
		}
	}
	if fields == nil {
		return Result{}, fmt.Errorf("ucx_perftest printed no result: %s", lastLine(out))
	}
	num := make([]float64, len(fields))
	for i, f := range fields {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil {
			return Result{}, fmt.Errorf("ucx_perftest result %q: %v", strings.Join(fields, ","), err)
		}
		num[i] = v
	}
	r := Result{Kind: baseUCX, Name: baseUCX + " " + u.tls, Op: u.op.String(), Block: u.size, Descs: 1, Bytes: int64(u.size),
		Iters: int(num[0]), GBps: num[5] * (1 << 20) / 1e9, OpsPerSec: num[7], P50: num[1],
		Note: fmt.Sprintf("UCX_TLS=%s", u.tls)}
	return r, nil
}

func lastLine(b []byte) string {
	s := strings.TrimSpace(string(b))
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[i+1:]
	}
	return s
}
