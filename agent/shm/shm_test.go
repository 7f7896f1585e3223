//go:build linux

package shm_test

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent/shm"
)

func addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

func TestAllocFindFree(t *testing.T) {
	b, err := shm.Alloc(5000)
	require.NoError(t, err)
	mem := b.Bytes()
	require.Len(t, mem, 5000)
	require.Equal(t, 5000, cap(mem))
	for _, x := range mem {
		require.Zero(t, x)
	}
	sg, ok := shm.Find(addr(mem)+10, 100)
	require.True(t, ok)
	require.Equal(t, addr(mem), sg.Base)
	require.Equal(t, uint64(8192), sg.Size, "rounded up to pages")
	_, ok = shm.Find(addr(mem)+8000, 1000)
	require.False(t, ok, "a range running past the segment")
	_, ok = shm.Find(addr(mem), 0)
	require.False(t, ok)
	require.NoError(t, b.Free())
	_, ok = shm.Find(addr(mem), 1)
	require.False(t, ok, "found after Free")
	_, err = shm.DupFD(sg.ID)
	require.Error(t, err)
}

func TestAllocSizes(t *testing.T) {
	for _, n := range []int{0, -1, shm.MaxSize + 1} {
		_, err := shm.Alloc(n)
		require.ErrorIs(t, err, shm.ErrInvalid, "size %d", n)
	}
}

func TestPinRefusesFree(t *testing.T) {
	b, err := shm.Alloc(4096)
	require.NoError(t, err)
	unpin := shm.Pin(addr(b.Bytes()), 4096)
	require.NotNil(t, unpin)
	require.ErrorIs(t, b.Free(), shm.ErrBusy)
	unpin()
	unpin() // once only
	require.NoError(t, b.Free())
	require.Nil(t, shm.Pin(addr(make([]byte, 10)), 10), "heap memory lies in no segment")
}

// A peer's mapping of a segment sees the owner's bytes and the owner sees
// its writes; the file is sealed against resizing, and Map refuses files
// that could shrink under a mapping or that are smaller than claimed.
func TestMapSharesBytes(t *testing.T) {
	b, err := shm.Alloc(1 << 20)
	require.NoError(t, err)
	defer b.Free()
	sg, _ := shm.Find(addr(b.Bytes()), 1)
	fd, err := shm.DupFD(sg.ID)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.Error(t, unix.Ftruncate(fd, 1<<30), "sealed")
	m, err := shm.Map(fd, sg.Size)
	require.NoError(t, err)
	b.Bytes()[77] = 9
	require.Equal(t, byte(9), m[77])
	m[78] = 7
	require.Equal(t, byte(7), b.Bytes()[78])
	require.NoError(t, shm.Unmap(m))

	_, err = shm.Map(fd, sg.Size+4096)
	require.ErrorIs(t, err, shm.ErrInvalid, "bigger than the file")
	raw, err := unix.MemfdCreate("x", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(raw)
	require.NoError(t, unix.Ftruncate(raw, 4096))
	_, err = shm.Map(raw, 4096)
	require.ErrorIs(t, err, shm.ErrInvalid, "unsealed")
}

// Free closes the segment's descriptor: allocating and freeing many
// leaves no descriptor behind.
func TestNoDescriptorLeak(t *testing.T) {
	before := openFDs(t)
	for range 200 {
		b, err := shm.Alloc(4096)
		require.NoError(t, err)
		require.NoError(t, b.Free())
	}
	require.LessOrEqual(t, openFDs(t), before+2)
}

func openFDs(t *testing.T) int {
	fd, err := unix.Open("/proc/self/fd", unix.O_RDONLY|unix.O_DIRECTORY, 0)
	require.NoError(t, err)
	defer unix.Close(fd)
	n := 0
	buf := make([]byte, 1<<16)
	for {
		k, err := unix.ReadDirent(fd, buf)
		require.NoError(t, err)
		if k == 0 {
			break
		}
		_, c, _ := unix.ParseDirent(buf[:k], -1, nil)
		n += c
	}
	return n
}
