package soak

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/pattern"
)

// config is one soak's size.
type config struct {
	name        string
	ops         int           // measured operations per backend, in two halves
	warmup      int           // operations before the start sample
	inFlight    int           // operations in flight at once
	opBytes     int           // cap on the bytes of one operation
	largeDesc   int           // the largest single descriptor
	sampleEvery time.Duration // how often both processes sample RSS and goroutines
}

// maxDescs is the most descriptors an operation names.
const maxDescs = 4096

// opSpec is one operation of the soak: which process exposes memory, for
// which kind of access, and the sizes of its descriptors. Both processes
// fill and check the memory by the operation's ID (see fill).
type opSpec struct {
	ID           int
	Kind         connect.OperationKind
	ChildPassive bool // the child exposes memory and the parent moves the bytes
	Sizes        []int
}

// label names the operation's shape in reports: its kind and the process
// that moves the bytes.
func (s opSpec) label() string {
	by := "parent"
	if !s.ChildPassive {
		by = "child"
	}
	return fmt.Sprintf("%v by %s", s.Kind, by)
}

func (s opSpec) bytes() int64 {
	var n int64
	for _, size := range s.Sizes {
		n += int64(size)
	}
	return n
}

// plan returns operation id of a soak seeded with seed: deterministic, so a
// failure can be replayed. Descriptor counts are log-uniform over [1, 4096],
// with both extremes drawn often; sizes are log-uniform in [1 B, 64 KiB],
// or one size for every descriptor (KV-cache blocks), or for up to four
// descriptors large ones up to c.largeDesc; the total is capped at
// c.opBytes by capping each descriptor at c.opBytes / count.
func (c config) plan(seed uint64, id int) opSpec {
	r := rand.New(rand.NewPCG(seed, uint64(id)))
	s := opSpec{ID: id, Kind: connect.KindRead, ChildPassive: r.IntN(2) == 0}
	if r.IntN(2) == 0 {
		s.Kind = connect.KindWrite
	}
	var n int
	switch p := r.IntN(100); {
	case p < 3:
		n = 1
	case p < 6:
		n = maxDescs
	default:
		n = logUniform(r, 1, maxDescs)
	}
	s.Sizes = make([]int, n)
	perDesc := max(1, c.opBytes/n)
	switch p := r.IntN(10); {
	case n <= 4 && p < 4:
		for i := range s.Sizes {
			s.Sizes[i] = min(logUniform(r, 64<<10, c.largeDesc), perDesc)
		}
	case p < 5:
		block := min(1<<r.IntN(17), perDesc)
		for i := range s.Sizes {
			s.Sizes[i] = block
		}
	default:
		for i := range s.Sizes {
			s.Sizes[i] = min(logUniform(r, 1, 64<<10), perDesc)
		}
	}
	return s
}

// logUniform returns an integer in [lo, hi] whose logarithm is uniform.
func logUniform(r *rand.Rand, lo, hi int) int {
	v := int(math.Exp(math.Log(float64(lo)) + r.Float64()*(math.Log(float64(hi)+1)-math.Log(float64(lo)))))
	return min(max(v, lo), hi)
}

// The two patterns memory holds: what an operation moves (dataSeed), and
// what memory that receives it holds before (fillerSeed), so that a
// descriptor the transfer skipped shows. Only two seeds, since package
// pattern keeps a 64 KiB block per seed for the life of the process; every
// descriptor of every operation still gets a pattern of its own (see tag).
const (
	dataSeed   = 0x9e3779b97f4a7c15
	fillerSeed = 0x2545f4914f6cdd1d
)

// tag is the pattern index of descriptor i of operation id: unique per
// operation and descriptor, so that bytes of another operation, or of
// another descriptor of the same one, do not pass the check.
func tag(id, i int) int { return id*maxDescs + i }

// newSlab returns memory for operation id's descriptors, filled with
// pattern seed.
func newSlab(id int, sizes []int, seed uint64) *pattern.Slab {
	s := pattern.NewSlab(sizes)
	fillSlab(s, id, seed)
	return s
}

// fillSlab writes pattern seed of operation id into s's descriptors.
func fillSlab(s *pattern.Slab, id int, seed uint64) {
	for i, b := range s.Bufs() {
		pattern.Fill(b, seed, tag(id, i), 0)
	}
}

func descriptors(s *pattern.Slab) []connect.Descriptor {
	ds := make([]connect.Descriptor, len(s.Bufs()))
	for i, b := range s.Bufs() {
		ds[i] = connect.NewDescriptor(b)
	}
	return ds
}

// damage is what differs in memory from what an operation should have left
// there: counted, not just found.
type damage struct {
	Descs  int      `json:"descs,omitempty"`  // descriptors whose bytes differ
	Guards int      `json:"guards,omitempty"` // guard runs overwritten
	First  []string `json:"first,omitempty"`  // the first few, described
}

// keepFirst bounds how many problems are described, per operation and per
// report.
const keepFirst = 4

func (d *damage) note(err error) {
	if len(d.First) < keepFirst {
		d.First = append(d.First, err.Error())
	}
}

func (d damage) count() int { return d.Descs + d.Guards }

// check compares every descriptor of s with pattern seed of operation id,
// and every guard run around them with pattern.GuardByte.
func check(s *pattern.Slab, id int, seed uint64) damage {
	var d damage
	mem, bufs := s.Mem(), s.Bufs()
	guard := func(g []byte, before int) {
		for j, c := range g {
			if c != pattern.GuardByte {
				d.Guards++
				d.note(fmt.Errorf("op %d: guard before descriptor %d of %d overwritten: byte %d is 0x%02x", id, before, len(bufs), j, c))
				return
			}
		}
	}
	off := 0
	for i, b := range bufs {
		guard(mem[off:off+pattern.GuardLen], i)
		off += pattern.GuardLen
		if err := pattern.Check(b, seed, tag(id, i), 0); err != nil {
			d.Descs++
			d.note(fmt.Errorf("op %d, descriptor %d of %d: %w", id, i, len(bufs), err))
		}
		off += len(b)
	}
	guard(mem[off:], len(bufs))
	return d
}
