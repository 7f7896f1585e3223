package main

import (
	"fmt"
	"io"
	"net"
	"slices"
	"time"
)

// Small operations against the raw 4 KiB TCP ping-pong, measured in the
// same seconds: a ping-pong measured apart swung from 31 µs in one run to
// 123 µs in the next on the same machine (issue 19), so a small point's
// measured operations run in batches, each followed by a batch of as many
// ping-pongs to the target process, and the row reports the median over
// the pairs of batches of their p50s' ratio.

const (
	// interleaveMax is the largest operation, in bytes, whose points run
	// interleaved with the ping-pong (one operation in flight).
	interleaveMax = 64 << 10
	// interleavePairs is how many pairs of batches a point aims at, and
	// interleaveBatch the most operations in one batch.
	interleavePairs = 20
	interleaveBatch = 50
)

// batchSize is the operations of one batch of a point of iters measured
// operations.
func batchSize(iters int) int { return min(max(iters/interleavePairs, 1), interleaveBatch) }

// pinger runs 4 KiB round trips over one plain connection to the target
// process's ping-pong server. Used by one goroutine at a time.
type pinger struct {
	c       net.Conn
	buf     []byte
	timeout time.Duration
}

func newPinger(c net.Conn, timeout time.Duration) *pinger {
	return &pinger{c: c, buf: make([]byte, 4096), timeout: timeout}
}

// batch runs n round trips and returns the time of each.
func (p *pinger) batch(n int) ([]time.Duration, error) {
	_ = p.c.SetDeadline(time.Now().Add(p.timeout))
	lat := make([]time.Duration, n)
	for i := range lat {
		t0 := time.Now()
		if _, err := p.c.Write(p.buf); err != nil {
			return nil, err
		}
		if _, err := io.ReadFull(p.c, p.buf); err != nil {
			return nil, err
		}
		lat[i] = time.Since(t0)
	}
	return lat, nil
}

// alternate runs the measured calls [lo, total) in batches (run measures
// [lo, hi)), each followed by a batch of as many ping-pongs, after one
// batch to warm the connection; it returns the pairs. It stops at run's
// first error, which it returns as it is.
func (p *pinger) alternate(lo, total int, run func(lo, hi int) error) ([]pingBatch, error) {
	size := batchSize(total - lo)
	if _, err := p.batch(size); err != nil {
		return nil, fmt.Errorf("ping-pong: %w", err)
	}
	var batches []pingBatch
	for ; lo < total; lo += size {
		hi := min(lo+size, total)
		if err := run(lo, hi); err != nil {
			return nil, err
		}
		pings, err := p.batch(hi - lo)
		if err != nil {
			return nil, fmt.Errorf("ping-pong: %w", err)
		}
		batches = append(batches, pingBatch{lo: lo, hi: hi, pings: pings})
	}
	return batches, nil
}

// pingBatch is one pair: the measured operations [lo, hi) and the
// ping-pongs that ran right after them.
type pingBatch struct {
	lo, hi int
	pings  []time.Duration
}

// pingerFor returns the ping-pong to interleave with a point of shape sh
// and n operations in flight, or nil: only small operations one at a
// time, and only with the baselines on.
func (in *initiator) pingerFor(sh shape, n int) *pinger {
	if in.ping == nil || n != 1 || sh.bytes() > interleaveMax {
		return nil
	}
	return newPinger(in.ping, in.cfg.timeout)
}

// setPingRatios sets r's figures against the interleaved ping-pong:
// lat holds each operation's time to the active Wait, done to the passive
// Wait (nil: not measured; a zero: that operation's is missing).
func setPingRatios(r *Result, batches []pingBatch, lat, done []time.Duration) {
	if len(batches) == 0 {
		return
	}
	var all []time.Duration
	var active, passive []float64
	for _, b := range batches {
		all = append(all, b.pings...)
		ping, _ := percentiles(b.pings)
		if ping <= 0 {
			continue
		}
		p50, _ := percentiles(lat[b.lo:b.hi])
		active = append(active, p50/ping)
		if done != nil && !slices.Contains(done[b.lo:b.hi], 0) {
			d50, _ := percentiles(done[b.lo:b.hi])
			passive = append(passive, d50/ping)
		}
	}
	r.PingP50, _ = percentiles(all)
	r.PingPairs = len(active)
	r.PingRatio = medianOf(active)
	if len(passive) == len(active) {
		r.DonePingRatio = medianOf(passive)
	}
}

// medianOf is the median of vs, 0 for none.
func medianOf(vs []float64) float64 {
	if len(vs) == 0 {
		return 0
	}
	s := slices.Clone(vs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// pingNote is the note of an interleaved row.
func pingNote(r Result) string {
	return fmt.Sprintf("interleaved with the 4 KiB TCP ping-pong, %d pairs of batches", r.PingPairs)
}
