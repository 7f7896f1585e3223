package main

import (
	"fmt"
	"net"
	"slices"
	"strings"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backend/tcp"
)

// backendDef is a backend this binary can measure. Adding one is one entry
// here, or, for a backend behind a build tag (ucx), one tagged file whose
// init appends to extraBackends:
//
//	//go:build ucx
//
//	package main
//
//	import (
//		"github.com/goxfer/goxfer/agent"
//		"github.com/goxfer/goxfer/agent/backend/ucx"
//	)
//
//	func init() {
//		extraBackends = append(extraBackends, backendDef{name: "ucx", baseline: baseUCX,
//			newFn: func(*config) agent.Backend { return ucx.New() }})
//	}
type backendDef struct {
	name string
	// inProcess: the backend only reaches agents in the same process, so
	// its target runs inside the initiator's process.
	inProcess bool
	// baseline names the raw measurement the backend is compared with.
	baseline string
	newFn    func(c *config) agent.Backend
	// alloc, if set, places a point's buffers, on both sides, in memory
	// the backend b allocates (ucx: ucp_mem_map with UCP_MEM_MAP_ALLOCATE,
	// as ucx_perftest does); free gives it back. -ucx-alloc decides.
	alloc func(b agent.Backend, n int) (buf []byte, free func() error, err error)
}

// ipcWindow is the most bytes one lease of cma's same-host device path
// covers (cma.WithDeviceWindow, its default): the bytes of one batch of its
// copies at most, what a "+ipc" row's copy rate is compared with.
const ipcWindow = 256 << 20

// heapSuffix names the rows of a backend with an allocator measured on Go
// heap memory instead (-ucx-alloc both).
const heapSuffix = " (Go heap)"

// findBackend returns the instance named name among bs, or nil.
func findBackend(bs []agent.Backend, name string) agent.Backend {
	for _, b := range bs {
		if b.Name() == name {
			return b
		}
	}
	return nil
}

// allocDef returns the built backend named name if it has an allocator.
func allocDef(name string) (backendDef, bool) {
	for _, d := range builtBackends() {
		if d.name == name && d.alloc != nil {
			return d, true
		}
	}
	return backendDef{}, false
}

// extraBackends holds backends contributed by files behind build tags.
var extraBackends []backendDef

// knownBackends are names users may ask for that are not necessarily built.
var knownBackends = []string{"mem", "tcp", "cma", "ucx"}

func builtBackends() []backendDef {
	bs := []backendDef{
		{name: "mem", inProcess: true, baseline: baseMemcpy, newFn: func(*config) agent.Backend { return mem.New() }},
		{name: "tcp", baseline: baseTCP, newFn: func(c *config) agent.Backend {
			opts := []tcp.Option{tcp.WithListenAddr(c.listen)}
			if c.tcpSpin > 0 {
				opts = append(opts, tcp.WithLatencyMode(c.tcpSpin))
			}
			return tcp.New(opts...)
		}},
		{name: "cma", baseline: basePVM, newFn: func(c *config) agent.Backend {
			return cma.New(cma.WithDeviceIPC(c.deviceIPC), cma.WithDeviceWindow(ipcWindow))
		}},
	}
	return append(bs, extraBackends...)
}

func builtNames() []string {
	var names []string
	for _, b := range builtBackends() {
		names = append(names, b.name)
	}
	return names
}

// selectBackends resolves a comma-separated list ("" or "all": every built
// backend) against the built ones.
func selectBackends(list string) ([]backendDef, error) {
	built := builtBackends()
	if list == "" || list == "all" {
		return built, nil
	}
	var out []backendDef
	for _, name := range strings.Split(list, ",") {
		name = strings.TrimSpace(strings.ToLower(name))
		i := slices.IndexFunc(built, func(b backendDef) bool { return b.name == name })
		switch {
		case i >= 0:
			if !slices.ContainsFunc(out, func(b backendDef) bool { return b.name == name }) {
				out = append(out, built[i])
			}
		case slices.Contains(knownBackends, name):
			hint := ""
			if name == "ucx" {
				hint = " (ucx needs cgo and -tags ucx)"
			}
			return nil, fmt.Errorf("backend %q is not built into this binary%s: built backends are %s", name, hint, strings.Join(builtNames(), ", "))
		default:
			return nil, fmt.Errorf("unknown backend %q: built backends are %s", name, strings.Join(builtNames(), ", "))
		}
	}
	return out, nil
}

// agentBackends returns fresh instances of every built backend, in the
// agent's order of preference (mem > cma > ucx > tcp).
func agentBackends(c *config) []agent.Backend {
	order := map[string]int{"mem": 0, "cma": 1, "ucx": 2, "tcp": 3}
	defs := builtBackends()
	slices.SortStableFunc(defs, func(a, b backendDef) int { return order[a.name] - order[b.name] })
	out := make([]agent.Backend, len(defs))
	for i, d := range defs {
		out[i] = d.newFn(c)
	}
	return out
}

// anyPort returns listen with port 0: the sides that nobody dials by a
// configured address (the initiator, the in-process target) must not take
// the port -listen names.
func anyPort(listen string) string {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return listen
	}
	return net.JoinHostPort(host, "0")
}
