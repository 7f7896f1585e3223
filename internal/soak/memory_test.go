package soak

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/shm"
	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/pattern"
)

// memory is where a process puts its operations' slabs: the Go heap, or,
// in the shm soak, shared host memory from its Connector's AllocHost, one
// segment per slab, so that every operation maps segments new to the peer
// and frees them again.
type memory struct {
	shared *connect.Connector // nil: the Go heap
}

// memoryFor returns the memory a process of backend's soak uses.
func memoryFor(backend string, c *connect.Connector) memory {
	if backend == "shm" {
		return memory{shared: c}
	}
	return memory{}
}

// opMem is one operation's memory in one process.
type opMem struct {
	*pattern.Slab
	buf *shm.Buffer // nil on the Go heap
}

// slab returns memory for operation id's descriptors, filled with pattern
// seed.
func (m memory) slab(id int, sizes []int, seed uint64) (*opMem, error) {
	if m.shared == nil {
		return &opMem{Slab: newSlab(id, sizes, seed)}, nil
	}
	n := pattern.GuardLen
	for _, size := range sizes {
		n += size + pattern.GuardLen
	}
	buf, err := m.shared.AllocHost(n)
	if err != nil {
		return nil, err
	}
	s := pattern.NewSlabIn(func(int) []byte { return buf.Bytes() }, sizes)
	fillSlab(s, id, seed)
	return &opMem{Slab: s, buf: buf}, nil
}

// free gives shared memory back. Every exposure of it must be closed and
// every transfer awaited by then, so an error (shm.ErrBusy: an exposure
// still open) is the soak's failure.
func (m *opMem) free() error {
	if m.buf == nil {
		return nil
	}
	if err := m.buf.Free(); err != nil {
		return fmt.Errorf("freeing its shared memory: %w", err)
	}
	return nil
}

// The soak's leak check for shared memory is only as good as its count:
// a segment shows, mapped and open, until it is freed.
func TestShmUseCounts(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("shared host memory is Linux's")
	}
	before, _, err := readShmUse()
	require.NoError(t, err)
	buf, err := shm.Alloc(3 << 12)
	require.NoError(t, err)
	during, found, err := readShmUse()
	require.NoError(t, err)
	assert.Equal(t, before.Segments+1, during.Segments, "mappings of segments: %v", found)
	assert.Equal(t, before.SegFDs+1, during.SegFDs, "descriptors open on segments: %v", found)
	require.NoError(t, buf.Free())
	after, _, err := readShmUse()
	require.NoError(t, err)
	assert.Equal(t, before, after)
}
