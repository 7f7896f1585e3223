package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/goxfer/goxfer/connect"
	gxnats "github.com/goxfer/goxfer/transport/nats"
)

// The latency rows: the 4 KiB TCP ping-pong floor and the control plane.

// latency measures the small-operation floor and the control plane.
func (in *initiator) latency(ctx context.Context) error {
	if in.cfg.baseline && in.proc != nil {
		in.prog.step("4 KiB TCP ping-pong")
		r, err := in.pingPong(ctx)
		if err != nil {
			return fmt.Errorf("ping-pong: %w", err)
		}
		in.results = append(in.results, r)
		in.prog.done(r.summary())
	}
	if !in.cfg.control {
		return nil
	}
	in.prog.step("control plane")
	rs, err := in.controlPlane(ctx)
	if err != nil {
		return fmt.Errorf("control plane: %w", err)
	}
	in.results = append(in.results, rs...)
	in.prog.done(fmt.Sprintf("%d rows", len(rs)))
	return nil
}

// controlPlane measures what handing out one token per operation costs:
// CreateReadable+Metadata at the target (from the sweep's rounds), a NATS
// request/reply that makes and carries a token, and a 4 KiB READ that
// first fetches its token that way.
func (in *initiator) controlPlane(ctx context.Context) ([]Result, error) {
	var out []Result
	for _, d := range slices.Sorted(maps.Keys(in.createNs)) {
		out = append(out, Result{Kind: "control", Name: "create+token", Descs: d, Iters: 0,
			P50: in.createNs[d] / 1e3, Note: fmt.Sprintf("CreateReadable/Writable + Metadata per operation, mean; token %d bytes", in.tokenBytes[d])})
	}
	for _, t := range []*remote{in.local, in.proc} {
		if t == nil {
			continue
		}
		iters := in.cfg.latIters
		lat, batches, err := in.timeControl(iters, func() error {
			rctx, cancel := context.WithTimeout(ctx, in.cfg.timeout)
			defer cancel()
			_, err := gxnats.Request(rctx, in.nc, t.hello.Token1, []byte(tokenUnused))
			return err
		})
		if err != nil {
			return nil, err
		}
		r := Result{Kind: "control", Name: "nats-token", Op: "REQ", Block: 4096, Descs: 1, Iters: iters, Note: "NATS request/reply; the target creates a readable and answers with its token"}
		if t == in.local {
			r.Name, r.InProcess = "nats-token (in-process)", true
		}
		r.P50, r.P99 = percentiles(lat)
		setControlPing(&r, batches, lat)
		out = append(out, r)
	}
	dst := make([]byte, 4096)
	for _, b := range in.cfg.backends {
		t, c := in.targetFor(b), in.conns[b.name]
		iters := in.cfg.latIters
		lat, batches, err := in.timeControl(iters, func() error {
			rctx, cancel := context.WithTimeout(ctx, in.cfg.timeout)
			defer cancel()
			rep, err := gxnats.Request(rctx, in.nc, t.hello.Token1, nil)
			if err != nil {
				return err
			}
			x, err := c.BeginRead(rctx, rep.Metadata, connect.NewDescriptor(dst))
			if err != nil {
				return err
			}
			return x.Wait(rctx)
		})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", b.name, err)
		}
		r := Result{Kind: "control", Name: b.name, Op: "REQ+READ", Block: 4096, Descs: 1, Iters: iters, InProcess: b.inProcess,
			Note: "token request over NATS, then BeginRead and Wait"}
		r.P50, r.P99 = percentiles(lat)
		setControlPing(&r, batches, lat)
		out = append(out, r)
	}
	return out, nil
}

// timeControl runs f iters times on the clock, after a tenth as many
// warm-ups, as timeCalls does; with the ping-pong to interleave (in.ping),
// in batches alternating with batches of it, as the small points run: a
// request over NATS measured apart swings with the machine's load as the
// ping-pong does.
func (in *initiator) timeControl(iters int, f func() error) ([]time.Duration, []pingBatch, error) {
	if in.ping == nil {
		lat, _, err := timeCalls(iters/10, iters, f)
		return lat, nil, err
	}
	if _, _, err := timeCalls(iters/10, 0, f); err != nil { // the warm-ups
		return nil, nil, err
	}
	lat := make([]time.Duration, 0, iters)
	batches, err := newPinger(in.ping, in.cfg.timeout).alternate(0, iters, func(lo, hi int) error {
		part, _, err := timeCalls(0, hi-lo, f)
		lat = append(lat, part...)
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	return lat, batches, nil
}

// setControlPing sets a control row's figures against the interleaved
// ping-pong, if it ran, and says so in its note.
func setControlPing(r *Result, batches []pingBatch, lat []time.Duration) {
	setPingRatios(r, batches, lat, nil)
	if r.PingPairs > 0 {
		r.Note += "; " + pingNote(*r)
	}
}
