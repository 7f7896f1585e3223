package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// monoNow reads CLOCK_MONOTONIC, as the target's completion times do in
// another process: between two clock_gettime system calls, give or take
// the calibration's bracket (a millisecond allows for a descheduled
// calibration; a wrong base would be off by the machine's uptime).
func TestMonoNowIsClockMonotonic(t *testing.T) {
	sys := func() int64 {
		var ts unix.Timespec
		require.NoError(t, unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts))
		return ts.Nano()
	}
	const slack = int64(time.Millisecond)
	for range 200 {
		lo := sys()
		m := monoNow()
		hi := sys()
		require.GreaterOrEqual(t, m, lo-slack)
		require.LessOrEqual(t, m, hi+slack)
		time.Sleep(50 * time.Microsecond)
	}
}
