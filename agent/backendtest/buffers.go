package backendtest

import (
	"fmt"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/shm"
	"github.com/goxfer/goxfer/internal/pattern"
)

// buffers is the memory of one side of a transfer: a pattern.Slab, its
// descriptors as agent memory.
type buffers struct {
	*pattern.Slab
	locals []agent.Local
	shared *shm.Buffer // the slab's memory, with SharedHost
}

// sharedEnv, set to 1, makes the suite's host buffers shared memory, in
// this process and in its children (Config.SharedHost).
const sharedEnv = "GOXFER_BACKENDTEST_SHM"

func newBuffers(sizes []int) *buffers {
	b := &buffers{}
	if os.Getenv(sharedEnv) == "1" {
		b.Slab = pattern.NewSlabIn(func(n int) []byte {
			sb, err := shm.Alloc(n)
			if err != nil {
				panic(fmt.Sprintf("backendtest: shared buffers: %v", err))
			}
			b.shared = sb
			return sb.Bytes()
		}, sizes)
	} else {
		b.Slab = pattern.NewSlab(sizes)
	}
	for _, mem := range b.Bufs() {
		b.locals = append(b.locals, agent.DRAM(mem))
	}
	return b
}

// free frees shared buffers once no exposure holds them; until then (an
// exposure revoked later) they stay allocated.
func (b *buffers) free() {
	if b.shared != nil && b.shared.Free() == nil {
		b.shared = nil
	}
}

// regions returns the descriptors' regions, as a remote agent addresses them.
func (b *buffers) regions() []agent.Region {
	rs := make([]agent.Region, len(b.locals))
	for i, l := range b.locals {
		rs[i] = l.Region
	}
	return rs
}

// register registers every descriptor with a and releases them when the
// test ends.
func (b *buffers) register(t testing.TB, a *agent.Agent) {
	t.Helper()
	regs, err := b.registerAll(a)
	require.NoError(t, err)
	t.Cleanup(func() {
		for _, r := range regs {
			_ = r.Release()
		}
	})
}

func (b *buffers) registerAll(a *agent.Agent) ([]*agent.Registration, error) {
	return registerAll(a, b.locals)
}

// registerAll registers each of locals with a, one registration each; on
// error none is left.
func registerAll(a *agent.Agent, locals []agent.Local) ([]*agent.Registration, error) {
	regs := make([]*agent.Registration, 0, len(locals))
	for i, l := range locals {
		r, err := a.Register(l)
		if err != nil {
			release(regs)
			return nil, fmt.Errorf("register descriptor %d: %w", i, err)
		}
		regs = append(regs, r)
	}
	return regs, nil
}

// segments pairs local descriptor i with remote region i, listed in a
// shuffled order so that backends must honour addresses, not positions.
func segments(local *buffers, remote []agent.Region, shuffleSeed uint64) []agent.Segment {
	return segmentsOf(local.locals, remote, shuffleSeed)
}

// segmentsOf is segments for any local memory.
func segmentsOf(locals []agent.Local, remote []agent.Region, shuffleSeed uint64) []agent.Segment {
	segs := make([]agent.Segment, len(locals))
	for i, l := range locals {
		segs[i] = agent.Segment{Local: l, Remote: remote[i]}
	}
	r := rand.New(rand.NewPCG(shuffleSeed, 0x9e3779b97f4a7c15))
	r.Shuffle(len(segs), func(i, j int) { segs[i], segs[j] = segs[j], segs[i] })
	return segs
}
