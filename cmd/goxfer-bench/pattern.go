package main

import (
	"encoding/binary"
	"fmt"
)

// Check mode fills buffers with a pattern that depends on a seed and on the
// offset, so a byte that lands in the wrong place, a stale byte from an
// earlier operation or a byte never written is caught.

func mix(x uint64) uint64 { // splitmix64
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

func seedOf(round uint64, which uint64) uint64 { return mix(round<<32 ^ which) }

// readSeed is the pattern of a READ slot; writeSeed that of one WRITE.
func readSeed(round uint64, slot int) uint64 { return seedOf(round, uint64(slot)) }
func writeSeed(round uint64, op int) uint64  { return seedOf(round, 1<<31|uint64(op)) }

func fill(buf []byte, seed uint64) { fillFrom(buf, seed, 0) }

// fillFrom writes the bytes of fill's pattern that lie at offsets
// [base, base+len(buf)) of a buffer; base is a multiple of 8.
func fillFrom(buf []byte, seed uint64, base int) {
	seed += uint64(base)
	n := len(buf) &^ 7
	for j := 0; j < n; j += 8 {
		binary.LittleEndian.PutUint64(buf[j:], mix(seed+uint64(j)))
	}
	if n < len(buf) {
		var tail [8]byte
		binary.LittleEndian.PutUint64(tail[:], mix(seed+uint64(n)))
		copy(buf[n:], tail[:])
	}
}

// verify reports the first byte of buf that differs from fill's pattern.
func verify(buf []byte, seed uint64) error { return verifyFrom(buf, seed, 0) }

// verifyFrom is verify for the piece of a buffer at offset base (a
// multiple of 8), naming bytes by their offset in the whole buffer.
func verifyFrom(buf []byte, seed uint64, base int) error {
	seed += uint64(base)
	n := len(buf) &^ 7
	for j := 0; j < n; j += 8 {
		if got, want := binary.LittleEndian.Uint64(buf[j:]), mix(seed+uint64(j)); got != want {
			for k := range 8 {
				if byte(got>>(8*k)) != byte(want>>(8*k)) {
					return fmt.Errorf("byte %d: got 0x%02x, want 0x%02x", base+j+k, byte(got>>(8*k)), byte(want>>(8*k)))
				}
			}
		}
	}
	if n < len(buf) {
		var tail [8]byte
		binary.LittleEndian.PutUint64(tail[:], mix(seed+uint64(n)))
		for k := n; k < len(buf); k++ {
			if buf[k] != tail[k-n] {
				return fmt.Errorf("byte %d: got 0x%02x, want 0x%02x", base+k, buf[k], tail[k-n])
			}
		}
	}
	return nil
}

// poison overwrites buf so that a READ that leaves bytes untouched fails
// verification.
func poison(buf []byte) {
	for i := range buf {
		buf[i] = 0xA5
	}
}
