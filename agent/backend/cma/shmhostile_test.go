//go:build linux

package cma

import (
	"bufio"
	"context"
	"net"
	"os"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/shm"
)

// shmExposer is a fake exposing side that agrees shared memory, runs
// start once the handshake is done, then hands each frame it reads to on.
func shmExposer(t *testing.T, start func(c *net.UnixConn), on func(c *net.UnixConn, f *frame)) *fakeSocket {
	t.Helper()
	return listenFake(t, "shm", func(fs *fakeSocket, c *net.UnixConn) {
		br := bufio.NewReader(c)
		if fs.readHello(br) != nil {
			return
		}
		var hs [hsSize]byte
		out := handshake{self: fs.info.ID, pid: uint32(os.Getpid()), scope: noScope, nonce: *fs.nonce, caps: capStaged | capShm}
		out.probe = uint64(uintptrOf(fs.nonce))
		out.put(hs[:])
		if _, err := c.Write(hs[:]); err != nil {
			return
		}
		start(c)
		var hdr [hdrSize]byte
		var buf []byte
		var f frame
		for readFrame(br, hdr[:], &buf, limits{maxRanges: 4096, maxNotify: 64 << 10, shm: true}, &f) == nil {
			if on != nil {
				on(c, &f)
			}
		}
	})
}

func sendFD(c *net.UnixConn, h header, payload []byte, fd int) {
	b := make([]byte, hdrSize)
	h.put(b)
	b = append(b, payload...)
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	_, _, _ = c.WriteMsgUnix(b, oob, nil)
}

// fakeTable is a lease table the fake exposing side made.
type fakeTable struct {
	mem []byte
	fd  int
}

func newFakeTable(t *testing.T, slots int) *fakeTable {
	mem, fd, err := newTable(slots)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(mem); _ = unix.Close(fd) })
	return &fakeTable{mem: mem, fd: fd}
}

func (ft *fakeTable) send(c *net.UnixConn) {
	sendFD(c, header{typ: tTable, id: uint64(len(ft.mem))}, nil, ft.fd)
}

func sendSeg(c *net.UnixConn, id uint64, fd int, size, base uint64) {
	sendFD(c, header{typ: tSeg, id: id, length: segInfoSize}, putSeg(nil, size, base), fd)
}

// A hostile or broken exposing side cannot make the copier touch memory
// outside what it mapped, crash it, or hang a transfer: every malformed
// table or segment drops the connection, and the transfer fails with
// ErrRemoteLost.
func TestShmHostileExposer(t *testing.T) {
	seg, err := shm.Alloc(1 << 20)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Free() })
	const remote = 0x7000_0000
	for _, tc := range []struct {
		name  string
		start func(t *testing.T, c *net.UnixConn)
	}{
		{"TableBadMagic", func(t *testing.T, c *net.UnixConn) {
			ft := newFakeTable(t, 4)
			ft.mem[0] = 'X'
			ft.send(c)
		}},
		{"TableNotPowerOfTwo", func(t *testing.T, c *net.UnixConn) {
			ft := newFakeTable(t, 4)
			putTable(ft.mem, 3)
			ft.send(c)
		}},
		{"TableTooFewBytes", func(t *testing.T, c *net.UnixConn) {
			ft := newFakeTable(t, 4)
			putTable(ft.mem, 4096)
			ft.send(c)
		}},
		{"TableWithoutFD", func(t *testing.T, c *net.UnixConn) {
			sendFD(c, header{typ: tTable, id: uint64(tableSize(4))}, nil, -1)
		}},
		{"TableTwice", func(t *testing.T, c *net.UnixConn) {
			ft := newFakeTable(t, 4)
			ft.send(c)
			ft.send(c)
		}},
		{"SegmentBiggerThanFile", func(t *testing.T, c *net.UnixConn) {
			fd := memfdOf(t, seg)
			defer unix.Close(fd)
			sendSeg(c, 1, fd, 1<<30, remote)
		}},
		{"SegmentWraps", func(t *testing.T, c *net.UnixConn) {
			fd := memfdOf(t, seg)
			defer unix.Close(fd)
			sendSeg(c, 1, fd, 1<<20, ^uint64(0)-100)
		}},
		{"UnsealedSegment", func(t *testing.T, c *net.UnixConn) {
			fd, err := unix.MemfdCreate("x", unix.MFD_CLOEXEC)
			require.NoError(t, err)
			defer unix.Close(fd)
			require.NoError(t, unix.Ftruncate(fd, 1<<20))
			sendSeg(c, 1, fd, 1<<20, remote)
		}},
		{"SegmentNotAFile", func(t *testing.T, c *net.UnixConn) {
			var p [2]int
			require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
			defer unix.Close(p[0])
			defer unix.Close(p[1])
			sendSeg(c, 1, p[0], 1<<20, remote)
		}},
		{"SegmentWithoutFD", func(t *testing.T, c *net.UnixConn) {
			sendSeg(c, 1, -1, 1<<20, remote)
		}},
		{"SegmentTwice", func(t *testing.T, c *net.UnixConn) {
			fd := memfdOf(t, seg)
			defer unix.Close(fd)
			sendSeg(c, 1, fd, 1<<20, remote)
			sendSeg(c, 1, fd, 1<<20, remote)
		}},
		{"DropUnknownSegment", func(t *testing.T, c *net.UnixConn) {
			sendFD(c, header{typ: tSegDrop, id: 99}, nil, -1)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := shmExposer(t, func(c *net.UnixConn) { tc.start(t, c) }, nil)
			a, _ := newAgent(t, WithTimeout(2*time.Second))
			dst := make([]byte, 4096)
			x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fs.info, Key: agent.NewKey(), Backend: Name,
				Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: remote, Len: 4096, Kind: agent.KindDRAM}}}})
			if err == nil {
				select {
				case <-x.Done():
				case <-time.After(10 * time.Second):
					t.Fatal("transfer hangs")
				}
				err = x.Err()
			}
			require.ErrorIs(t, err, agent.ErrRemoteLost)
			t.Logf("%v", err)
		})
	}
}

// What a hostile exposing side publishes in a well-formed table is
// checked against what the copier mapped: a slot whose span or segment
// does not cover a transfer's ranges sends it to leases (which this fake
// never answers: the transfer times out, lost), never outside a mapping.
func TestShmHostileSlots(t *testing.T) {
	seg, err := shm.Alloc(1 << 20)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Free() })
	const remote = 0x7000_0000
	for _, tc := range []struct {
		name   string
		lo, hi uint64 // the span published
		segAt  uint64 // where the segment is said to lie
		at     uint64 // the range read
		shm    bool   // through the mapping
	}{
		{"Honest", remote, remote + 1<<20, remote, remote + 4096, true},
		{"SpanTooSmall", remote, remote + 100, remote, remote + 50, false},
		{"RangeOutsideSegment", remote, remote + 1<<30, remote, remote + 1<<20 - 50, false},
		{"SegmentElsewhere", remote, remote + 1<<20, remote + 1<<30, remote, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := agent.NewKey()
			ft := newFakeTable(t, 16)
			putSlot(ft.mem, home(keyHash(key), 16), slotView{hash: keyHash(key), lo: tc.lo, hi: tc.hi, acc: agent.AccessRead, segs: []uint64{1}}, 1, 1<<2|slotLive)
			fs := shmExposer(t, func(c *net.UnixConn) {
				ft.send(c)
				fd := memfdOf(t, seg)
				defer unix.Close(fd)
				sendSeg(c, 1, fd, 1<<20, tc.segAt)
			}, nil)
			a, b := newAgent(t, WithTimeout(300*time.Millisecond))
			require.NoError(t, a.Notify(context.Background(), fs.info, agent.NewKey(), []byte("hi"))) // connects
			// The table and segment are read: polled, as a reader
			// descheduled past a fixed sleep and the 300 ms a transfer
			// waits for them would send the honest case to leases.
			require.Eventually(t, func() bool {
				b.mu.Lock()
				defer b.mu.Unlock()
				ps := b.peers[fs.info.ID]
				if len(ps) != 1 {
					return false
				}
				ps[0].sh.mu.Lock()
				defer ps[0].sh.mu.Unlock()
				return ps[0].sh.table != nil && len(ps[0].sh.segs) == 1
			}, 5*time.Second, time.Millisecond, "the lease table and the segment were not mapped")
			dst := make([]byte, 100)
			x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fs.info, Key: key, Backend: Name,
				Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: tc.at, Len: 100, Kind: agent.KindDRAM}}}})
			require.NoError(t, err)
			<-x.Done()
			if tc.shm {
				require.NoError(t, x.Err())
				require.Equal(t, Name+"+shm", x.Path())
			} else {
				require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
				require.Equal(t, Name, x.Path())
			}
		})
	}
}

// An exposing side that drops a segment while copies through it run does
// not unmap it under them: the copy holds the mapping until it returns.
// The copier neither crashes nor fails the transfer.
func TestShmEarlySegmentDrop(t *testing.T) {
	seg, err := shm.Alloc(64 << 20)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Free() })
	const remote = 0x7000_0000
	key := agent.NewKey()
	ft := newFakeTable(t, 16)
	putSlot(ft.mem, home(keyHash(key), 16), slotView{hash: keyHash(key), lo: remote, hi: remote + 64<<20, acc: agent.AccessRead, segs: []uint64{1}}, 1, 1<<2|slotLive)
	var dropped atomic.Bool
	fs := shmExposer(t, func(c *net.UnixConn) {
		ft.send(c)
		fd := memfdOf(t, seg)
		defer unix.Close(fd)
		sendSeg(c, 1, fd, 64<<20, remote)
		// As soon as a copy is inside the slot, the segment is dropped.
		go func() {
			w := slotAt(ft.mem, home(keyHash(key), 16))
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
				if atomic.LoadUint32(w.readers) > 0 {
					sendFD(c, header{typ: tSegDrop, id: 1}, nil, -1)
					dropped.Store(true)
					return
				}
				runtime.Gosched()
			}
		}()
	}, nil)
	a, _ := newAgent(t)
	require.NoError(t, a.Notify(context.Background(), fs.info, agent.NewKey(), []byte("hi"))) // connects
	time.Sleep(20 * time.Millisecond)
	dst := make([]byte, 64<<20)
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fs.info, Key: key, Backend: Name,
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: remote, Len: 64 << 20, Kind: agent.KindDRAM}}}})
	require.NoError(t, err)
	<-x.Done()
	require.NoError(t, x.Err())
	require.Equal(t, Name+"+shm", x.Path())
	require.True(t, dropped.Load())
}

// memfdOf returns a new descriptor of buf's segment; the caller closes it.
func memfdOf(t *testing.T, buf *shm.Buffer) int {
	t.Helper()
	sg, ok := shm.Find(agent.DRAM(buf.Bytes()).Addr, 1)
	require.True(t, ok)
	fd, err := shm.DupFD(sg.ID)
	require.NoError(t, err)
	return fd
}
