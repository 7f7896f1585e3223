//go:build ucx

package main

import (
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
// size (the better one, if -ucx-tls lists several).
func init() {
	extraBackends = append(extraBackends, backendDef{name: ucx.Name, baseline: baseUCX,
		newFn: func(*config) agent.Backend { return ucx.New() }})
}
