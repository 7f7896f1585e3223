package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/goxfer/goxfer/agent/devmem"
)

// Baseline names.
const (
	baseTCP      = "raw-tcp" // the better of baseTCP1 and baseTCP4
	baseTCP1     = "raw-tcp×1"
	baseTCP4     = "raw-tcp×4"
	baseMemcpy   = "memcpy"
	basePVM      = "process_vm"
	basePingPong = "raw-tcp-pingpong"
	baseUCX      = "ucx_perftest" // the better of its UCX_TLS settings
	baseCopy     = "cuMemcpy"     // pinned host memory to and from GPU memory, GPU memory to GPU memory; ops D2H, H2D, D2D
)

// copyBaselines measures, for each size, what device copies are compared
// with, in this process on one stream of the driver, each copy enqueued
// and synced before the next, as many as a goxfer point of that size runs:
// copies from GPU memory into pinned host memory (D2H) and back (H2D),
// what staging and cma's same-host device path between GPU and host
// memory copy; and with GPU memory on both sides, from one allocation to
// another on the same GPU (D2D), what that path copies between GPUs.
func (in *initiator) copyBaselines(sizes []int) (out []Result, err error) {
	d, gpu := in.drv, in.cfg.gpu
	st, err := d.NewStream(gpu)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, st.Close()) }()
	for _, size := range sizes {
		rs, err := in.copyBaseline(st, size)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", fmtSize(float64(size)), err)
		}
		out = append(out, rs...)
	}
	return out, nil
}

func (in *initiator) copyBaseline(st devmem.Stream, size int) (_ []Result, err error) {
	d, gpu := in.drv, in.cfg.gpu
	host, err := d.HostAlloc(size)
	if err != nil {
		return nil, fmt.Errorf("pinned host memory: %w", err)
	}
	defer func() { err = errors.Join(err, d.HostFree(host)) }()
	dev, err := d.Alloc(gpu, size)
	if err != nil {
		return nil, fmt.Errorf("GPU memory on GPU %d: %w", gpu, err)
	}
	defer func() { err = errors.Join(err, d.Free(dev)) }()
	poison(host)
	iters, warmup := in.cfg.itersFor(int64(size))
	note := fmt.Sprintf("pinned host memory, one %s stream on GPU %d, a copy and a Sync each", d.Name(), gpu)
	if d.Name() == "sim" {
		note = "SIMULATED GPU: " + note
	}
	dirs := []string{"D2H", "H2D"}
	var dev2 uintptr // the D2D copy's destination
	if in.cfg.mem.init == memVRAM && in.cfg.mem.target == memVRAM {
		if dev2, err = d.Alloc(gpu, size); err != nil {
			return nil, fmt.Errorf("GPU memory on GPU %d: %w", gpu, err)
		}
		defer func() { err = errors.Join(err, d.Free(dev2)) }()
		dirs = append(dirs, "D2D")
	}
	var out []Result
	for _, dir := range dirs {
		lat, elapsed, err := timeCalls(warmup, iters, func() error {
			var err error
			switch dir {
			case "D2H":
				err = st.ToHost(host, dev)
			case "H2D":
				err = st.ToDevice(dev, host)
			default:
				err = st.Copy(dev2, dev, size)
			}
			return errors.Join(err, st.Sync())
		})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", dir, err)
		}
		n := note
		if dir == "D2D" {
			n = strings.Replace(note, "pinned host memory", "two allocations on the GPU", 1)
		}
		r := Result{Kind: "baseline", Name: baseCopy, Op: dir, Block: size, Descs: 1, Bytes: int64(size), Inflight: 1, Iters: iters,
			Device: d.Name(), Note: n}
		r.setThroughput(int64(size), iters, elapsed)
		r.P50, r.P99 = percentiles(lat)
		out = append(out, r)
	}
	return out, nil
}

// fmtSizes lists sizes in binary units.
func fmtSizes(sizes []int) string {
	s := make([]string, len(sizes))
	for i, n := range sizes {
		s[i] = fmtSize(float64(n))
	}
	return strings.Join(s, ", ")
}

// baselines measures, for the bytes of one operation of shape sh, what the
// backends are compared with: raw TCP over 1 and 4 connections to the
// target process, Go copy, and process_vm_readv/writev on the target's
// memory. Each runs as many operations as the goxfer points, one at a time.
func (in *initiator) baselines(ctx context.Context, op direction, sh shape) ([]Result, error) {
	bytes := sh.bytes()
	iters, warmup := in.cfg.itersFor(bytes)
	size := int(bytes)
	local := make([]byte, size)
	poison(local)
	mk := func(name, note string) Result {
		return Result{Kind: "baseline", Name: name, Op: op.String(), Block: size, Descs: 1, Bytes: bytes, Iters: iters, Inflight: 1, Shape: sh.Label, Note: note}
	}
	var out []Result
	// measure runs f warm-up and measured times.
	measure := func(r Result, f func() error) (Result, error) {
		lat, elapsed, err := timeCalls(warmup, iters, f)
		if err != nil {
			return r, err
		}
		r.setThroughput(bytes, iters, elapsed)
		r.P50, r.P99 = percentiles(lat)
		return r, nil
	}

	{ // Go copy, in this process.
		src := make([]byte, size)
		poison(src)
		dst, srcp := local, src
		if op == dirWrite {
			dst, srcp = src, local
		}
		r, err := measure(mk(baseMemcpy, "Go copy, one goroutine"), func() error { copy(dst, srcp); return nil })
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	if in.proc == nil {
		return out, nil
	}
	p, err := in.prepare(ctx, in.proc, roundReq{Op: op, Block: size, Descs: 1, Slots: 1, Ops: 0, RawBuf: true})
	if err != nil {
		return nil, err
	}
	defer func() { _, _ = in.finish(ctx, p) }()
	for _, c := range []struct {
		name  string
		conns []net.Conn
	}{{baseTCP1, in.raw1}, {baseTCP4, in.raw4}} {
		note := fmt.Sprintf("%d plain connection(s) to the target process", len(c.conns))
		r, err := measure(mk(c.name, note), func() error { return rawTransfer(c.conns, op, local, in.cfg.timeout) })
		if err != nil {
			return nil, fmt.Errorf("%s: %w", c.name, err)
		}
		out = append(out, r)
	}
	switch {
	case !havePVM:
		in.baselineNotice[basePVM] = "process_vm_readv needs Linux"
	case !in.proc.sameClock:
		in.baselineNotice[basePVM] = "the target runs on another host"
	default:
		name := "process_vm_readv"
		if op == dirWrite {
			name = "process_vm_writev"
		}
		r, err := measure(mk(basePVM, name+" on the target process, one call per operation"), func() error {
			return pvmCopy(in.proc.hello.PID, op == dirWrite, local, p.ready.Slots[0])
		})
		if err != nil {
			in.baselineNotice[basePVM] = err.Error()
			break
		}
		out = append(out, r)
	}
	return out, nil
}

// rawTransfer moves buf's bytes split evenly over plain connections to the
// target: READ asks the target to send them, WRITE sends them and waits for
// a one-byte answer.
func rawTransfer(cs []net.Conn, op direction, buf []byte, timeout time.Duration) error {
	dir := byte('r')
	if op == dirWrite {
		dir = 'w'
	}
	per := len(buf) / len(cs)
	var wg sync.WaitGroup
	errs := make([]error, len(cs))
	for i, c := range cs {
		lo, hi := i*per, (i+1)*per
		if i == len(cs)-1 {
			hi = len(buf)
		}
		if lo == hi {
			continue
		}
		wg.Go(func() {
			part := buf[lo:hi]
			_ = c.SetDeadline(time.Now().Add(timeout))
			var req [17]byte
			req[0] = dir
			binary.LittleEndian.PutUint64(req[1:], uint64(lo))
			binary.LittleEndian.PutUint64(req[9:], uint64(len(part)))
			_, err := c.Write(req[:])
			if err == nil && dir == 'r' {
				_, err = io.ReadFull(c, part)
			} else if err == nil {
				if _, err = c.Write(part); err == nil {
					_, err = io.ReadFull(c, req[:1])
				}
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// pingPong measures 4 KiB round trips over one plain connection to the
// target process: the latency floor of anything over TCP.
func (in *initiator) pingPong(ctx context.Context) (Result, error) {
	cs, err := dialN(ctx, in.proc.hello.Ping, 1)
	if err != nil {
		return Result{}, err
	}
	defer closeAll(cs)
	c := cs[0]
	buf := make([]byte, 4096)
	iters := in.cfg.latIters
	_ = c.SetDeadline(time.Now().Add(in.cfg.timeout + time.Duration(iters)*time.Millisecond))
	lat, elapsed, err := timeCalls(iters/10, iters, func() error {
		if _, err := c.Write(buf); err != nil {
			return err
		}
		_, err := io.ReadFull(c, buf)
		return err
	})
	if err != nil {
		return Result{}, err
	}
	r := Result{Kind: "baseline", Name: basePingPong, Op: "PINGPONG", Block: 4096, Descs: 1, Bytes: 4096, Inflight: 1, Iters: iters, Note: "4 KiB there and back over one plain connection"}
	r.setThroughput(4096, iters, elapsed)
	r.P50, r.P99 = percentiles(lat)
	return r, nil
}
