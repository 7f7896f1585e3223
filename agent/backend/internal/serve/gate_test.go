package serve

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The oldest connection still inside is evicted when the gate is full: it
// is closed, and its pass says so; connections that left are not counted.
func TestGateEvictsOldest(t *testing.T) {
	g := NewGate(3)
	assert.Equal(t, 3, g.Max())
	var cs [7]*closeConn
	var ps [7]*Pass
	enter := func(i int) bool {
		cs[i] = &closeConn{}
		var ev bool
		ps[i], ev = g.Enter(cs[i])
		return ev
	}
	for i := range 3 {
		assert.False(t, enter(i), "room for %d", i)
	}
	assert.Equal(t, 3, g.Len())
	assert.True(t, enter(3))
	assert.True(t, enter(4))
	assert.Equal(t, 3, g.Len())
	assert.Equal(t, 1, cs[0].closes(), "the oldest is closed")
	assert.Equal(t, 1, cs[1].closes(), "then the next oldest")
	assert.Zero(t, cs[2].closes())
	assert.False(t, ps[0].Done(), "an evicted connection may not go on")
	assert.False(t, ps[0].Done(), "and Done says so again")

	// 2 leaves: the oldest inside is now 3, which the next full gate evicts.
	assert.True(t, ps[2].Done())
	assert.True(t, ps[2].Done(), "a second Done is harmless")
	assert.Equal(t, 2, g.Len())
	assert.False(t, enter(5), "2 made room")
	assert.True(t, enter(6))
	assert.Equal(t, 1, cs[3].closes(), "the oldest still inside is evicted")
	assert.Zero(t, cs[2].closes(), "one that left is never evicted")
	assert.False(t, ps[3].Done())
	for _, i := range []int{4, 5, 6} {
		assert.True(t, ps[i].Done(), "%d", i)
	}
	assert.Zero(t, g.Len())
	for _, i := range []int{4, 5, 6} {
		assert.Zero(t, cs[i].closes(), "%d", i)
	}
}

// A gate of one evicts each connection as the next enters.
func TestGateOfOne(t *testing.T) {
	g := NewGate(1)
	a, b := &closeConn{}, &closeConn{}
	pa, ev := g.Enter(a)
	require.False(t, ev)
	pb, ev := g.Enter(b)
	require.True(t, ev)
	assert.False(t, pa.Done())
	assert.True(t, pb.Done())
	assert.Equal(t, 1, a.closes())
	assert.Zero(t, b.closes())
}

func TestGateLimitMustBePositive(t *testing.T) {
	assert.Panics(t, func() { NewGate(0) })
	assert.Panics(t, func() { NewGate(-1) })
}

// reentrantCloser calls back into its gate while it is closed: the gate
// closes evicted connections without holding its lock.
type reentrantCloser struct {
	g      *Gate
	closed atomic.Bool
}

func (c *reentrantCloser) Close() error {
	_ = c.g.Len()
	c.closed.Store(true)
	return nil
}

func TestGateClosesOutsideItsLock(t *testing.T) {
	g := NewGate(1)
	c := &reentrantCloser{g: g}
	p, _ := g.Enter(c)
	_, ev := g.Enter(&closeConn{})
	require.True(t, ev)
	assert.True(t, c.closed.Load())
	assert.False(t, p.Done())
}

// Under concurrent use every connection either leaves or is evicted and
// closed, exactly once, and the gate never holds more than its limit.
func TestGateConcurrent(t *testing.T) {
	const limit, workers, each = 8, 16, 500
	g := NewGate(limit)
	var evictions, evictedDone, left, closed atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range each {
				c := &countingCloser{n: &closed}
				p, ev := g.Enter(c)
				if ev {
					evictions.Add(1)
				}
				if n := g.Len(); n > limit {
					t.Errorf("%d inside a gate of %d", n, limit)
				}
				if i%3 == 0 {
					continue // left inside, for a later Enter to evict
				}
				if p.Done() {
					left.Add(1)
				} else {
					evictedDone.Add(1)
				}
			}
		})
	}
	wg.Wait()
	inside := int64(g.Len())
	assert.LessOrEqual(t, inside, int64(limit))
	assert.Equal(t, evictions.Load(), closed.Load(), "each eviction closes one connection")
	assert.Equal(t, int64(workers*each), left.Load()+evictions.Load()+inside, "each connection left, was evicted, or is inside")
	assert.LessOrEqual(t, evictedDone.Load(), evictions.Load())
}

type countingCloser struct{ n *atomic.Int64 }

func (c *countingCloser) Close() error { c.n.Add(1); return nil }
