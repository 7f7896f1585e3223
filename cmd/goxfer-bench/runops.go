package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/connect"
)

// The goxfer runner: the operations of one point, n in flight, on a
// connector of the backend under test, each byte checked with -check.

// opsRun is what runOps measured.
type opsRun struct {
	begin    []int64         // CLOCK_MONOTONIC at Begin
	lat      []time.Duration // Begin to the active Wait's return
	elapsed  time.Duration   // first measured Begin to last measured completion
	verified int64
	paths    []string // how the operations moved their bytes (Path), sorted
	// batches: with a ping-pong interleaved, the measured operations'
	// batches and the ping-pongs that followed each.
	batches []pingBatch
}

// runOps runs operations [0, total), the first warmup of them unmeasured,
// with n in flight: goroutine s runs operations s, s+n, ... on slot s,
// whose buffer lives in mem (GPU memory: on -gpu). With pp, the measured
// operations run in batches, each followed by a batch of as many 4 KiB
// ping-pongs (interleave.go); the elapsed time is then the batches' own.
func (in *initiator) runOps(ctx context.Context, c *connect.Connector, p *prepared, op direction, sh shape, n, warmup, total int,
	mem memKind, alloc func(int) ([]byte, func() error, error), pp *pinger) (_ *opsRun, err error) {
	size := int(sh.bytes())
	slots := make([]*region, n)
	descs := make([][]connect.Descriptor, n)
	defer func() {
		for _, slot := range slots {
			if slot == nil {
				continue
			}
			if ferr := slot.release(); ferr != nil && err == nil {
				err = ferr
			}
		}
	}()
	for s := range slots {
		if slots[s], err = newRegion(mem, in.drv, in.cfg.gpu, size, alloc); err != nil {
			return nil, err
		}
		if err := slots[s].poison(); err != nil { // fault the pages in before the clock starts
			return nil, err
		}
		descs[s] = slots[s].descriptors(sh.Block, sh.Descs)
	}
	check := in.cfg.check
	var acks []chan error
	if check && op == dirWrite {
		acks = make([]chan error, total)
		for i := range acks {
			acks[i] = make(chan error, 1)
		}
		sub, err := in.nc.Subscribe(subject(in.cfg.session, p.t.name, fmt.Sprintf("ack.%d", p.id)), func(m *nats.Msg) {
			var a ack
			if json.Unmarshal(m.Data, &a) == nil && a.I >= 0 && a.I < len(acks) {
				var err error
				if a.Err != "" {
					err = fmt.Errorf("target check of operation %d: %s", a.I, a.Err)
				}
				select {
				case acks[a.I] <- err:
				default:
				}
			}
		})
		if err != nil {
			return nil, err
		}
		defer func() { _ = sub.Unsubscribe() }()
		if err := in.nc.Flush(); err != nil {
			return nil, err
		}
	}
	run := &opsRun{begin: make([]int64, total), lat: make([]time.Duration, total)}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		mu       sync.Mutex
		firstErr error
		paths    []string
		verified atomic.Int64
		ends     = make([]int64, total)
	)
	addPath := func(path string) {
		mu.Lock()
		if !slices.Contains(paths, path) {
			paths = append(paths, path)
		}
		mu.Unlock()
	}
	fail := func(err error) {
		mu.Lock()
		if firstErr == nil {
			firstErr = err
		}
		mu.Unlock()
		cancel()
	}
	one := func(i int) error {
		s := i % n
		if check {
			if op == dirRead {
				if err := slots[s].poison(); err != nil {
					return err
				}
			} else {
				if i >= n {
					select { // the target has verified the slot's previous write
					case err := <-acks[i-n]:
						if err != nil {
							return err
						}
					case <-time.After(in.cfg.timeout):
						return fmt.Errorf("no check result for operation %d within %v", i-n, in.cfg.timeout)
					case <-ctx.Done():
						return ctx.Err()
					}
				}
				if err := slots[s].fill(writeSeed(p.id, i)); err != nil {
					return err
				}
			}
		}
		wctx, wcancel := context.WithTimeout(ctx, in.cfg.timeout)
		defer wcancel()
		t0 := monoNow()
		var err error
		var pathOf func() string // read after t1: not the operation's time
		if op == dirRead {
			var x *connect.ReadOperation
			if x, err = c.BeginRead(wctx, p.mds[i], descs[s]...); err == nil {
				err, pathOf = x.Wait(wctx), x.Path
			}
		} else {
			var x *connect.WriteOperation
			if x, err = c.BeginWrite(wctx, p.mds[i], descs[s]...); err == nil {
				err, pathOf = x.Wait(wctx), x.Path
			}
		}
		t1 := monoNow()
		var path string
		if pathOf != nil {
			path = pathOf()
		}
		if err != nil {
			if errors.Is(err, context.DeadlineExceeded) {
				return fmt.Errorf("operation %d did not complete within %v: %w", i, in.cfg.timeout, err)
			}
			return fmt.Errorf("operation %d: %w", i, err)
		}
		run.begin[i], run.lat[i], ends[i] = t0, time.Duration(t1-t0), t1
		addPath(path)
		if in.cfg.gap > 0 {
			time.Sleep(in.cfg.gap)
		}
		if check && op == dirRead {
			if err := slots[s].verify(readSeed(p.id, s)); err != nil {
				return fmt.Errorf("check of operation %d: %w", i, err)
			}
			verified.Add(int64(size))
		}
		return nil
	}
	phase := func(lo, hi int) {
		var wg sync.WaitGroup
		for s := range n {
			wg.Go(func() {
				for i := lo + s; i < hi; i += n {
					if ctx.Err() != nil {
						return
					}
					if err := one(i); err != nil {
						fail(err)
						return
					}
				}
			})
		}
		wg.Wait()
	}
	phase(0, warmup)
	if pp == nil {
		phase(warmup, total)
	} else {
		batches, err := pp.alternate(warmup, total, func(lo, hi int) error {
			phase(lo, hi)
			return firstErr
		})
		if err != nil && firstErr == nil {
			return nil, err
		}
		run.batches = batches
	}
	if firstErr != nil {
		return nil, firstErr
	}
	if acks != nil { // every write verified at the target
		for i := max(total-n, 0); i < total; i++ {
			select {
			case err := <-acks[i]:
				if err != nil {
					return nil, err
				}
			case <-time.After(in.cfg.timeout):
				return nil, fmt.Errorf("no check result for operation %d within %v", i, in.cfg.timeout)
			}
		}
	}
	run.elapsed = span(run.begin, ends, warmup, total)
	if run.batches != nil {
		run.elapsed = 0 // the ping-pongs' time between the batches is not the operations'
		for _, b := range run.batches {
			run.elapsed += span(run.begin, ends, b.lo, b.hi)
		}
	}
	run.verified = verified.Load()
	slices.Sort(paths)
	run.paths = paths
	return run, nil
}

// span is the time from the first Begin to the last completion of
// operations [lo, hi).
func span(begin, ends []int64, lo, hi int) time.Duration {
	return time.Duration(slices.Max(ends[lo:hi]) - slices.Min(begin[lo:hi]))
}
