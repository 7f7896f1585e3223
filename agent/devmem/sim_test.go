package devmem

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"regexp"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func randomBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return b
}

func TestSimCheck(t *testing.T) {
	s := NewSim(2)
	p, err := s.Alloc(1, 10000)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Free(p)) }()

	require.NoError(t, s.Check(p, 10000, 1))
	require.NoError(t, s.Check(p+100, 9900, 1))
	for _, c := range []struct {
		ptr  uintptr
		n    uint64
		dev  int
		want string
	}{
		{p, 10000, 0, "memory of GPU 1, not of GPU 0"},
		{p + 1, 10000, 1, "runs past the end of its allocation"},
		{p + 10000, 1, 1, "not memory of any simulated GPU"},
		{p - 1, 1, 1, "not memory of any simulated GPU"},
		{0x1000, 1, 1, "not memory of any simulated GPU"},
	} {
		err := s.Check(c.ptr, c.n, c.dev)
		require.ErrorIs(t, err, ErrNotDevice, "0x%x+%d on %d", c.ptr, c.n, c.dev)
		assert.Contains(t, err.Error(), c.want)
	}
	_, err = s.Alloc(2, 10)
	require.ErrorIs(t, err, ErrNotDevice)
	_, err = s.NewStream(-1)
	require.ErrorIs(t, err, ErrNotDevice)
	require.Error(t, s.Free(p+1), "Free of a pointer Alloc did not return")
}

func TestSimRoundTrip(t *testing.T) {
	s := NewSim(1)
	const n = 3<<20 + 5
	p, err := s.Alloc(0, n)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Free(p)) }()
	src := randomBytes(n)
	require.NoError(t, CopyToDevice(s, 0, p, src))
	host, err := s.HostAlloc(n)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.HostFree(host)) }()
	require.NoError(t, CopyToHost(s, 0, host, p))
	require.True(t, bytes.Equal(src, host))

	// Many small copies, one Sync.
	st, err := s.NewStream(0)
	require.NoError(t, err)
	out := make([]byte, n)
	for off := 0; off < n; off += 4096 {
		end := min(off+4096, n)
		require.NoError(t, st.ToHost(out[off:end], p+uintptr(off)))
	}
	require.NoError(t, st.Sync())
	require.True(t, bytes.Equal(src, out))
	require.NoError(t, st.Close())
	require.Error(t, st.ToHost(out[:1], p), "a closed stream refuses copies")

	// A copy that runs past the allocation is refused when queued.
	st, err = s.NewStream(0)
	require.NoError(t, err)
	require.ErrorIs(t, st.ToDevice(p+n-1, []byte{1, 2}), ErrNotDevice)
	require.NoError(t, st.Close())
}

func TestSimRecord(t *testing.T) {
	s := NewSim(1)
	const n = 1 << 20
	p, err := s.Alloc(0, n)
	require.NoError(t, err)
	defer func() { _ = s.Free(p) }()
	s.SetRate(100 << 20) // 10 ms per MiB
	s.Record(true)
	st, err := s.NewStream(0)
	require.NoError(t, err)
	buf := make([]byte, n)
	require.NoError(t, st.ToDevice(p, buf))
	end := s.Mark("send", 7)
	require.NoError(t, st.ToHost(buf, p))
	require.NoError(t, st.Close())
	end()
	ev := s.Events()
	require.Len(t, ev, 3)
	assert.Equal(t, "to-device", ev[0].Kind)
	assert.Equal(t, "to-host", ev[1].Kind)
	assert.Equal(t, "send", ev[2].Kind)
	assert.Equal(t, -1, ev[2].Dev)
	assert.GreaterOrEqual(t, ev[0].End-ev[0].Start, 9*time.Millisecond, "the rate holds a copy back")
	assert.LessOrEqual(t, ev[0].End, ev[1].Start, "a stream runs its copies in order")
	assert.Less(t, ev[2].Start, ev[1].End, "the mark began while the copy ran")
	s.Record(false)
	assert.Empty(t, s.Events())
}

func TestSimHostMemory(t *testing.T) {
	s := NewSim(1)
	b, err := s.HostAlloc(100)
	require.NoError(t, err)
	b[99] = 1 // addressable
	require.NoError(t, s.HostFree(b))
	require.Error(t, s.HostFree(make([]byte, 8)), "Go memory was never HostAlloc's")
	_, err = s.HostAlloc(0)
	require.Error(t, err)
}

const crashEnv = "GOXFER_DEVMEM_CRASH_CHILD"

// TestSimDeviceMemoryIsNotAddressable dereferences a simulated device
// pointer in a child process, which must die of it: code that touches
// device memory directly cannot pass by accident.
func TestSimDeviceMemoryIsNotAddressable(t *testing.T) {
	if os.Getenv(crashEnv) != "" {
		s := NewSim(1)
		p, err := s.Alloc(0, 4096)
		if err != nil {
			os.Exit(3)
		}
		b := unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&p))), 4096)
		fmt.Printf("touching 0x%x\n", p+100)
		b[100] = 1 // must fault
		os.Exit(0)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestSimDeviceMemoryIsNotAddressable$", "-test.count=1")
	cmd.Env = append(os.Environ(), crashEnv+"=1")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	require.True(t, errors.As(err, &ee), "the child exited cleanly after writing device memory: %s", out)
	m := regexp.MustCompile(`touching (0x[0-9a-f]+)`).FindSubmatch(out)
	require.NotNil(t, m, "the child got as far as the write: %s", out)
	require.True(t, bytes.Contains(out, []byte("SIGSEGV")) || bytes.Contains(out, []byte("SIGBUS")), "the child died of a memory fault: %s", out)
	require.Contains(t, string(out), "fault address "+string(m[1]), "at the device address it wrote: %s", out)
}

func TestSimFree(t *testing.T) {
	s := NewSim(2)
	p, err := s.Alloc(0, 100)
	require.NoError(t, err)
	q, err := s.Alloc(1, 100)
	require.NoError(t, err)
	require.NoError(t, CopyToDevice(s, 1, q, []byte("still here")))
	require.NoError(t, s.Free(p))
	err = s.Check(p, 1, 0)
	require.ErrorIs(t, err, ErrNotDevice, "freed memory")
	assert.Contains(t, err.Error(), "not memory of any simulated GPU")
	require.ErrorIs(t, s.Free(p), ErrNotDevice, "a second Free")
	st, err := s.NewStream(0)
	require.NoError(t, err)
	require.ErrorIs(t, st.ToHost(make([]byte, 1), p), ErrNotDevice, "a copy from freed memory")
	require.NoError(t, st.Close())
	out := make([]byte, 10)
	require.NoError(t, CopyToHost(s, 1, out, q), "another allocation outlives the Free")
	require.Equal(t, "still here", string(out))
	require.NoError(t, s.Free(q))
}

// TestSimStreamOnOtherGPU checks that a stream copies only memory of its
// own GPU, as the agent's staging expects of CUDA.
func TestSimStreamOnOtherGPU(t *testing.T) {
	s := NewSim(2)
	p, err := s.Alloc(1, 64)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Free(p)) }()
	st, err := s.NewStream(0)
	require.NoError(t, err)
	defer func() { require.NoError(t, st.Close()) }()
	err = st.ToDevice(p, make([]byte, 8))
	require.ErrorIs(t, err, ErrNotDevice)
	assert.Contains(t, err.Error(), "memory of GPU 1, not of GPU 0")
}
