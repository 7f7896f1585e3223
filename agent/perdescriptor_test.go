package agent

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An agent none of whose backends registers memory counts registrations
// per Register call, not per region: the counts it reports are the same.
func TestRegistrationWithoutRegistrarIsCounted(t *testing.T) {
	a := newTestAgent(t)
	require.False(t, a.registrars)
	buf := make([]byte, 4096)
	l := DRAM(buf)
	other := DRAM(buf[:100]) // overlapping, but another region

	r1, err := a.Register(l)
	require.NoError(t, err)
	r2, err := a.Register(l, other, other)
	require.NoError(t, err)
	regions, refs := a.Registered()
	assert.Equal(t, 2, regions)
	assert.Equal(t, 4, refs)
	assert.Equal(t, 2, a.Stats().Registered)

	require.NoError(t, r1.Release())
	require.NoError(t, r1.Release()) // idempotent
	regions, refs = a.Registered()
	assert.Equal(t, 2, regions, "the other reference keeps the region registered")
	assert.Equal(t, 3, refs)

	require.NoError(t, r2.Release())
	regions, refs = a.Registered()
	assert.Equal(t, 0, regions)
	assert.Equal(t, 0, refs)
	assert.Equal(t, 0, a.Stats().Registered)

	_, err = a.Register(l, Local{Region: Region{Addr: 1, Len: 0}})
	assert.ErrorIs(t, err, ErrInvalid)
	regions, refs = a.Registered()
	assert.Equal(t, [2]int{0, 0}, [2]int{regions, refs}, "a refused Register holds nothing")
}

// findFrom answers what find answers whatever the hint, and a walk over
// the regions in order finds each with the hint it leaves.
func TestRegionSetFindFromMatchesFind(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for round := range 200 {
		var ls []Local
		for range 1 + rng.IntN(40) {
			ls = append(ls, region(uint64(rng.IntN(10000)), uint64(1+rng.IntN(800))))
		}
		set := newRegionSet(ls)
		hint := rng.IntN(len(ls)+4) - 2
		for range 200 {
			addr, n := uint64(rng.IntN(11000)), uint64(rng.IntN(900))
			want, wok := set.find(addr, n)
			if rng.IntN(4) == 0 {
				hint = rng.IntN(len(ls)+4) - 2 // out of range too
			}
			got, ok := set.findFrom(addr, n, &hint)
			require.Equal(t, wok, ok, "round %d: [%d, +%d)", round, addr, n)
			require.Equal(t, want, got, "round %d: [%d, +%d)", round, addr, n)
		}
	}

	var pool []Local // a KV pool's blocks, adjacent
	for i := range 64 {
		pool = append(pool, region(uint64(1<<20+i*4096), 4096))
	}
	set := newRegionSet(pool)
	hint := 0
	for i, b := range pool {
		r, ok := set.findFrom(b.Addr+10, 100, &hint)
		require.True(t, ok)
		require.Equal(t, b.Addr, r.Addr)
		require.Equal(t, i, hint)
	}
	_, ok := set.findFrom(pool[63].End(), 1, &hint)
	require.False(t, ok, "past the last block")
	_, ok = set.findFrom(pool[10].End()-1, 2, &hint)
	require.False(t, ok, "across two blocks")
}
