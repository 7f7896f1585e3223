//go:build linux

package devmem

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// pattern returns n bytes that depend on seed and on each byte's offset.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7+i>>9) ^ seed
	}
	return b
}

// readDevice copies n bytes of device memory at p on GPU dev to the host.
func readDevice(t *testing.T, d Driver, dev int, p uintptr, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	require.NoError(t, CopyToHost(d, dev, b, p))
	return b
}

func TestSimShareHandleInProcess(t *testing.T) {
	exp, imp := NewSim(2), NewSim(2) // an importer of its own, as another process has
	const n = 3*4096 + 5
	p, err := exp.Alloc(1, n)
	require.NoError(t, err)
	defer func() { require.NoError(t, exp.Free(p)) }()
	want := pattern(n, 1)
	require.NoError(t, CopyToDevice(exp, 1, p, want))

	sh, err := exp.Export(p+100, 1) // any address inside the allocation
	require.NoError(t, err)
	assert.Equal(t, ShareHandle, sh.Kind)
	assert.Equal(t, p, sh.Base)
	assert.Equal(t, uint64(n), sh.Size)
	assert.Equal(t, -1, sh.FD)
	assert.Equal(t, simGPU(1), sh.GPU)
	assert.NotZero(t, sh.ID)

	m, err := imp.Import(sh, -1)
	require.NoError(t, err)
	assert.Equal(t, 1, m.Dev(), "opened on the GPU of the same UUID")
	assert.Equal(t, uint64(n), m.Size())
	assert.NotEqual(t, p, m.Ptr(), "a mapping of its own")
	assert.Equal(t, 1, imp.Mappings())
	assert.Zero(t, exp.Mappings())
	require.NoError(t, imp.Check(m.Ptr(), n, 1))
	require.ErrorIs(t, imp.Check(m.Ptr(), n+1, 1), ErrNotDevice)
	require.Equal(t, want, readDevice(t, imp, 1, m.Ptr(), n))

	// Writes through the mapping reach the exporter's memory.
	want2 := pattern(1000, 2)
	require.NoError(t, CopyToDevice(imp, 1, m.Ptr()+77, want2))
	copy(want[77:], want2)
	require.Equal(t, want, readDevice(t, exp, 1, p, n))

	// Device-to-device copies between local memory and the mapping, on
	// one GPU and between two.
	local0, err := imp.Alloc(0, n)
	require.NoError(t, err)
	defer func() { require.NoError(t, imp.Free(local0)) }()
	imp.Record(true)
	require.NoError(t, CopyDevice(imp, 0, local0, m.Ptr(), n), "a peer copy on the stream of the local GPU")
	require.Equal(t, want, readDevice(t, imp, 0, local0, n))
	ev := imp.Events()
	require.Len(t, ev, 2)
	assert.Equal(t, Event{Kind: "device-to-device", Dev: 0, Bytes: n}, Event{Kind: ev[0].Kind, Dev: ev[0].Dev, Bytes: ev[0].Bytes})
	imp.Record(false)
	want3 := pattern(n, 3)
	require.NoError(t, CopyToDevice(imp, 0, local0, want3))
	require.NoError(t, CopyDevice(imp, 1, m.Ptr(), local0, n), "a peer copy on the stream of the mapping's GPU")
	require.Equal(t, want3, readDevice(t, exp, 1, p, n))

	// The imported mapping is not the importer's to free or export.
	err = imp.Free(m.Ptr())
	require.ErrorIs(t, err, ErrNotDevice)
	assert.Contains(t, err.Error(), fmt.Sprintf("imported from process %d; Close the Mapping", os.Getpid()))
	_, err = imp.Export(m.Ptr(), 1)
	require.ErrorIs(t, err, ErrNotShareable)
	assert.Contains(t, err.Error(), fmt.Sprintf("imported from process %d; only its owner exports it", os.Getpid()))

	// Two imports are two mappings.
	m2, err := imp.Import(sh, -1)
	require.NoError(t, err)
	assert.NotEqual(t, m.Ptr(), m2.Ptr())
	assert.Equal(t, 2, imp.Mappings())
	require.NoError(t, m2.Close())
	require.NoError(t, m.Close())
	require.NoError(t, m.Close(), "a second Close")
	assert.Zero(t, imp.Mappings())
	require.ErrorIs(t, imp.Check(m.Ptr(), 1, 1), ErrNotDevice, "a closed mapping")
	require.Equal(t, want3, readDevice(t, exp, 1, p, n), "the exporter keeps its memory")
}

func TestSimShareFD(t *testing.T) {
	exp, imp := NewSim(2), NewSim(2)
	const n = 10000
	p, err := exp.AllocShareable(0, n)
	require.NoError(t, err)
	want := pattern(n, 4)
	require.NoError(t, CopyToDevice(exp, 0, p, want))
	sh, err := exp.Export(p, 0)
	require.NoError(t, err)
	require.Equal(t, ShareFD, sh.Kind, "VMM memory shares by file descriptor only")
	require.GreaterOrEqual(t, sh.FD, 0)
	assert.Equal(t, [HandleSize]byte{}, sh.Handle)
	flags, err := unix.FcntlInt(uintptr(sh.FD), unix.F_GETFD, 0)
	require.NoError(t, err)
	assert.NotZero(t, flags&unix.FD_CLOEXEC, "the exported descriptor is closed on exec")

	m, err := imp.Import(sh, -1)
	require.NoError(t, err)
	_, err = unix.FcntlInt(uintptr(sh.FD), unix.F_GETFD, 0)
	require.NoError(t, err, "Import leaves the descriptor open")
	require.NoError(t, unix.Close(sh.FD))
	assert.Equal(t, 0, m.Dev())
	require.Equal(t, want, readDevice(t, imp, 0, m.Ptr(), n))

	// The memory outlives the exporter's Free while a mapping holds it.
	require.NoError(t, exp.Free(p))
	require.Equal(t, want, readDevice(t, imp, 0, m.Ptr(), n))
	require.NoError(t, m.Close())
	assert.Zero(t, imp.Mappings())

	// A descriptor that is not a memory file of the simulator is refused.
	f, err := os.CreateTemp(t.TempDir(), "x")
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(16384))
	bad := sh
	bad.FD = int(f.Fd())
	_, err = imp.Import(bad, -1)
	require.ErrorIs(t, err, ErrNotDevice)
	assert.Contains(t, err.Error(), "not a memory file of the simulator's allocation")
	bad.FD = 1 << 20
	_, err = imp.Import(bad, -1)
	require.ErrorIs(t, err, ErrNotShareable, "a closed descriptor")
	assert.Zero(t, imp.Mappings())
}

func TestSimShareAfterFree(t *testing.T) {
	s := NewSim(1)
	p, err := s.Alloc(0, 4096)
	require.NoError(t, err)
	sh, err := s.Export(p, 0)
	require.NoError(t, err)
	require.NoError(t, s.Free(p))
	_, err = s.Import(sh, -1)
	require.ErrorIs(t, err, ErrNotShareable)
	assert.Contains(t, err.Error(), "gone")

	// The next allocation gets the freed descriptor number: the share of
	// the freed one still does not open it.
	q, err := s.Alloc(0, 4096)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Free(q)) }()
	sh2, err := s.Export(q, 0)
	require.NoError(t, err)
	h1, err := decodeSimHandle(sh.Handle)
	require.NoError(t, err)
	h2, err := decodeSimHandle(sh2.Handle)
	require.NoError(t, err)
	require.Equal(t, h1.fd, h2.fd, "the descriptor number is reused")
	_, err = s.Import(sh, -1)
	require.ErrorIs(t, err, ErrNotShareable)
	assert.Contains(t, err.Error(), "not the memory file")
	assert.Zero(t, s.Mappings())
}

func TestSimShareGPU(t *testing.T) {
	two, one := NewSim(2), NewSim(1)
	p, err := two.Alloc(1, 4096)
	require.NoError(t, err)
	defer func() { require.NoError(t, two.Free(p)) }()
	sh, err := two.Export(p, 1)
	require.NoError(t, err)

	_, err = one.Import(sh, -1)
	require.ErrorIs(t, err, ErrNotShareable, "a GPU this simulator does not have, and no near GPU")
	assert.Contains(t, err.Error(), "no near GPU")
	m, err := one.Import(sh, 0)
	require.NoError(t, err)
	assert.Equal(t, 0, m.Dev(), "opened on the near GPU")
	require.NoError(t, one.Check(m.Ptr(), 4096, 0))
	require.NoError(t, m.Close())
	_, err = one.Import(sh, 1)
	require.ErrorIs(t, err, ErrNotDevice, "a near GPU that does not exist")

	m, err = two.Import(sh, 0)
	require.NoError(t, err)
	assert.Equal(t, 1, m.Dev(), "the GPU of the same UUID wins over near")
	require.NoError(t, m.Close())

	// A GPU that is not a simulated one is opened near.
	foreign := sh
	copy(foreign.GPU[:], "GPU-0123456789ab")
	m, err = two.Import(foreign, 0)
	require.NoError(t, err)
	assert.Equal(t, 0, m.Dev())
	require.NoError(t, m.Close())

	_, err = two.Export(p, 0)
	require.ErrorIs(t, err, ErrNotDevice, "export naming the wrong GPU")
	assert.Contains(t, err.Error(), "memory of GPU 1, not of GPU 0")
	_, err = two.Export(p+4096, 1)
	require.ErrorIs(t, err, ErrNotDevice, "export past the allocation")
	_, err = two.Export(0x10000, 0)
	require.ErrorIs(t, err, ErrNotDevice, "export of no device memory")
	_, err = two.Export(p, 2)
	require.ErrorIs(t, err, ErrNotDevice, "export on a GPU that does not exist")
}

func TestSimShareMalformed(t *testing.T) {
	s := NewSim(2)
	p, err := s.Alloc(0, 5000)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Free(p)) }()
	good, err := s.Export(p, 0)
	require.NoError(t, err)
	q, err := s.AllocShareable(0, 5000)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Free(q)) }()
	goodFD, err := s.Export(q, 0)
	require.NoError(t, err)
	defer unix.Close(goodFD.FD)
	m, err := s.Import(good, -1)
	require.NoError(t, err, "the unmodified share opens")
	require.NoError(t, m.Close())
	m, err = s.Import(goodFD, -1)
	require.NoError(t, err, "the unmodified fd share opens")
	require.NoError(t, m.Close())

	handle := func(f func(b []byte)) func(*Share) {
		return func(sh *Share) { f(sh.Handle[:]) }
	}
	for _, c := range []struct {
		name   string
		fd     bool
		change func(*Share)
		is     error
		want   string
	}{
		{"kind 0", false, func(sh *Share) { sh.Kind = 0 }, ErrNotDevice, "kind ShareKind(0)"},
		{"kind 9", false, func(sh *Share) { sh.Kind = 9 }, ErrNotDevice, "kind ShareKind(9)"},
		{"size 0", false, func(sh *Share) { sh.Size = 0 }, ErrNotDevice, "share of 0 bytes"},
		{"size huge", false, func(sh *Share) { sh.Size = 1 << 50 }, ErrNotDevice, "want 1 to"},
		{"size other", false, func(sh *Share) { sh.Size++ }, ErrNotDevice, "handle of allocation"},
		{"ID 0", false, func(sh *Share) { sh.ID = 0 }, ErrNotDevice, "ID 0"},
		{"ID other", false, func(sh *Share) { sh.ID++ }, ErrNotDevice, "handle of allocation"},
		{"base 0", false, func(sh *Share) { sh.Base = 0 }, ErrNotDevice, "based at 0x0"},
		{"base unaligned", false, func(sh *Share) { sh.Base++ }, ErrNotDevice, "page-aligned"},
		{"base at the top", false, func(sh *Share) { sh.Base = ^uintptr(0) &^ 4095 }, ErrNotDevice, "with 5000 bytes after it"},
		{"magic", false, handle(func(b []byte) { b[0] = 'X' }), ErrNotDevice, "not the simulator's"},
		{"all zero", false, handle(func(b []byte) { clear(b) }), ErrNotDevice, "not the simulator's"},
		{"pid 0", false, handle(func(b []byte) { clear(b[8:12]) }), ErrNotDevice, "process 0"},
		{"pid huge", false, handle(func(b []byte) { binary.LittleEndian.PutUint32(b[8:], 1<<31) }), ErrNotDevice, "process 2147483648"},
		{"pid other", false, handle(func(b []byte) { binary.LittleEndian.PutUint32(b[8:], 1) }), ErrNotShareable, "/proc/1/fd/"},
		{"fd other", false, handle(func(b []byte) { binary.LittleEndian.PutUint32(b[12:], 0) }), ErrNotShareable, "not the memory file"},
		{"fd huge", false, handle(func(b []byte) { binary.LittleEndian.PutUint32(b[12:], 1<<31) }), ErrNotDevice, "file descriptor 2147483648"},
		{"handle GPU", false, handle(func(b []byte) { b[32] = 1 }), ErrNotDevice, "handle of GPU 1 in a share of simulated GPU 0"},
		{"handle GPU huge", false, handle(func(b []byte) { b[34] = 1 }), ErrNotDevice, "handle of GPU 65536"},
		{"trailing bytes", false, handle(func(b []byte) { b[63] = 1 }), ErrNotDevice, "must be zero"},
		{"fd -1", true, func(sh *Share) { sh.FD = -1 }, ErrNotDevice, "file descriptor -1"},
		{"fd share with handle", true, func(sh *Share) { sh.Handle = good.Handle }, ErrNotDevice, "with a handle set"},
		{"fd share size", true, func(sh *Share) { sh.Size = 100000 }, ErrNotDevice, "of a memory file of 8192 bytes"},
		{"fd share ID", true, func(sh *Share) { sh.ID = good.ID }, ErrNotDevice, "not a memory file of the simulator's allocation"},
		{"fd of handle kind", true, func(sh *Share) { sh.Kind = ShareHandle }, ErrNotDevice, "not the simulator's"},
		{"handle of fd kind", false, func(sh *Share) { sh.Kind = ShareFD }, ErrNotDevice, "fd share with file descriptor -1"},
		{"handle of fd kind with an fd", false, func(sh *Share) { sh.Kind, sh.FD = ShareFD, goodFD.FD }, ErrNotDevice, "with a handle set"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sh := good
			if c.fd {
				sh = goodFD
			}
			c.change(&sh)
			m, err := s.Import(sh, 1)
			if m != nil {
				_ = m.Close()
			}
			require.ErrorIs(t, err, c.is)
			assert.Contains(t, err.Error(), c.want)
		})
	}
	assert.Zero(t, s.Mappings())
}

// FuzzSimShare imports shares built from untrusted bytes: the handle's 64
// bytes, and the fields beside it. Only a share of a live allocation (this
// process's, or the fuzzing coordinator's, whose seeds these are) may
// open; nothing may crash or leak a mapping.
func FuzzSimShare(f *testing.F) {
	s := NewSim(2)
	p, err := s.Alloc(1, 5000)
	require.NoError(f, err)
	f.Cleanup(func() { _ = s.Free(p) })
	good, err := s.Export(p, 1)
	require.NoError(f, err)
	f.Add(good.Handle[:], uint8(good.Kind), good.ID, good.Size, uint64(good.Base), int8(-1))
	f.Add(good.Handle[:], uint8(ShareFD), good.ID, good.Size, uint64(good.Base), int8(0))
	f.Add(make([]byte, HandleSize), uint8(1), uint64(1), uint64(4096), uint64(0x10000), int8(1))
	f.Add([]byte(simHandleMagic), uint8(1), uint64(7), uint64(1<<40), uint64(0x7f0000000000), int8(2))
	f.Fuzz(func(t *testing.T, handle []byte, kind uint8, id, size, base uint64, near int8) {
		sh := Share{Kind: ShareKind(kind), GPU: good.GPU, ID: id, Base: uintptr(base), Size: size, FD: -1}
		copy(sh.Handle[:], handle)
		if h, err := decodeSimHandle(sh.Handle); err == nil {
			require.Equal(t, sh.Handle, h.encode(), "a handle that decodes encodes to the same bytes")
		} else {
			require.ErrorIs(t, err, ErrNotDevice)
		}
		m, err := s.Import(sh, int(near))
		if err != nil {
			require.True(t, errors.Is(err, ErrNotDevice) || errors.Is(err, ErrNotShareable), "%v", err)
			require.Zero(t, s.Mappings())
			return
		}
		h, err := decodeSimHandle(sh.Handle)
		require.NoError(t, err, "only a well-formed handle opens")
		require.Equal(t, ShareHandle, sh.Kind)
		require.Equal(t, sh.ID, h.id)
		require.Equal(t, sh.Size, h.size)
		require.NoError(t, CopyToHost(s, m.Dev(), make([]byte, m.Size()), m.Ptr()))
		require.NoError(t, m.Close())
	})
}

const shareChildEnv = "GOXFER_DEVMEM_SHARE_CHILD"

// shareBytes encodes a share for the test's socket.
func shareBytes(sh Share) []byte {
	b := []byte{byte(sh.Kind)}
	b = append(b, sh.GPU[:]...)
	b = binary.LittleEndian.AppendUint64(b, sh.ID)
	b = binary.LittleEndian.AppendUint64(b, uint64(sh.Base))
	b = binary.LittleEndian.AppendUint64(b, sh.Size)
	return append(b, sh.Handle[:]...)
}

func parseShare(b []byte, fd int) (Share, error) {
	if len(b) != 1+16+24+HandleSize {
		return Share{}, fmt.Errorf("a share of %d bytes", len(b))
	}
	sh := Share{Kind: ShareKind(b[0]), FD: fd}
	copy(sh.GPU[:], b[1:17])
	sh.ID = binary.LittleEndian.Uint64(b[17:])
	sh.Base = uintptr(binary.LittleEndian.Uint64(b[25:]))
	sh.Size = binary.LittleEndian.Uint64(b[33:])
	copy(sh.Handle[:], b[41:])
	return sh, nil
}

// seqConn is one end of a SOCK_SEQPACKET socket pair: messages, with a
// descriptor beside one if need be.
type seqConn int

func (c seqConn) send(msg []byte, fd int) error {
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	return unix.Sendmsg(int(c), msg, oob, nil, 0)
}

func (c seqConn) recv() ([]byte, int, error) {
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := unix.Recvmsg(int(c), buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return nil, -1, err
	}
	if n == 0 {
		return nil, -1, errors.New("the peer closed the socket")
	}
	fd := -1
	if oobn > 0 {
		cms, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return nil, -1, err
		}
		fds, err := unix.ParseUnixRights(&cms[0])
		if err != nil {
			return nil, -1, err
		}
		fd = fds[0]
	}
	return buf[:n], fd, nil
}

const shareChildSize = 1<<20 + 123

// shareDriver returns the driver of a cross-process sharing test: "sim"
// or "cuda".
func shareDriver(name string) (Driver, error) {
	if name == "cuda" {
		return CUDA(), nil
	}
	return NewSim(2), nil
}

// shareGPUs returns the GPUs of the test's two allocations: two GPUs where
// the driver has them.
func shareGPUs(d Driver) (int, int, error) {
	n, err := d.Devices()
	if err != nil {
		return 0, 0, err
	}
	return min(1, n-1), 0, nil
}

// shareChild is the exporting process of the cross-process sharing tests:
// it fills two allocations, one of Alloc and one of AllocShareable, sends
// their shares over descriptor 3 and checks what the parent wrote into
// them.
func shareChild(name string) error {
	c := seqConn(3)
	d, err := shareDriver(name)
	if err != nil {
		return err
	}
	s := d.(Sharer)
	devP, devQ, err := shareGPUs(d)
	if err != nil {
		return err
	}
	p, err := d.Alloc(devP, shareChildSize)
	if err != nil {
		return err
	}
	q, err := s.AllocShareable(devQ, shareChildSize)
	if err != nil {
		return err
	}
	if err := errors.Join(CopyToDevice(d, devP, p, pattern(shareChildSize, 10)), CopyToDevice(d, devQ, q, pattern(shareChildSize, 11))); err != nil {
		return err
	}
	sp, err := s.Export(p, devP)
	if err != nil {
		return err
	}
	sq, err := s.Export(q, devQ)
	if err != nil {
		return err
	}
	if err := errors.Join(c.send(shareBytes(sp), -1), c.send(shareBytes(sq), sq.FD)); err != nil {
		return err
	}
	_ = unix.Close(sq.FD) // sent
	for {
		msg, _, err := c.recv()
		if err != nil {
			return err
		}
		switch string(msg) {
		case "verify":
			got := make([]byte, shareChildSize)
			var bad []string
			for _, a := range []struct {
				dev  int
				p    uintptr
				seed byte
			}{{devP, p, 20}, {devQ, q, 21}} {
				if err := CopyToHost(d, a.dev, got, a.p); err != nil {
					return err
				}
				if !bytes.Equal(got, pattern(shareChildSize, a.seed)) {
					bad = append(bad, fmt.Sprintf("GPU %d's allocation is not what the parent wrote", a.dev))
				}
			}
			reply := "ok"
			if bad != nil {
				reply = fmt.Sprint(bad)
			}
			if err := c.send([]byte(reply), -1); err != nil {
				return err
			}
		case "free":
			if err := errors.Join(d.Free(p), d.Free(q)); err != nil {
				return err
			}
			if err := c.send([]byte("freed"), -1); err != nil {
				return err
			}
		case "exit":
			return nil
		}
	}
}

// TestSimShareCrossProcess shares a child's simulated device memory with
// this process, both ways: a handle share through /proc and an fd share
// sent over a Unix socket. This process reads what the child wrote,
// writes what the child checks, copies device to device between its own
// memory and the mappings, and finds the handle share unusable once the
// child freed it, while its mappings keep the memory.
func TestSimShareCrossProcess(t *testing.T) {
	testShareCrossProcess(t, "sim", NewSim(2))
}

// testShareCrossProcess runs the cross-process sharing test on driver d,
// whose name the child process gets.
func testShareCrossProcess(t *testing.T, name string, d Driver) {
	if v := os.Getenv(shareChildEnv); v != "" {
		if err := shareChild(v); err != nil {
			fmt.Fprintln(os.Stderr, "share child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	c := seqConn(fds[0])
	defer unix.Close(fds[0])
	childEnd := os.NewFile(uintptr(fds[1]), "child end")
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1")
	cmd.Env = append(os.Environ(), shareChildEnv+"="+name)
	cmd.ExtraFiles = []*os.File{childEnd}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	childEnd.Close()
	exited := false
	defer func() {
		if !exited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	recvShare := func() Share {
		msg, fd, err := c.recv()
		require.NoError(t, err, "child stderr: %s", &stderr)
		sh, err := parseShare(msg, fd)
		require.NoError(t, err)
		return sh
	}
	sp, sq := recvShare(), recvShare()
	require.Equal(t, ShareHandle, sp.Kind)
	require.Equal(t, ShareFD, sq.Kind)
	require.GreaterOrEqual(t, sq.FD, 0, "the descriptor arrived")
	if name == "sim" {
		h, err := decodeSimHandle(sp.Handle)
		require.NoError(t, err)
		require.Equal(t, cmd.Process.Pid, h.pid)
	}

	s := d.(Sharer)
	devP, devQ, err := shareGPUs(d)
	require.NoError(t, err)
	mp, err := s.Import(sp, -1)
	require.NoError(t, err)
	mq, err := s.Import(sq, -1)
	require.NoError(t, err)
	require.NoError(t, unix.Close(sq.FD), "Import does not take the descriptor")
	if sim, ok := d.(*Sim); ok {
		require.Equal(t, 2, sim.Mappings())
	}
	require.Equal(t, devP, mp.Dev(), "opened on the GPU of the same UUID")
	require.Equal(t, devQ, mq.Dev())
	require.Equal(t, pattern(shareChildSize, 10), readDevice(t, d, devP, mp.Ptr(), shareChildSize))
	require.Equal(t, pattern(shareChildSize, 11), readDevice(t, d, devQ, mq.Ptr(), shareChildSize))

	// Write one directly, the other through local memory and a
	// device-to-device copy.
	require.NoError(t, CopyToDevice(d, devP, mp.Ptr(), pattern(shareChildSize, 20)))
	local, err := d.Alloc(devQ, shareChildSize)
	require.NoError(t, err)
	defer func() { require.NoError(t, d.Free(local)) }()
	require.NoError(t, CopyToDevice(d, devQ, local, pattern(shareChildSize, 21)))
	require.NoError(t, CopyDevice(d, devQ, mq.Ptr(), local, shareChildSize))
	require.NoError(t, c.send([]byte("verify"), -1))
	msg, _, err := c.recv()
	require.NoError(t, err, "child stderr: %s", &stderr)
	require.Equal(t, "ok", string(msg))

	if name == "cuda" {
		// What CUDA does with the memory of a freed allocation that
		// another process maps is the driver's business: close first.
		require.NoError(t, mp.Close())
		require.NoError(t, mq.Close())
	}
	require.NoError(t, c.send([]byte("free"), -1))
	msg, _, err = c.recv()
	require.NoError(t, err, "child stderr: %s", &stderr)
	require.Equal(t, "freed", string(msg))
	if name == "sim" {
		_, err = s.Import(sp, -1)
		require.ErrorIs(t, err, ErrNotShareable, "the handle of a freed allocation")
		require.Equal(t, pattern(shareChildSize, 20), readDevice(t, d, devP, mp.Ptr(), shareChildSize), "the mapping keeps the memory")
		require.Equal(t, pattern(shareChildSize, 21), readDevice(t, d, devQ, mq.Ptr(), shareChildSize), "the mapping keeps the memory")
	}

	require.NoError(t, c.send([]byte("exit"), -1))
	exited = true
	require.NoError(t, cmd.Wait(), "child stderr: %s", &stderr)
	if name == "sim" {
		_, err = s.Import(sp, -1)
		require.ErrorIs(t, err, ErrNotShareable, "the handle of an exited process")
		require.NoError(t, mp.Close())
		require.NoError(t, mq.Close())
		require.Zero(t, d.(*Sim).Mappings())
	}
}

// A memory file's size is sealed: the exporter (or anyone holding the
// descriptor) cannot shrink it under an importer's mapping, whose copies
// would then fault; a file of the right name whose size is not sealed is
// refused.
func TestSimShareSealed(t *testing.T) {
	exp, imp := NewSim(2), NewSim(2)
	const n = 3 * 4096
	p, err := exp.AllocShareable(0, n)
	require.NoError(t, err)
	defer exp.Free(p)
	sh, err := exp.Export(p, 0)
	require.NoError(t, err)
	defer unix.Close(sh.FD)
	require.Error(t, unix.Ftruncate(sh.FD, 4096), "the exported file shrank")
	require.Error(t, unix.Ftruncate(sh.FD, 1<<20), "the exported file grew")

	// A hostile exporter's own memfd, named as the simulator names them,
	// but not sealed.
	fd, err := unix.MemfdCreate(simFileName(os.Getpid(), sh.ID), unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unix.Ftruncate(fd, n))
	bad := sh
	bad.FD = fd
	_, err = imp.Import(bad, -1)
	require.ErrorIs(t, err, ErrNotDevice)
	assert.Contains(t, err.Error(), "not sealed")
	assert.Zero(t, imp.Mappings())

	m, err := imp.Import(sh, -1)
	require.NoError(t, err)
	require.NoError(t, m.Close())
}
