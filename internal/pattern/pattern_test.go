package pattern

import (
	"bytes"
	"strconv"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestPatternIsPositional(t *testing.T) {
	const n = 3*block + 1234
	whole := make([]byte, n)
	Fill(whole, 7, 2, 0)
	require.NoError(t, Check(whole, 7, 2, 0))
	// Any window filled on its own matches the same positions of the whole.
	for _, w := range [][2]int{{0, 1}, {3, 5}, {block - 3, 11}, {block, 8}, {block + 1, 2*block + 9}} {
		part := make([]byte, w[1])
		Fill(part, 7, 2, uint64(w[0]))
		assert.Equal(t, whole[w[0]:w[0]+w[1]], part, "window %v", w)
		require.NoError(t, Check(whole[w[0]:w[0]+w[1]], 7, 2, uint64(w[0])))
	}
	// Another seed, descriptor, or position does not match.
	assert.Error(t, Check(whole, 8, 2, 0))
	assert.Error(t, Check(whole, 7, 3, 0))
	assert.Error(t, Check(whole[:8], 7, 2, block), "blocks differ in their stamp")
	assert.Error(t, Check(whole[block:block+8], 7, 2, 0))
	assert.Error(t, Check(whole[1:], 7, 2, 0), "a shift by one byte")
	one := make([]byte, 1)
	differ := 0
	for d := range 64 {
		Fill(one, 7, d, 0)
		if one[0] != whole[0] {
			differ++
		}
	}
	assert.Greater(t, differ, 50, "even 1-byte descriptors tell their index apart, mostly")
	// Away from the stamps, descriptors differ too: a backend that copies a
	// run of the right offset from the wrong descriptor shows.
	other := make([]byte, n)
	Fill(other, 7, 3, 0)
	assert.Error(t, Check(other[100:block], 7, 2, 100))
}

func TestPatternSeedZeroIsZeros(t *testing.T) {
	b := bytes.Repeat([]byte{1}, 2*block+3)
	Fill(b, 0, 5, 17)
	assert.Equal(t, make([]byte, len(b)), b)
	require.NoError(t, Check(b, 0, 5, 17))
	b[block+1] = 1
	assert.Error(t, Check(b, 0, 5, 17))
}

func TestCheckFindsTheFirstDifference(t *testing.T) {
	b := make([]byte, 3<<20)
	Fill(b, 9, 0, 0)
	for _, at := range []int{0, 4095, 4096, 1<<20 - 1, 1 << 20, 3<<20 - 1} {
		b[at] ^= 0xff
		err := Check(b, 9, 0, 0)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "1 bytes differ")
		assert.Contains(t, err.Error(), "first at offset "+strconv.Itoa(at)+":")
		b[at] ^= 0xff
	}
	require.NoError(t, Check(b, 9, 0, 0))
}

func TestNextSeed(t *testing.T) {
	a, b := NextSeed(), NextSeed()
	assert.NotZero(t, a)
	assert.Greater(t, b, a)
}

func TestSlabCheckFindsEveryKindOfDamage(t *testing.T) {
	s := NewSlab([]int{1, 100, 3})
	s.Fill(5)
	require.NoError(t, s.Check(5))
	assert.Equal(t, 1, int(uintptr(unsafe.Pointer(&s.Bufs()[0][0]))%2), "the first descriptor sits at an odd address")
	assert.Equal(t, s.Mem()[GuardLen:GuardLen+1], s.Bufs()[0])
	for i, b := range s.Bufs() {
		assert.Equal(t, len(b), cap(b), "descriptor %d ends at its guard", i)
	}
	for _, off := range []int{0, GuardLen - 1, s.offs[0], s.offs[0] + 1, s.offs[1] + 99, s.offs[1] + 100, len(s.mem) - 1} {
		s.mem[off] ^= 0xff
		assert.Error(t, s.Check(5), "byte %d of the slab damaged", off)
		s.mem[off] ^= 0xff
	}
	require.NoError(t, s.Check(5))
	assert.Error(t, s.Check(6))
	require.NoError(t, s.CheckGuards())
	s.mem[s.offs[2]+3] ^= 0xff
	assert.Error(t, s.CheckGuards(), "the trailing guard")
}
