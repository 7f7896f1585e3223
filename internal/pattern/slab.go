package pattern

import "fmt"

// GuardLen bytes of GuardByte surround every descriptor of a Slab: a
// backend that writes past a descriptor's end or before its start hits
// them. GuardLen is odd, so descriptors are not aligned as allocations are.
const (
	GuardLen  = 7
	GuardByte = 0xa5
)

// Slab is the memory of one side of a transfer: descriptors carved from one
// allocation, with guard bytes around each.
type Slab struct {
	mem  []byte
	offs []int
	bufs [][]byte
}

// NewSlab returns a Slab of descriptors of the given sizes, all zero, with
// their guard bytes set.
func NewSlab(sizes []int) *Slab {
	return NewSlabIn(func(n int) []byte { return make([]byte, n) }, sizes)
}

// NewSlabIn is NewSlab with the slab's memory, of the size it is given,
// from alloc, which must return zeroed memory (shared memory, say).
func NewSlabIn(alloc func(n int) []byte, sizes []int) *Slab {
	total := GuardLen
	for _, n := range sizes {
		total += n + GuardLen
	}
	s := &Slab{mem: alloc(total)}
	fillGuard(s.mem[:GuardLen])
	off := GuardLen
	for _, n := range sizes {
		s.offs = append(s.offs, off)
		s.bufs = append(s.bufs, s.mem[off:off+n:off+n])
		fillGuard(s.mem[off+n : off+n+GuardLen])
		off += n + GuardLen
	}
	return s
}

func fillGuard(g []byte) {
	for i := range g {
		g[i] = GuardByte
	}
}

// Bufs returns the descriptors, in order; each one's capacity ends where
// its trailing guard starts.
func (s *Slab) Bufs() [][]byte { return s.bufs }

// Mem returns the whole allocation: the descriptors and their guards, the
// first descriptor at offset GuardLen.
func (s *Slab) Mem() []byte { return s.mem }

// Fill writes pattern seed into every descriptor, descriptor i holding
// descriptor index i's pattern from offset 0.
func (s *Slab) Fill(seed uint64) {
	for i, b := range s.bufs {
		Fill(b, seed, i, 0)
	}
}

// Check reports the first descriptor that does not hold pattern seed (as
// Fill wrote it), or else the first guard byte overwritten.
func (s *Slab) Check(seed uint64) error {
	for i, b := range s.bufs {
		if err := Check(b, seed, i, 0); err != nil {
			return err
		}
	}
	return s.CheckGuards()
}

// CheckGuards reports the first guard byte overwritten.
func (s *Slab) CheckGuards() error {
	prev := 0
	for i, off := range s.offs {
		if err := checkGuard(s.mem[prev:off], i); err != nil {
			return err
		}
		prev = off + len(s.bufs[i])
	}
	return checkGuard(s.mem[prev:], len(s.offs))
}

func checkGuard(g []byte, i int) error {
	for j, c := range g {
		if c != GuardByte {
			return fmt.Errorf("guard bytes before descriptor %d overwritten: byte %d is 0x%02x", i, j, c)
		}
	}
	return nil
}
