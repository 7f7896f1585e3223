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

// SliceAfter joins neighbouring pieces only within one allocation, after
// checking each; a range outside the exposure is refused and counted as by
// Slice, whatever prev is.
func TestLeaseSliceAfter(t *testing.T) {
	a := newTestAgent(t)
	pool := make([]byte, 4*64)
	for i := range pool {
		pool[i] = byte(i)
	}
	apart := make([]byte, 64) // an allocation of its own
	regions := []Local{DRAM(pool[0:64]), DRAM(pool[64:128]), DRAM(pool[128:192:192]), DRAM(pool[192:256]), DRAM(apart)}
	e, err := a.Expose(AccessRead, regions)
	require.NoError(t, err)
	defer e.Revoke()
	l, err := a.open(NewLink(a.id), e.Key(), AccessRead, false)
	require.NoError(t, err)
	defer l.Release()
	at := func(b []byte) uint64 { return DRAM(b).Addr }
	base := at(pool)

	b, joined, err := l.SliceAfter(nil, base+10, 54)
	require.NoError(t, err)
	require.False(t, joined)
	require.Equal(t, pool[10:64], b)
	b, joined, err = l.SliceAfter(b, base+64, 64)
	require.NoError(t, err)
	require.True(t, joined, "the next block of the pool")
	require.Equal(t, pool[10:128], b)
	require.Equal(t, len(b), cap(b), "a joined slice reaches no further than what was checked")
	b, joined, err = l.SliceAfter(b, base+128, 32)
	require.NoError(t, err)
	require.True(t, joined, "a region whose own capacity is cut still follows the run")
	require.Equal(t, pool[10:160], b)
	b, joined, err = l.SliceAfter(b, base+160, 32)
	require.NoError(t, err)
	require.True(t, joined)
	b, joined, err = l.SliceAfter(b, base+192, 64)
	require.NoError(t, err)
	require.True(t, joined, "the run's capacity is its first region's")
	require.Equal(t, pool[10:256], b)

	b, joined, err = l.SliceAfter(nil, base+128, 64)
	require.NoError(t, err)
	require.False(t, joined)
	b, joined, err = l.SliceAfter(b, base+192, 64)
	require.NoError(t, err)
	require.False(t, joined, "a run from the region whose capacity ends at 192")
	require.Equal(t, pool[192:256], b)

	_, joined, err = l.SliceAfter(b, at(apart), 64)
	require.NoError(t, err)
	require.False(t, joined, "another allocation")

	refused := a.Stats().Refused
	_, _, err = l.SliceAfter(pool[0:64], base+250, 10)
	require.ErrorIs(t, err, ErrAccessDenied, "past the pool")
	_, err = l.Slice(base+60, 8)
	require.ErrorIs(t, err, ErrAccessDenied, "across two exposed regions")
	require.Equal(t, refused+2, a.Stats().Refused)

	_, ok := Extend(pool[0:64:64], pool[64:128])
	require.False(t, ok, "no capacity to reach the next bytes")
	j, ok := Extend(pool[0:64], pool[64:128])
	require.True(t, ok)
	require.Equal(t, pool[0:128], j)
	_, ok = Extend(pool[0:64], pool[65:128])
	require.False(t, ok, "not adjacent")
}
