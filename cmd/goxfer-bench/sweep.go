package main

import (
	"context"
	"fmt"
	"time"
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

func (in *initiator) countSteps(ucx int) int {
	n := 0
	for range in.cfg.ops {
		for range in.cfg.shapes {
			for _, b := range in.cfg.backends {
				n += len(in.cfg.inflight) * len(in.memories(b))
			}
			if in.cfg.baseline {
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
// depth, then the raw baselines for the same bytes.
func (in *initiator) sweep(ctx context.Context) error {
	for _, op := range in.cfg.ops {
		for _, sh := range in.cfg.shapes {
			for _, n := range in.cfg.inflight {
				for _, b := range in.cfg.backends {
					for _, alloc := range in.memories(b) {
						in.prog.step(fmt.Sprintf("%s %s %s ×%d, %d in flight", b.name, op, fmtSize(float64(sh.Block)), sh.Descs, n))
						r, err := in.measure(ctx, b, op, sh, n, alloc)
						if err != nil {
							return fmt.Errorf("%s %s of %d × %s, %d in flight: %w", b.name, op, sh.Descs, fmtSize(float64(sh.Block)), n, err)
						}
						in.results = append(in.results, r)
						in.prog.done(r.summary())
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
		}
	}
	return nil
}

// measure runs one goxfer point: warm-up then measured operations, n in
// flight, each on a fresh passive operation whose token was fetched before
// the clock started.
func (in *initiator) measure(ctx context.Context, b backendDef, op direction, sh shape, n int, alloc bool) (Result, error) {
	t := in.targetFor(b)
	iters, warmup := in.cfg.itersFor(sh.bytes())
	total := warmup + iters
	req := roundReq{Op: op, Block: sh.Block, Descs: sh.Descs, Slots: n, Ops: total, Check: in.cfg.check, WaitMsec: millis(in.cfg.timeout)}
	var allocFn func(int) ([]byte, func() error, error)
	if alloc {
		req.Alloc = b.name
		inst := in.insts[b.name]
		allocFn = func(size int) ([]byte, func() error, error) { return b.alloc(inst, size) }
	}
	p, err := in.prepare(ctx, t, req)
	if err != nil {
		return Result{}, err
	}
	in.createNs[sh.Descs] = float64(p.ready.CreateNs) / float64(total)
	in.tokenBytes[sh.Descs] = p.ready.TokenLen
	res, runErr := in.runOps(ctx, in.conns[b.name], p, op, sh, n, warmup, total, allocFn)
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
	}
	r.setThroughput(sh.bytes(), iters, res.elapsed)
	r.P50, r.P99 = percentiles(res.lat[warmup:])
	if t.sameClock {
		var done []time.Duration
		for i := warmup; i < total; i++ {
			if fin.Done[i] != 0 {
				done = append(done, time.Duration(fin.Done[i]-res.begin[i]))
			}
		}
		if len(done) == iters {
			r.DoneP50, r.DoneP99 = percentiles(done)
		}
	}
	if b.inProcess {
		r.Note = "in-process"
	}
	switch {
	case alloc:
		r.Note = joinNote(r.Note, "buffers from the backend's allocator")
	case b.alloc != nil && in.cfg.ucxAlloc != "off":
		r.Name += heapSuffix
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
