package serve

import (
	"fmt"
	"sync"
)

// Caps counts connections per key and holds each key to a limit: per remote
// address (tcp's WithMaxConnsPerIP), per claimed identity at an address
// (WithMaxConnsPerPeer), per peer process (cma's WithMaxConnsPerProcess).
// A key that holds nothing takes no memory.
//
// Create one with NewCaps. Safe for concurrent use. Caps never calls out
// while it holds its lock, so a caller may use it under a lock of its own.
type Caps[K comparable] struct {
	limit int

	mu sync.Mutex
	n  map[K]int
}

// NewCaps returns a Caps that lets each key hold at most limit connections;
// limit must be at least 1.
func NewCaps[K comparable](limit int) *Caps[K] {
	if limit < 1 {
		panic("serve: Caps must let a key hold at least one connection")
	}
	return &Caps[K]{limit: limit, n: map[K]int{}}
}

// Max returns how many connections one key may hold.
func (c *Caps[K]) Max() int { return c.limit }

// Acquire counts one more connection for k and reports true, or reports
// false, counting nothing, if k already holds Max. Each true is undone by
// one Release.
func (c *Caps[K]) Acquire(k K) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n[k] >= c.limit {
		return false
	}
	c.n[k]++
	return true
}

// Release uncounts one connection of k, counted by Acquire. Releasing more
// than was acquired is a bug in the caller, and panics.
func (c *Caps[K]) Release(k K) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch n := c.n[k]; {
	case n > 1:
		c.n[k] = n - 1
	case n == 1:
		delete(c.n, k)
	default:
		panic(fmt.Sprintf("serve: Caps.Release of %v, which holds nothing", k))
	}
}

// Count returns how many connections k holds.
func (c *Caps[K]) Count(k K) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[k]
}

// Len returns how many keys hold at least one connection.
func (c *Caps[K]) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.n)
}
