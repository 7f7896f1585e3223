//go:build soak

package soak

import "time"

// mode is the full soak, run with -tags soak: more than 10,000 operations
// per backend, up to 8 MiB each.
var mode = config{
	name:        "full",
	ops:         10240,
	warmup:      256,
	inFlight:    64,
	opBytes:     8 << 20,
	largeDesc:   4 << 20,
	sampleEvery: 250 * time.Millisecond,
}
