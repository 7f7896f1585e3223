package backendtest

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// The pattern is deterministic in (seed, descriptor index, offset), so a
// child process can produce and check the same bytes, and any misplaced,
// shifted, swapped or missing byte shows: each 64 KiB block is a random base
// block (per seed) whose first 8 bytes are replaced by a hash of the seed,
// the descriptor index and the block index. Filling copies whole runs, which
// keeps it cheap under the race detector.
const patternBlock = 64 << 10

var bases sync.Map // seed -> []byte

func baseBlock(seed uint64) []byte {
	if b, ok := bases.Load(seed); ok {
		return b.([]byte)
	}
	var s [32]byte
	binary.LittleEndian.PutUint64(s[:], seed)
	b := make([]byte, patternBlock)
	_, _ = rand.NewChaCha8(s).Read(b)
	v, _ := bases.LoadOrStore(seed, b)
	return v.([]byte)
}

func mix(x uint64) uint64 { // splitmix64 finalizer
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// fillPattern writes positions [off, off+len(b)) of descriptor desc's
// pattern into b.
func fillPattern(b []byte, seed uint64, desc int, off uint64) {
	base := baseBlock(seed)
	for i := 0; i < len(b); {
		pos := off + uint64(i)
		blk, in := pos/patternBlock, int(pos%patternBlock)
		n := copy(b[i:], base[in:])
		if in < 8 {
			var st [8]byte
			binary.LittleEndian.PutUint64(st[:], mix(seed^mix(uint64(desc)+1)^mix(blk+0x51ed27)))
			copy(b[i:i+n], st[in:])
		}
		i += n
	}
}

// checkPattern reports where b differs from positions [base, base+len(b))
// of descriptor desc's pattern.
func checkPattern(b []byte, seed uint64, desc int, base uint64) error {
	want := make([]byte, min(len(b), 1<<20))
	for off := 0; off < len(b); off += len(want) {
		got := b[off:min(off+len(want), len(b))]
		w := want[:len(got)]
		fillPattern(w, seed, desc, base+uint64(off))
		if bytes.Equal(got, w) {
			continue
		}
		first, diff := -1, 0
		for i := range got {
			if got[i] != w[i] {
				if first < 0 {
					first = i
				}
				diff++
			}
		}
		return fmt.Errorf("descriptor %d (%d bytes at pattern offset %d, seed %d): %d bytes differ in [%d, %d); first at offset %d: got 0x%02x, want 0x%02x",
			desc, len(b), base, seed, diff, off, off+len(got), off+first, got[first], w[first])
	}
	return nil
}

var seeds struct {
	sync.Mutex
	n uint64
}

// nextSeed returns a seed not used before in this process.
func nextSeed() uint64 {
	seeds.Lock()
	defer seeds.Unlock()
	seeds.n++
	return seeds.n
}

// guardLen bytes of guardByte surround every descriptor of a buffers slab;
// a backend that writes past a descriptor's end or before its start hits
// them. guardLen is odd, so descriptors are not aligned the way allocations
// are.
const (
	guardLen  = 7
	guardByte = 0xa5
)

// buffers is the memory of one side of a transfer: descriptors carved from
// one slab, with guard bytes around each.
type buffers struct {
	slab   []byte
	offs   []int
	locals []agent.Local
}

func newBuffers(sizes []int) *buffers {
	total := guardLen
	for _, n := range sizes {
		total += n + guardLen
	}
	b := &buffers{slab: make([]byte, total)}
	off := guardLen
	for i, n := range sizes {
		b.offs = append(b.offs, off)
		b.locals = append(b.locals, agent.DRAM(b.slab[off:off+n:off+n]))
		if i == 0 {
			fillGuard(b.slab[:off])
		}
		fillGuard(b.slab[off+n : off+n+guardLen])
		off += n + guardLen
	}
	return b
}

func fillGuard(g []byte) {
	for i := range g {
		g[i] = guardByte
	}
}

// fill writes pattern seed into every descriptor.
func (b *buffers) fill(seed uint64) {
	for i, l := range b.locals {
		fillPattern(l.Mem, seed, i, 0)
	}
}

// check verifies every descriptor holds pattern seed and every guard byte
// is intact.
func (b *buffers) check(seed uint64) error {
	for i, l := range b.locals {
		if err := checkPattern(l.Mem, seed, i, 0); err != nil {
			return err
		}
	}
	prev := 0
	for i, off := range b.offs {
		if err := checkGuard(b.slab[prev:off], i); err != nil {
			return err
		}
		prev = off + len(b.locals[i].Mem)
	}
	return checkGuard(b.slab[prev:], len(b.offs))
}

func checkGuard(g []byte, i int) error {
	for j, c := range g {
		if c != guardByte {
			return fmt.Errorf("guard bytes before descriptor %d overwritten: byte %d is 0x%02x", i, j, c)
		}
	}
	return nil
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
	regs := make([]*agent.Registration, 0, len(b.locals))
	for i, l := range b.locals {
		r, err := a.Register(l)
		if err != nil {
			for _, r := range regs {
				_ = r.Release()
			}
			return nil, fmt.Errorf("register descriptor %d: %w", i, err)
		}
		regs = append(regs, r)
	}
	return regs, nil
}

// segments pairs local descriptor i with remote region i, listed in a
// shuffled order so that backends must honour addresses, not positions.
func segments(local *buffers, remote []agent.Region, shuffleSeed uint64) []agent.Segment {
	segs := make([]agent.Segment, len(local.locals))
	for i, l := range local.locals {
		segs[i] = agent.Segment{Local: l, Remote: remote[i]}
	}
	r := rand.New(rand.NewPCG(shuffleSeed, 0x9e3779b97f4a7c15))
	r.Shuffle(len(segs), func(i, j int) { segs[i], segs[j] = segs[j], segs[i] })
	return segs
}
