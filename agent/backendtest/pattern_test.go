package backendtest

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestPatternIsPositional(t *testing.T) {
	const n = 3*patternBlock + 1234
	whole := make([]byte, n)
	fillPattern(whole, 7, 2, 0)
	require.NoError(t, checkPattern(whole, 7, 2, 0))
	// Any window filled on its own matches the same positions of the whole.
	for _, w := range [][2]int{{0, 1}, {3, 5}, {patternBlock - 3, 11}, {patternBlock, 8}, {patternBlock + 1, 2*patternBlock + 9}} {
		part := make([]byte, w[1])
		fillPattern(part, 7, 2, uint64(w[0]))
		assert.Equal(t, whole[w[0]:w[0]+w[1]], part, "window %v", w)
		require.NoError(t, checkPattern(whole[w[0]:w[0]+w[1]], 7, 2, uint64(w[0])))
	}
	// Another seed, descriptor, or position does not match.
	assert.Error(t, checkPattern(whole, 8, 2, 0))
	assert.Error(t, checkPattern(whole, 7, 3, 0))
	assert.Error(t, checkPattern(whole[:8], 7, 2, patternBlock), "blocks differ in their stamp")
	assert.Error(t, checkPattern(whole[patternBlock:patternBlock+8], 7, 2, 0))
	assert.Error(t, checkPattern(whole[1:], 7, 2, 0), "a shift by one byte")
	one := make([]byte, 1)
	differ := 0
	for d := range 64 {
		fillPattern(one, 7, d, 0)
		if one[0] != whole[0] {
			differ++
		}
	}
	assert.Greater(t, differ, 50, "even 1-byte descriptors tell their index apart, mostly")
}

func TestBuffersCheckFindsEveryKindOfDamage(t *testing.T) {
	b := newBuffers([]int{1, 100, 3})
	b.fill(5)
	require.NoError(t, b.check(5))
	assert.Equal(t, 1, int(b.locals[0].Addr%2), "the first descriptor sits at an odd address")
	for _, off := range []int{0, guardLen - 1, b.offs[0], b.offs[0] + 1, b.offs[1] + 99, b.offs[1] + 100, len(b.slab) - 1} {
		b.slab[off] ^= 0xff
		assert.Error(t, b.check(5), "byte %d of the slab damaged", off)
		b.slab[off] ^= 0xff
	}
	require.NoError(t, b.check(5))
	assert.Error(t, b.check(6))
}
