//go:build ucx

package main

import (
	"fmt"
	"os"
	"strconv"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/ucx"
)

// The ucx backend, built with -tags ucx. Its transports are UCX's own
// choice, that is UCX_TLS from the environment, which the target process
// inherits: compare it with ucx_perftest on the same transports with
//
//	UCX_TLS=tcp,self go run -tags ucx ./cmd/goxfer-bench -backends ucx -ucx-tls tcp,self
//
// Its rows' ratios are to the ucx_perftest row of the same operation and
// size (the better one, if -ucx-tls lists several). ucx_perftest lets UCX
// allocate its buffers; so do the ucx rows, on both sides, unless
// -ucx-alloc off (-ucx-alloc both adds rows on Go heap memory, named
// "ucx (Go heap)"). GOXFER_BENCH_UCX_GET_READS=1 in the environment
// (which the target inherits) measures READ as ucp_get_nbx
// (ucx.WithGetReads) instead of a put by the exposing side;
// GOXFER_BENCH_UCX_LEASE=n sets the lease size (ucx.WithLeaseSize) of
// both sides.
func init() {
	extraBackends = append(extraBackends, backendDef{name: ucx.Name, baseline: baseUCX,
		newFn: func(*config) agent.Backend {
			opts := []ucx.Option{ucx.WithGetReads(os.Getenv("GOXFER_BENCH_UCX_GET_READS") == "1")}
			if n, err := strconv.Atoi(os.Getenv("GOXFER_BENCH_UCX_LEASE")); err == nil {
				opts = append(opts, ucx.WithLeaseSize(n))
			}
			return ucx.New(opts...)
		},
		alloc: func(b agent.Backend, n int) ([]byte, func() error, error) {
			u, ok := b.(*ucx.Backend)
			if !ok {
				return nil, nil, fmt.Errorf("backend %T is not ucx", b)
			}
			buf, err := u.Alloc(n)
			if err != nil {
				return nil, nil, err
			}
			return buf, func() error { return u.Free(buf) }, nil
		}})
}
