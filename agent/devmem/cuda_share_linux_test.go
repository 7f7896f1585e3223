//go:build linux && (amd64 || arm64)

package devmem

import (
	"fmt"
	"os"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// fakeGPU is the fake driver's UUID of GPU dev.
func fakeGPU(dev int) [16]byte {
	var u [16]byte
	copy(u[:], fmt.Sprintf("fakecuda-gpu-0%d!", dev))
	return u
}

// TestCUDAShareLayouts checks the Go structures the driver reads against
// cuda.h's layouts (the fake's static assertions check the C side).
func TestCUDAShareLayouts(t *testing.T) {
	var p cuMemAllocationProp
	assert.Equal(t, uintptr(32), unsafe.Sizeof(p))
	assert.Equal(t, uintptr(4), unsafe.Offsetof(p.RequestedHandleTypes))
	assert.Equal(t, uintptr(8), unsafe.Offsetof(p.Location))
	assert.Equal(t, uintptr(16), unsafe.Offsetof(p.Win32HandleMetaData))
	assert.Equal(t, uintptr(24), unsafe.Offsetof(p.AllocFlags))
	var a cuMemAccessDesc
	assert.Equal(t, uintptr(12), unsafe.Sizeof(a))
	assert.Equal(t, uintptr(8), unsafe.Offsetof(a.Flags))
	assert.Equal(t, uintptr(64), unsafe.Sizeof(cuIpcMemHandle{}))
}

// TestCUDAFakeShareHandle exports cuMemAlloc memory as a legacy IPC
// handle and opens it again through the binding, against the fake driver,
// which maps the same pages at another address. Every byte of the handle,
// passed by value, must reach the driver where it was.
func TestCUDAFakeShareHandle(t *testing.T) {
	d, f := fakeCUDA(t)
	const n = 100003
	p, err := d.Alloc(1, n)
	require.NoError(t, err)
	want := randomBytes(n)
	require.NoError(t, CopyToDevice(d, 1, p, want))

	sh, err := d.Export(p+5, 1)
	require.NoError(t, err)
	assert.Equal(t, ShareHandle, sh.Kind)
	assert.Equal(t, p, sh.Base)
	assert.Equal(t, uint64(n), sh.Size)
	assert.Equal(t, -1, sh.FD)
	assert.Equal(t, fakeGPU(1), sh.GPU)
	assert.NotZero(t, sh.ID)
	assert.Equal(t, "FAKEIPC", string(sh.Handle[:7]))

	m, err := d.Import(sh, -1)
	require.NoError(t, err)
	var got [HandleSize]byte
	f.lastHandle(&got[0])
	require.Equal(t, sh.Handle, got, "the handle the driver received by value")
	assert.Equal(t, 1, m.Dev(), "opened on the GPU of the same UUID")
	assert.NotEqual(t, p, m.Ptr())
	assert.Equal(t, uint64(n), m.Size())
	assert.Equal(t, int64(1), f.liveIPC())
	require.NoError(t, d.Check(m.Ptr(), n, 1))
	require.Equal(t, want, readDevice(t, d, 1, m.Ptr(), n))

	// Writes through the mapping reach the allocation; device-to-device
	// copies between it and local memory of another GPU.
	want2 := randomBytes(n)
	require.NoError(t, CopyToDevice(d, 1, m.Ptr(), want2))
	require.Equal(t, want2, readDevice(t, d, 1, p, n))
	q, err := d.Alloc(0, n)
	require.NoError(t, err)
	require.NoError(t, CopyDevice(d, 0, q, m.Ptr(), n))
	require.Equal(t, want2, readDevice(t, d, 0, q, n))

	err = d.Free(m.Ptr())
	require.ErrorIs(t, err, ErrNotDevice)
	assert.Contains(t, err.Error(), "Close the Mapping")
	_, err = d.Export(m.Ptr()+10, 1)
	require.ErrorIs(t, err, ErrNotShareable)
	assert.Contains(t, err.Error(), "only its owner exports it")

	require.NoError(t, m.Close())
	require.NoError(t, m.Close(), "a second Close")
	assert.Zero(t, f.liveIPC())

	// A handle with any byte changed reaches the driver changed at that
	// byte only, which refuses it.
	for i := range HandleSize {
		bad := sh
		bad.Handle[i] ^= 0x5a
		_, err := d.Import(bad, -1)
		require.ErrorIs(t, err, ErrNotShareable, "byte %d changed", i)
		assert.Contains(t, err.Error(), "cuIpcOpenMemHandle_v2: CUDA_ERROR_INVALID_HANDLE", "byte %d changed", i)
		f.lastHandle(&got[0])
		require.Equal(t, bad.Handle, got, "byte %d changed", i)
	}
	assert.Zero(t, f.liveIPC())

	// A share claiming more than the allocation is refused and closed.
	big := sh
	big.Size = n + 1
	_, err = d.Import(big, -1)
	require.ErrorIs(t, err, ErrNotDevice)
	assert.Contains(t, err.Error(), fmt.Sprintf("share of %d bytes of an allocation of %d bytes", n+1, n))
	assert.Zero(t, f.liveIPC())

	// A GPU this process does not see opens near, or not at all.
	other := sh
	copy(other.GPU[:], "some-other-gpu!!")
	_, err = d.Import(other, -1)
	require.ErrorIs(t, err, ErrNotShareable)
	assert.Contains(t, err.Error(), "no near GPU")
	m, err = d.Import(other, 0)
	require.NoError(t, err)
	assert.Equal(t, 0, m.Dev())
	require.Equal(t, want2, readDevice(t, d, 0, m.Ptr(), n))
	require.NoError(t, m.Close())

	// The handle of a freed allocation does not open.
	require.NoError(t, d.Free(p))
	_, err = d.Import(sh, -1)
	require.ErrorIs(t, err, ErrNotShareable)
	require.NoError(t, d.Free(q))
	assert.Zero(t, f.liveIPC())
	assert.Zero(t, f.liveAllocs())
	assert.Zero(t, f.wrongContext())
}

// TestCUDAFakeShareFD allocates VMM memory shareable by file descriptor,
// exports it and imports it again, against the fake driver.
func TestCUDAFakeShareFD(t *testing.T) {
	for _, flag := range []string{"", "-DNO_MAPPING_ATTRS"} {
		t.Run("fake"+flag, func(t *testing.T) {
			var cflags []string
			if flag != "" {
				cflags = append(cflags, flag)
			}
			d, f := fakeCUDA(t, cflags...)
			const n, rounded = 100000, 128 << 10 // the fake's granularity is 64 KiB
			p, err := d.AllocShareable(1, n)
			require.NoError(t, err)
			require.NoError(t, d.Check(p, rounded, 1))
			want := randomBytes(n)
			require.NoError(t, CopyToDevice(d, 1, p, want))

			sh, err := d.Export(p+1000, 1)
			require.NoError(t, err)
			require.Equal(t, ShareFD, sh.Kind, "VMM memory shares by file descriptor")
			assert.Equal(t, p, sh.Base)
			assert.Equal(t, uint64(rounded), sh.Size)
			assert.Equal(t, fakeGPU(1), sh.GPU)
			assert.NotZero(t, sh.ID)
			require.GreaterOrEqual(t, sh.FD, 0)
			flags, err := unix.FcntlInt(uintptr(sh.FD), unix.F_GETFD, 0)
			require.NoError(t, err)
			assert.NotZero(t, flags&unix.FD_CLOEXEC)

			m, err := d.Import(sh, -1)
			require.NoError(t, err)
			_, err = unix.FcntlInt(uintptr(sh.FD), unix.F_GETFD, 0)
			require.NoError(t, err, "Import leaves the descriptor open")
			require.NoError(t, unix.Close(sh.FD))
			assert.Equal(t, 1, m.Dev())
			assert.NotEqual(t, p, m.Ptr())
			require.Equal(t, want, readDevice(t, d, 1, m.Ptr(), n))
			want2 := randomBytes(rounded)
			require.NoError(t, CopyToDevice(d, 1, m.Ptr(), want2))
			require.Equal(t, want2, readDevice(t, d, 1, p, rounded))
			q, err := d.Alloc(0, rounded)
			require.NoError(t, err)
			require.NoError(t, CopyDevice(d, 1, q, m.Ptr(), rounded), "a peer copy on the mapping's GPU")
			require.Equal(t, want2, readDevice(t, d, 0, q, rounded))
			require.NoError(t, d.Free(q))

			require.ErrorIs(t, d.Free(m.Ptr()), ErrNotDevice)
			assert.Equal(t, int64(2), f.liveReservations())
			require.NoError(t, m.Close())
			require.NoError(t, d.Free(p), "Free unmaps VMM memory (cuMemFree would refuse it)")
			require.ErrorIs(t, d.Free(p), ErrNotDevice, "a second Free")
			assert.Zero(t, f.liveReservations())
			assert.Zero(t, f.liveVMM())
			assert.Zero(t, f.liveAllocs())
			assert.Zero(t, f.wrongContext())
		})
	}
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(es)
}

// TestCUDAFakeShareUnwind fails each driver call of AllocShareable,
// Export and Import in turn: each failure is reported, naming the call,
// and leaves nothing behind (reservations, mappings, allocations, IPC
// mappings, descriptors).
func TestCUDAFakeShareUnwind(t *testing.T) {
	d, f := fakeCUDA(t)
	const outOfMemory = 2
	type counts struct{ allocs, vmm, res, ipc int64 }
	now := func() counts { return counts{f.liveAllocs(), f.liveVMM(), f.liveReservations(), f.liveIPC()} }

	before := now()
	for _, fn := range []string{"cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemRelease"} {
		f.fail(fn, outOfMemory)
		_, err := d.AllocShareable(0, 1)
		require.Error(t, err, fn)
		assert.Contains(t, err.Error(), fn+": CUDA_ERROR_OUT_OF_MEMORY")
		c := now()
		if fn == "cuMemRelease" {
			c.vmm-- // the handle whose release failed stays: the driver would keep it too
		}
		assert.Equal(t, before, c, "after %s failed", fn)
	}

	p, err := d.AllocShareable(0, 1)
	require.NoError(t, err)
	before = now()
	fds := openFDs(t)
	for _, fn := range []string{"cuMemRetainAllocationHandle", "cuMemExportToShareableHandle", "cuMemRelease"} {
		f.fail(fn, outOfMemory)
		_, err := d.Export(p, 0)
		require.ErrorIs(t, err, ErrNotShareable, fn)
		assert.Contains(t, err.Error(), fn+": CUDA_ERROR_OUT_OF_MEMORY")
		assert.Equal(t, fds, openFDs(t), "no descriptor left open after %s failed", fn)
		assert.Equal(t, before.res, f.liveReservations())
	}
	sh, err := d.Export(p, 0)
	require.NoError(t, err)
	defer unix.Close(sh.FD)
	before = now()
	for _, fn := range []string{"cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemRelease"} {
		f.fail(fn, outOfMemory)
		_, err := d.Import(sh, -1)
		require.ErrorIs(t, err, ErrNotShareable, fn)
		assert.Contains(t, err.Error(), fn+": CUDA_ERROR_OUT_OF_MEMORY")
		c := now()
		if fn == "cuMemRelease" {
			c.vmm--
		} else if fn != "cuMemImportFromShareableHandle" {
			assert.Equal(t, before, c, "after %s failed", fn)
		}
	}

	q, err := d.Alloc(1, 4096)
	require.NoError(t, err)
	f.fail("cuIpcGetMemHandle", outOfMemory)
	_, err = d.Export(q, 1)
	require.ErrorIs(t, err, ErrNotShareable)
	assert.Contains(t, err.Error(), "cuIpcGetMemHandle: CUDA_ERROR_OUT_OF_MEMORY")
	hs, err := d.Export(q, 1)
	require.NoError(t, err)
	f.fail("cuIpcOpenMemHandle_v2", outOfMemory)
	_, err = d.Import(hs, -1)
	require.ErrorIs(t, err, ErrNotShareable)
	assert.Contains(t, err.Error(), "cuIpcOpenMemHandle_v2: CUDA_ERROR_OUT_OF_MEMORY")
	assert.Zero(t, f.liveIPC())
	m, err := d.Import(hs, -1)
	require.NoError(t, err)
	f.fail("cuIpcCloseMemHandle", outOfMemory)
	err = m.Close()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cuIpcCloseMemHandle: CUDA_ERROR_OUT_OF_MEMORY")

	require.NoError(t, d.Free(q))
	require.NoError(t, d.Free(p))
	assert.Zero(t, f.liveReservations())
	assert.Zero(t, f.wrongContext())
}

// TestCUDAFakeShareMissing runs the binding against drivers without the
// entry points of sharing: everything else works, and sharing fails with
// ErrNotShareable naming what is missing.
func TestCUDAFakeShareMissing(t *testing.T) {
	d, _ := fakeCUDA(t, "-DOMIT_VMM", "-DOMIT_IPC")
	p, err := d.Alloc(0, 4096)
	require.NoError(t, err)
	want := randomBytes(4096)
	require.NoError(t, CopyToDevice(d, 0, p, want))
	require.Equal(t, want, readDevice(t, d, 0, p, 4096))

	_, err = d.AllocShareable(0, 1)
	require.ErrorIs(t, err, ErrNotShareable)
	assert.Contains(t, err.Error(), "has no cuMemGetAllocationGranularity")
	_, err = d.Export(p, 0)
	require.ErrorIs(t, err, ErrNotShareable)
	assert.Contains(t, err.Error(), "has no cuIpcGetMemHandle")
	h := Share{Kind: ShareHandle, GPU: fakeGPU(0), ID: 1, Base: p, Size: 4096, FD: -1}
	h.Handle[0] = 1
	_, err = d.Import(h, -1)
	require.ErrorIs(t, err, ErrNotShareable)
	assert.Contains(t, err.Error(), "has no cuIpcOpenMemHandle_v2")
	_, err = d.Import(Share{Kind: ShareFD, GPU: fakeGPU(0), ID: 1, Base: p, Size: 4096, FD: 1}, -1)
	require.ErrorIs(t, err, ErrNotShareable)
	assert.Contains(t, err.Error(), "has no cuMemImportFromShareableHandle")
	require.NoError(t, d.Free(p))

	// Without cuDeviceGetUuid_v2, the first version names the GPU.
	d, _ = fakeCUDA(t, "-DOMIT_UUID_V2")
	p, err = d.Alloc(1, 4096)
	require.NoError(t, err)
	sh, err := d.Export(p, 1)
	require.NoError(t, err)
	assert.Equal(t, fakeGPU(1), sh.GPU)
	require.NoError(t, d.Free(p))
}

// TestCUDAFakeShareMalformed imports shares that no exporter made.
func TestCUDAFakeShareMalformed(t *testing.T) {
	d, f := fakeCUDA(t)
	p, err := d.Alloc(0, 4096)
	require.NoError(t, err)
	defer func() { require.NoError(t, d.Free(p)) }()
	good, err := d.Export(p, 0)
	require.NoError(t, err)
	for _, c := range []struct {
		name   string
		change func(*Share)
		near   int
		is     error
		want   string
	}{
		{"kind 0", func(s *Share) { s.Kind = 0 }, -1, ErrNotDevice, "kind ShareKind(0)"},
		{"size 0", func(s *Share) { s.Size = 0 }, -1, ErrNotDevice, "share of 0 bytes"},
		{"size huge", func(s *Share) { s.Size = 1 << 60 }, -1, ErrNotDevice, "want 1 to"},
		{"empty handle", func(s *Share) { s.Handle = [HandleSize]byte{} }, -1, ErrNotDevice, "empty handle"},
		{"fd -1", func(s *Share) { s.Kind = ShareFD }, -1, ErrNotDevice, "file descriptor -1"},
		{"fd not memory", func(s *Share) { s.Kind, s.FD = ShareFD, 0 }, -1, ErrNotShareable, "cuMemImportFromShareableHandle"},
		{"near 2", func(*Share) {}, 2, ErrNotDevice, "near GPU 2"},
		{"near -2", func(*Share) {}, -2, ErrNotDevice, "near GPU -2"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := good
			c.change(&s)
			m, err := d.Import(s, c.near)
			if m != nil {
				_ = m.Close()
			}
			require.ErrorIs(t, err, c.is)
			assert.Contains(t, err.Error(), c.want)
		})
	}
	pinned, err := d.HostAlloc(4096)
	require.NoError(t, err)
	_, err = d.Export(uintptr(unsafe.Pointer(&pinned[0])), 0)
	require.ErrorIs(t, err, ErrNotDevice, "host memory")
	require.NoError(t, d.HostFree(pinned))
	_, err = d.Export(p, 1)
	require.ErrorIs(t, err, ErrNotDevice, "the wrong GPU")
	assert.Contains(t, err.Error(), "memory of GPU 0, not of GPU 1")
	_, err = d.Export(0x1000, 0)
	require.ErrorIs(t, err, ErrNotDevice, "no memory")
	_, err = d.Export(p, 2)
	require.ErrorIs(t, err, ErrNotDevice, "a GPU that does not exist")
	assert.Zero(t, f.liveIPC())
}

// TestCUDAShareCrossProcess is TestSimShareCrossProcess on real GPUs: a
// child process exports cuMemAlloc memory by IPC handle and VMM memory by
// file descriptor.
func TestCUDAShareCrossProcess(t *testing.T) {
	if os.Getenv(shareChildEnv) == "" {
		realCUDA(t)
	}
	testShareCrossProcess(t, "cuda", CUDA())
}
