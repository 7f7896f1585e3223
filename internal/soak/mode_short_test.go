//go:build !soak

package soak

import "time"

// mode is the short soak CI runs under the race detector: the same shapes
// as the full one (1 to 4096 descriptors, 64 in flight, both directions,
// both kinds), fewer and smaller operations.
var mode = config{
	name:        "short",
	ops:         384,
	warmup:      64,
	inFlight:    64,
	opBytes:     1 << 20,
	largeDesc:   1 << 20,
	sampleEvery: 50 * time.Millisecond,
}
