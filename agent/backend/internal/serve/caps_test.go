package serve

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestCaps(t *testing.T) {
	c := NewCaps[netip.Addr](2)
	assert.Equal(t, 2, c.Max())
	a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	assert.True(t, c.Acquire(a))
	assert.True(t, c.Acquire(a))
	assert.False(t, c.Acquire(a), "a third from one key")
	assert.Equal(t, 2, c.Count(a), "a refusal counts nothing")
	assert.True(t, c.Acquire(b), "other keys are unaffected")
	assert.Equal(t, 2, c.Len())

	c.Release(a)
	assert.Equal(t, 1, c.Count(a))
	assert.True(t, c.Acquire(a), "a release makes room")
	c.Release(a)
	c.Release(a)
	assert.Zero(t, c.Count(a))
	assert.Equal(t, 1, c.Len(), "a key holding nothing is forgotten")
	assert.Panics(t, func() { c.Release(a) }, "releasing what was not acquired")
	c.Release(b)
	assert.Zero(t, c.Len())
}

func TestCapsLimitMustBePositive(t *testing.T) {
	assert.Panics(t, func() { NewCaps[int](0) })
}

// Under concurrent use no key ever holds more than the limit.
func TestCapsConcurrent(t *testing.T) {
	const limit = 5
	c := NewCaps[int](limit)
	var held [3]atomic.Int64
	var wg sync.WaitGroup
	for w := range 12 {
		wg.Go(func() {
			k := w % 3
			for range 1000 {
				if !c.Acquire(k) {
					continue
				}
				if n := held[k].Add(1); n > limit {
					t.Errorf("key %d holds %d, limit %d", k, n, limit)
				}
				held[k].Add(-1)
				c.Release(k)
			}
		})
	}
	wg.Wait()
	assert.Zero(t, c.Len())
}
