package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/goxfer/goxfer/connect"
)

// The goxfer points of a sweep: which there are, and how one is measured.

// memories returns how b's points are measured: with buffers from its
// allocator (true), on Go heap memory (false), or both, per -ucx-alloc.
func (in *initiator) memories(b backendDef) []bool {
	switch {
	case b.alloc == nil || in.cfg.ucxAlloc == "off":
		return []bool{false}
	case in.cfg.ucxAlloc == "on":
		return []bool{true}
	}
	return []bool{true, false}
}

// memPairs returns the memory kinds every point is measured with: dram/dram
// alone, or, when either side is vram or shm, dram/dram (the same backend's
// figure on the Go heap) then the kinds asked for, side by side.
func (in *initiator) memPairs() []mems {
	if in.cfg.mem == dramOnly {
		return []mems{dramOnly}
	}
	return []mems{dramOnly, in.cfg.mem}
}

// allocsFor is memories for Go heap buffers on both sides; a point with GPU
// or shared memory uses no backend's allocator.
func (in *initiator) allocsFor(b backendDef, m mems) []bool {
	if m != dramOnly {
		return []bool{false}
	}
	return in.memories(b)
}

// newCopySizes returns the sizes of the copy baselines that a shape needs
// and seen does not hold yet, and adds them to seen: the bytes of an
// operation, and those of one staging chunk and of one window of cma's
// device path when smaller (what their copies are compared with).
func (in *initiator) newCopySizes(sh shape, seen map[int]bool) []int {
	if !in.cfg.mem.vram() {
		return nil
	}
	var out []int
	bytes := int(sh.bytes())
	for _, n := range []int{bytes, min(bytes, in.cfg.stageChunk), min(bytes, ipcWindow)} {
		if !seen[n] {
			seen[n] = true
			out = append(out, n)
		}
	}
	return out
}

func (in *initiator) countSteps(ucx int) int {
	n := 0
	seen := map[int]bool{}
	for range in.cfg.ops {
		for _, sh := range in.cfg.shapes {
			for _, b := range in.cfg.backends {
				for _, m := range in.memPairs() {
					n += len(in.cfg.inflight) * len(in.allocsFor(b, m))
				}
			}
			if in.cfg.baseline {
				n++
			}
			if len(in.newCopySizes(sh, seen)) > 0 {
				n++
			}
		}
	}
	if in.cfg.baseline {
		n++
	}
	if in.cfg.control {
		n++
	}
	return n + ucx
}

// sweep measures every point: per operation and shape, each backend at each
// depth, then the raw baselines for the same bytes, and with GPU memory the
// pinned copies of those bytes.
func (in *initiator) sweep(ctx context.Context) error {
	for _, op := range in.cfg.ops {
		for _, sh := range in.cfg.shapes {
			for _, n := range in.cfg.inflight {
				for _, b := range in.cfg.backends {
					for _, m := range in.memPairs() {
						for _, alloc := range in.allocsFor(b, m) {
							what := fmt.Sprintf("%s %s %s ×%d, %d in flight", b.name, op, fmtSize(float64(sh.Block)), sh.Descs, n)
							if in.cfg.mem != dramOnly {
								what += ", " + m.String()
							}
							in.prog.step(what)
							if m.vram() && in.noVRAM[b.name] != "" {
								in.prog.done("skipped: " + in.noVRAM[b.name])
								continue
							}
							r, err := in.measure(ctx, b, op, sh, n, alloc, m)
							if m.vram() && errors.Is(err, connect.ErrNoBackend) {
								// A backend that cannot move GPU memory yet is
								// a finding, not a failed run.
								in.noVRAM[b.name] = err.Error()
								in.baselineNotice[b.name+" "+m.String()] = "not measured: " + err.Error()
								in.prog.done("skipped: " + err.Error())
								continue
							}
							if err != nil {
								return fmt.Errorf("%s: %w", what, err)
							}
							in.results = append(in.results, r)
							in.prog.done(r.summary())
						}
					}
				}
			}
			if in.cfg.baseline {
				in.prog.step(fmt.Sprintf("baselines %s %s", op, fmtSize(float64(sh.bytes()))))
				rs, err := in.baselines(ctx, op, sh)
				if err != nil {
					return fmt.Errorf("baselines for %s of %s: %w", op, fmtSize(float64(sh.bytes())), err)
				}
				in.results = append(in.results, rs...)
				in.prog.done(fmt.Sprintf("%d baselines", len(rs)))
			}
			if sizes := in.newCopySizes(sh, in.copySizes); len(sizes) > 0 {
				in.prog.step(fmt.Sprintf("%s copies of %s", baseCopy, fmtSizes(sizes)))
				rs, err := in.copyBaselines(sizes)
				if err != nil {
					return fmt.Errorf("copy baselines of %s: %w", fmtSizes(sizes), err)
				}
				in.results = append(in.results, rs...)
				in.prog.done(fmt.Sprintf("%d baselines", len(rs)))
			}
		}
	}
	return nil
}

// measure runs one goxfer point: warm-up then measured operations, n in
// flight, each on a fresh passive operation whose token was fetched before
// the clock started, the initiator's buffers in m.init and the target's in
// m.target.
func (in *initiator) measure(ctx context.Context, b backendDef, op direction, sh shape, n int, alloc bool, m mems) (Result, error) {
	t := in.targetFor(b)
	iters, warmup := in.cfg.itersFor(sh.bytes())
	total := warmup + iters
	req := roundReq{Op: op, Block: sh.Block, Descs: sh.Descs, Slots: n, Ops: total, Check: in.cfg.check, WaitMsec: millis(in.cfg.timeout),
		Mem: m.target, GPU: in.cfg.gpu}
	var allocFn func(int) ([]byte, func() error, error)
	if alloc {
		req.Alloc = b.name
		inst := in.insts[b.name]
		allocFn = func(size int) ([]byte, func() error, error) { return b.alloc(inst, size) }
	}
	staged := in.meter.read()
	p, err := in.prepare(ctx, t, req)
	if err != nil {
		return Result{}, err
	}
	if p.ready.Mem != m.target {
		_, _ = in.finish(ctx, p)
		return Result{}, fmt.Errorf("the target prepared %s buffers where %s was asked for: it is a goxfer-bench of an older build", p.ready.Mem, m.target)
	}
	in.createNs[sh.Descs] = float64(p.ready.CreateNs) / float64(total)
	in.tokenBytes[sh.Descs] = p.ready.TokenLen
	res, runErr := in.runOps(ctx, in.conns[b.name], p, op, sh, n, warmup, total, m.init, allocFn, in.pingerFor(sh, n))
	fin, ferr := in.finish(ctx, p)
	if runErr != nil {
		return Result{}, runErr
	}
	if ferr != nil {
		return Result{}, ferr
	}
	if fin.Failed > 0 {
		return Result{}, fmt.Errorf("%d passive operations failed at the target: %v", fin.Failed, fin.Errors)
	}
	r := Result{
		Kind: "goxfer", Name: b.name, Op: op.String(), Block: sh.Block, Descs: sh.Descs, Bytes: sh.bytes(), Inflight: n,
		Iters: iters, InProcess: b.inProcess, Shape: sh.Label, Checked: in.cfg.check,
		InitiatorMem: m.init.String(), TargetMem: m.target.String(), Path: strings.Join(res.paths, ","),
	}
	r.setThroughput(sh.bytes(), iters, res.elapsed)
	r.P50, r.P99 = percentiles(res.lat[warmup:])
	var doneAt []time.Duration // per operation; 0: its passive Wait did not return
	if t.sameClock {
		doneAt = make([]time.Duration, total)
		var done []time.Duration
		for i := warmup; i < total; i++ {
			if fin.Done[i] != 0 {
				doneAt[i] = time.Duration(fin.Done[i] - res.begin[i])
				done = append(done, doneAt[i])
			}
		}
		if len(done) == iters {
			r.DoneP50, r.DoneP99 = percentiles(done)
		}
	}
	setPingRatios(&r, res.batches, res.lat, doneAt)
	if b.inProcess {
		r.Note = "in-process"
	}
	switch {
	case alloc:
		r.Note = joinNote(r.Note, "buffers from the backend's allocator")
	case b.alloc != nil && in.cfg.ucxAlloc != "off" && m == dramOnly:
		r.Name += heapSuffix
	}
	if r.PingPairs > 0 {
		r.Note = joinNote(r.Note, pingNote(r))
	}
	if m.vram() {
		// Both sides' device copies, warm-up included: a rate, not a total.
		stage := in.meter.read().sub(staged).add(fin.Stage)
		r.Device = in.drv.Name()
		verb := "staged"
		r.StageChunk = min(int(sh.bytes()), in.cfg.stageChunk)
		if ipcPath(r.Path) {
			verb, r.StageChunk = "copied", min(int(sh.bytes()), ipcWindow)
		}
		r.StageD2HGBps, r.StageH2DGBps, r.StageD2DGBps = stage.D2H.gbps(), stage.H2D.gbps(), stage.D2D.gbps()
		for _, d := range []struct {
			name string
			c    copyStat
		}{{"D2H", stage.D2H}, {"H2D", stage.H2D}, {"D2D", stage.D2D}} {
			if d.c.Batches > 0 {
				r.Note = joinNote(r.Note, fmt.Sprintf("%s %s %s per sync", verb, d.name, fmtSize(float64(d.c.Bytes/d.c.Batches))))
			}
		}
		if r.Device == "sim" {
			r.Note = joinNote(r.Note, "SIMULATED GPU")
		}
	}
	if in.cfg.check {
		r.Note = joinNote(r.Note, fmt.Sprintf("checked %s", fmtSize(float64(res.verified+fin.Verified))))
	}
	return r, nil
}

// joinNote joins two notes of a row with "; ".
func joinNote(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}
