// Package pattern fills test memory with a deterministic byte pattern and
// checks it, so that two processes produce and check the same bytes and a
// misplaced, shifted, swapped or missing byte shows.
//
// The pattern is deterministic in (seed, descriptor index, offset):
// descriptor d is a random base block (per seed) rotated by a hash of d, and
// the first 8 bytes of each 64 KiB block are a hash of the seed, d and the
// block index. Filling copies whole runs, which keeps it cheap under the
// race detector. Seed 0 is all zeros.
package pattern

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"sync"
)

// block is the period of the pattern; every block starts with a stamp.
const block = 64 << 10

var bases sync.Map // seed -> []byte

func baseBlock(seed uint64) []byte {
	if b, ok := bases.Load(seed); ok {
		return b.([]byte)
	}
	var s [32]byte
	binary.LittleEndian.PutUint64(s[:], seed)
	b := make([]byte, block)
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

// Fill writes positions [off, off+len(b)) of descriptor desc's pattern
// seed into b.
func Fill(b []byte, seed uint64, desc int, off uint64) {
	if seed == 0 {
		clear(b)
		return
	}
	base := baseBlock(seed)
	rot := mix(seed^mix(uint64(desc))) % block
	for i := 0; i < len(b); {
		i += copy(b[i:], base[(off+uint64(i)+rot)%block:])
	}
	end := off + uint64(len(b))
	for blk := off / block; blk*block < end; blk++ {
		var stamp [8]byte
		binary.LittleEndian.PutUint64(stamp[:], mix(seed^mix(uint64(desc)+1)^mix(blk+0x51ed27)))
		for k, c := range stamp {
			if pos := blk*block + uint64(k); pos >= off && pos < end {
				b[pos-off] = c
			}
		}
	}
}

// Check reports where b differs from positions [off, off+len(b)) of
// descriptor desc's pattern seed: the first differing byte, and how many
// differ in the first 1 MiB chunk that differs.
func Check(b []byte, seed uint64, desc int, off uint64) error {
	want := make([]byte, min(len(b), 1<<20))
	for at := 0; at < len(b); at += len(want) {
		got := b[at:min(at+len(want), len(b))]
		w := want[:len(got)]
		Fill(w, seed, desc, off+uint64(at))
		if bytes.Equal(got, w) {
			continue
		}
		// Find the first difference a page at a time: a loop over every
		// byte is slow under the race detector.
		first := 0
		for bytes.Equal(got[first:min(first+4096, len(got))], w[first:min(first+4096, len(w))]) {
			first += 4096
		}
		for got[first] == w[first] {
			first++
		}
		diff := 0
		for i := first; i < len(got); i++ {
			if got[i] != w[i] {
				diff++
			}
		}
		return fmt.Errorf("descriptor %d (%d bytes at pattern offset %d, seed %d): %d bytes differ in [%d, %d); first at offset %d: got 0x%02x, want 0x%02x",
			desc, len(b), off, seed, diff, at, at+len(got), at+first, got[first], w[first])
	}
	return nil
}

var seeds struct {
	sync.Mutex
	n uint64
}

// NextSeed returns a seed, never 0, not returned before in this process.
func NextSeed() uint64 {
	seeds.Lock()
	defer seeds.Unlock()
	seeds.n++
	return seeds.n
}
