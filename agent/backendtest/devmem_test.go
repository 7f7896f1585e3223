package backendtest

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/internal/pattern"
)

// TestDevSideCheckFindsEveryKindOfDamage checks the checker the device
// cases rely on: one byte changed anywhere in host or device memory, a
// descriptor's or a guard's, fails Check and is named.
func TestDevSideCheckFindsEveryKindOfDamage(t *testing.T) {
	sim := devmem.NewSim(2)
	s, err := newDevSide(sim, 1, []int{1, 100, 3}, evenOnDevice)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.free()) }()
	require.Equal(t, []agent.MemKind{agent.KindVRAM, agent.KindDRAM, agent.KindVRAM}, []agent.MemKind{s.locals[0].Kind, s.locals[1].Kind, s.locals[2].Kind})
	assert.Equal(t, uint64(1), (s.locals[0].Addr)%2, "the first device descriptor sits at an odd address")
	assert.Equal(t, uint32(1), s.locals[2].Device)
	require.NoError(t, s.Fill(5))
	require.NoError(t, s.Check(5))
	require.Error(t, s.Check(6), "another pattern")

	flip := func(device bool, off int) {
		if !device {
			s.host[off] ^= 0xff
			return
		}
		b := make([]byte, 1)
		require.NoError(t, devmem.CopyToHost(sim, 1, b, s.dev+uintptr(off)))
		b[0] ^= 0xff
		require.NoError(t, devmem.CopyToDevice(sim, 1, s.dev+uintptr(off), b))
	}
	last := len(s.host) - 1
	for _, c := range []struct {
		device bool
		off    int
		at     string
	}{
		{true, 0, "in the leading guard region, byte 0"},
		{false, devEdge - 1, "in the leading guard region, byte 4097"},
		{true, s.offs[0] - 1, "in the guard bytes before descriptor 0 (device memory)"},
		{true, s.offs[0], "at byte 0 of descriptor 0 (1 bytes, in device memory)"},
		{false, s.offs[0], "at byte 0 of descriptor 0 (1 bytes, in device memory)"},      // its host copy: guard bytes
		{true, s.offs[1] + 99, "at byte 99 of descriptor 1 (100 bytes, in host memory)"}, // its device copy: guard bytes
		{false, s.offs[1] + 99, "at byte 99 of descriptor 1 (100 bytes, in host memory)"},
		{true, s.offs[2] + 3, "in the guard bytes after the last descriptor"},
		{false, last, "in the trailing guard region, byte 4097"},
	} {
		where := map[bool]string{true: "device (GPU 1) memory", false: "host memory"}[c.device]
		flip(c.device, c.off)
		err := s.Check(5)
		require.Error(t, err, "byte %d of %s changed", c.off, where)
		assert.Contains(t, err.Error(), where+": 1 bytes differ, the first "+c.at)
		err = s.oldOrNew(5, 6)
		require.Error(t, err, "a changed byte is neither old nor new")
		assert.Contains(t, err.Error(), where+" "+c.at)
		flip(c.device, c.off)
		require.NoError(t, s.Check(5))
	}

	// A descriptor half old, half new passes oldOrNew, not Check.
	require.NoError(t, s.Fill(6))
	half := make([]byte, 50)
	pattern.Fill(half, 5, 1, 0)
	copy(s.host[s.offs[1]:], half)
	require.Error(t, s.Check(6))
	require.NoError(t, s.oldOrNew(5, 6))
}
