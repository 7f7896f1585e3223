//go:build linux

package cma

import (
	"bufio"
	"context"
	"encoding/binary"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/shm"
)

// shmExposer is a fake exposing side that agrees shared memory and then
// answers each mapping request as the test says.
func shmExposer(t *testing.T, serve func(c *net.UnixConn, f *frame)) *fakeSocket {
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
		var hdr [hdrSize]byte
		var buf []byte
		var f frame
		for readFrame(br, hdr[:], &buf, limits{maxRanges: 4096, maxNotify: 64 << 10, shm: true}, &f) == nil {
			serve(c, &f)
		}
	})
}

func sendFD(t *testing.T, c *net.UnixConn, h header, payload []byte, fd int) {
	b := make([]byte, hdrSize)
	h.put(b)
	b = append(b, payload...)
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	_, _, _ = c.WriteMsgUnix(b, oob, nil)
}

func sendTable(t *testing.T, c *net.UnixConn, slots int, mangle func([]byte)) {
	mem, fd, err := newTable(slots)
	require.NoError(t, err)
	if mangle != nil {
		mangle(mem)
	}
	defer unix.Munmap(mem)
	defer unix.Close(fd)
	sendFD(t, c, header{typ: tTable, id: uint64(len(mem))}, nil, fd)
}

func sendSeg(t *testing.T, c *net.UnixConn, id uint64, fd int, size uint64) {
	sendFD(t, c, header{typ: tSeg, id: id, length: segInfoSize}, binary.LittleEndian.AppendUint64(nil, size), fd)
}

func sendMapped(c *net.UnixConn, id uint64, a mapAnswer) {
	b := make([]byte, hdrSize)
	(&header{typ: tMapped, status: stOK, count: uint32(len(a.entries)), id: id, length: mapAnswerSize}).put(b)
	_, _ = c.Write(putMapAnswer(b, a))
}

// A hostile or broken exposing side cannot make the copier touch memory
// outside what it mapped, crash it, or hang a transfer: every malformed
// table, segment or answer drops the connection, and the transfer fails
// with ErrRemoteLost within the timeout.
func TestShmHostileExposer(t *testing.T) {
	seg, err := shm.Alloc(1 << 20)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Free() })
	dup := func() int { return memfdOf(t, seg) }
	const remote = 0x7000_0000
	good := func(id uint64) mapAnswer {
		return mapAnswer{slot: 0, gen: 1, entries: []mapEntry{{addr: remote, n: 4096, seg: 1, off: 0}}}
	}
	for _, tc := range []struct {
		name  string
		serve func(t *testing.T, c *net.UnixConn, f *frame)
	}{
		{"NoTable", func(t *testing.T, c *net.UnixConn, f *frame) {
			fd := dup()
			defer unix.Close(fd)
			sendSeg(t, c, 1, fd, 1<<20)
			sendMapped(c, f.id, good(f.id))
		}},
		{"TableBadMagic", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendTable(t, c, 4, func(b []byte) { b[0] = 'X' })
		}},
		{"TableTooFewBytes", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendTable(t, c, 4, func(b []byte) { binary.LittleEndian.PutUint32(b[8:], 4096) })
		}},
		{"TableWithoutFD", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendFD(t, c, header{typ: tTable, id: uint64(tableSize(4))}, nil, -1)
		}},
		{"SlotOutsideTable", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendTable(t, c, 4, nil)
			fd := dup()
			defer unix.Close(fd)
			sendSeg(t, c, 1, fd, 1<<20)
			a := good(f.id)
			a.slot = 4
			sendMapped(c, f.id, a)
		}},
		{"UnknownSegment", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendTable(t, c, 4, nil)
			sendMapped(c, f.id, good(f.id))
		}},
		{"RangeOutsideSegment", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendTable(t, c, 4, nil)
			fd := dup()
			defer unix.Close(fd)
			sendSeg(t, c, 1, fd, 1<<20)
			a := good(f.id)
			a.entries[0].off = 1<<20 - 100
			sendMapped(c, f.id, a)
		}},
		{"SegmentBiggerThanFile", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendTable(t, c, 4, nil)
			fd := dup()
			defer unix.Close(fd)
			sendSeg(t, c, 1, fd, 1<<30)
		}},
		{"UnsealedSegment", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendTable(t, c, 4, nil)
			fd, err := unix.MemfdCreate("x", unix.MFD_CLOEXEC)
			require.NoError(t, err)
			defer unix.Close(fd)
			require.NoError(t, unix.Ftruncate(fd, 1<<20))
			sendSeg(t, c, 1, fd, 1<<20)
		}},
		{"SegmentNotAFile", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendTable(t, c, 4, nil)
			var p [2]int
			require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
			defer unix.Close(p[0])
			defer unix.Close(p[1])
			sendSeg(t, c, 1, p[0], 1<<20)
		}},
		{"SegmentTwice", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendTable(t, c, 4, nil)
			fd := dup()
			defer unix.Close(fd)
			sendSeg(t, c, 1, fd, 1<<20)
			sendSeg(t, c, 1, fd, 1<<20)
		}},
		{"UnaskedAnswer", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendTable(t, c, 4, nil)
			sendMapped(c, f.id+1000, good(f.id))
		}},
		{"DropUnknownSegment", func(t *testing.T, c *net.UnixConn, f *frame) {
			sendTable(t, c, 4, nil)
			sendFD(t, c, header{typ: tSegDrop, id: 99}, nil, -1)
		}},
		{"Silent", func(t *testing.T, c *net.UnixConn, f *frame) {}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := shmExposer(t, func(c *net.UnixConn, f *frame) {
				if f.typ == tMap {
					tc.serve(t, c, f)
				}
			})
			a, _ := newAgent(t, WithTimeout(500*time.Millisecond))
			dst := make([]byte, 4096)
			x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fs.info, Key: agent.NewKey(), Backend: Name,
				Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: remote, Len: 4096, Kind: agent.KindDRAM}}}})
			require.NoError(t, err)
			select {
			case <-x.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("transfer hangs")
			}
			require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
			t.Logf("%v", x.Err())
		})
	}
}

// An exposing side that drops a segment (tSegDrop) while copies through it
// run does not unmap it under them: the mapping holds the segment until
// the copies returned. The copier neither crashes nor fails the transfer.
func TestShmEarlySegmentDrop(t *testing.T) {
	seg, err := shm.Alloc(64 << 20)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Free() })
	const remote = 0x7000_0000
	table, tfd, err := newTable(4)
	require.NoError(t, err)
	defer unix.Munmap(table)
	defer unix.Close(tfd)
	atomic64(table, 0, 1<<2|slotLive)
	fs := shmExposer(t, func(c *net.UnixConn, f *frame) {
		if f.typ != tMap {
			return
		}
		sendFD(t, c, header{typ: tTable, id: uint64(len(table))}, nil, tfd)
		fd := memfdOf(t, seg)
		sendSeg(t, c, 1, fd, 64<<20)
		unix.Close(fd)
		sendMapped(c, f.id, mapAnswer{slot: 0, gen: 1, entries: []mapEntry{{addr: remote, n: 64 << 20, seg: 1}}})
		sendFD(t, c, header{typ: tSegDrop, id: 1}, nil, -1) // at once: copies may be running
	})
	a, _ := newAgent(t)
	key := agent.NewKey()
	for range 5 {
		dst := make([]byte, 64<<20)
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fs.info, Key: key, Backend: Name,
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: remote, Len: 64 << 20, Kind: agent.KindDRAM}}}})
		require.NoError(t, err)
		<-x.Done()
		require.NoError(t, x.Err())
	}
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

// atomic64 stores v in the stamp of slot i of a lease table.
func atomic64(table []byte, i int, v uint64) {
	atomic.StoreUint64(slotAt(table, i).stamp, v)
}
