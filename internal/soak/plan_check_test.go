package soak

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/pattern"
)

// The soak is only as good as its checker: it must count every damaged
// descriptor and guard, and tell one operation's bytes from another's.
func TestCheckCountsDamage(t *testing.T) {
	sizes := []int{1, 7, 70000, 3}
	s := newSlab(5, sizes, dataSeed)
	require.Zero(t, check(s, 5, dataSeed).count())

	d := check(s, 6, dataSeed)
	assert.Equal(t, len(sizes), d.Descs, "another operation's pattern, every descriptor")
	assert.Zero(t, d.Guards)
	assert.Len(t, d.First, keepFirst)

	mem := s.Mem()
	mem[0] ^= 0xff                         // the leading guard
	s.Bufs()[1][6] ^= 0xff                 // the last byte of descriptor 1
	s.Bufs()[2][65536] ^= 0xff             // a stamp inside descriptor 2
	mem[len(mem)-pattern.GuardLen] ^= 0xff // the trailing guard
	d = check(s, 5, dataSeed)
	assert.Equal(t, 2, d.Descs)
	assert.Equal(t, 2, d.Guards)
	assert.Equal(t, 4, d.count())
	assert.Contains(t, d.First[0], "guard before descriptor 0")

	// A descriptor that overran into the next one's guard.
	s = newSlab(5, sizes, dataSeed)
	s.Mem()[pattern.GuardLen+1] = 0 // what a write one byte too long leaves
	d = check(s, 5, dataSeed)
	assert.Equal(t, damage{Guards: 1}, damage{Descs: d.Descs, Guards: d.Guards})
	assert.Contains(t, d.First[0], "guard before descriptor 1")
}

func TestPlanCoversTheShapes(t *testing.T) {
	for _, cfg := range []config{mode, {ops: 10240, opBytes: 8 << 20, largeDesc: 4 << 20}} {
		var (
			kinds   = map[string]int{}
			counts  []int
			largest int
		)
		n := cfg.ops
		for id := range n {
			s := cfg.plan(42, id)
			require.Equal(t, s, cfg.plan(42, id), "the plan is deterministic")
			kinds[s.label()]++
			counts = append(counts, len(s.Sizes))
			require.LessOrEqual(t, s.bytes(), int64(cfg.opBytes), "op %d", id)
			require.Positive(t, slices.Min(s.Sizes), "op %d", id)
			largest = max(largest, slices.Max(s.Sizes))
		}
		assert.Len(t, kinds, 4, "READ and WRITE, by either process: %v", kinds)
		for k, c := range kinds {
			assert.Greater(t, c, n/8, "%s", k)
		}
		assert.Equal(t, 1, slices.Min(counts))
		assert.Equal(t, maxDescs, slices.Max(counts))
		assert.Greater(t, largest, 64<<10, "some descriptors larger than 64 KiB")
		assert.Contains(t, []connect.OperationKind{connect.KindRead, connect.KindWrite}, cfg.plan(1, 1).Kind)
	}
}
