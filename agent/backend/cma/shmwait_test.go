//go:build linux

package cma

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/shm"
)

// A transfer whose slot names a segment that has not arrived waits for it
// (a loaded exposing side may send it late) until WithTimeout, but not on
// the posting goroutine (Post returns at once) and no longer than the
// transfer lives: cancelled while it waits, it ends at once, and nothing
// was asked of the peer. Waiting out the old 100 ms sent an honest but
// descheduled peer's transfers to leases (the shm soak, in CI).
func TestShmWaitForSegmentEndsAtCancel(t *testing.T) {
	const remote = 0x7000_0000
	key := agent.NewKey()
	ft := newFakeTable(t, 16)
	putSlot(ft.mem, home(keyHash(key), 16), slotView{hash: keyHash(key), lo: remote, hi: remote + 1<<20, acc: agent.AccessRead, segs: []uint64{1}}, 1, 1<<2|slotLive)
	var asked atomic.Int32 // frames other than notifications: lease requests
	fs := shmExposer(t, func(c *net.UnixConn) {
		ft.send(c) // and segment 1 never
	}, func(_ *net.UnixConn, f *frame) {
		if f.typ != tNotify {
			asked.Add(1)
		}
	})
	a, _ := newAgent(t, WithTimeout(10*time.Second))
	require.NoError(t, a.Notify(context.Background(), fs.info, agent.NewKey(), []byte("hi"))) // connects
	time.Sleep(20 * time.Millisecond)                                                         // the table is read

	posted := time.Now()
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fs.info, Key: key, Backend: Name,
		Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 100)), Remote: agent.Region{Addr: remote, Len: 100, Kind: agent.KindDRAM}}}})
	require.NoError(t, err)
	// The wait is WithTimeout (10 s) long: a Post that waited for it on
	// the calling goroutine would take that; 2 s leaves room for a
	// descheduled test on a loaded machine.
	require.Less(t, time.Since(posted), 2*time.Second, "Post waited for the segment")
	time.Sleep(2 * segWait) // past the old bound: still waiting for the segment
	select {
	case <-x.Done():
		t.Fatalf("the transfer ended while its segment could still come: %v", x.Err())
	default:
	}
	start := time.Now()
	x.Cancel(context.Canceled)
	select {
	case <-x.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("a transfer waiting for a segment did not end at its cancellation")
	}
	t.Logf("ended %v after Cancel: %v", time.Since(start), x.Err())
	require.ErrorIs(t, x.Err(), agent.ErrCancelled)
	require.Zero(t, asked.Load(), "a cancelled wait asks the peer for nothing")
}

// A segment that arrives well after the exposure's slot named it (past
// the old 100 ms bound) still serves the transfer through the mapping:
// the copier waits for it rather than going to leases (which this fake
// never answers).
func TestShmLateSegmentServes(t *testing.T) {
	seg, err := shm.Alloc(1 << 20)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Free() })
	copy(seg.Bytes(), "late but whole")
	const remote = 0x7000_0000
	key := agent.NewKey()
	ft := newFakeTable(t, 16)
	putSlot(ft.mem, home(keyHash(key), 16), slotView{hash: keyHash(key), lo: remote, hi: remote + 1<<20, acc: agent.AccessRead, segs: []uint64{1}}, 1, 1<<2|slotLive)
	fs := shmExposer(t, func(c *net.UnixConn) {
		ft.send(c)
		fd := memfdOf(t, seg)
		go func() {
			defer unix.Close(fd)
			time.Sleep(3 * segWait)
			sendSeg(c, 1, fd, 1<<20, remote)
		}()
	}, nil)
	a, _ := newAgent(t, WithTimeout(10*time.Second))
	require.NoError(t, a.Notify(context.Background(), fs.info, agent.NewKey(), []byte("hi"))) // connects
	dst := make([]byte, 14)
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fs.info, Key: key, Backend: Name,
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: remote, Len: 14, Kind: agent.KindDRAM}}}})
	require.NoError(t, err)
	select {
	case <-x.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the transfer did not end once its segment came")
	}
	require.NoError(t, x.Err())
	require.Equal(t, Name+"+shm", x.Path())
	require.Equal(t, "late but whole", string(dst))
}

// A copier that tries an exposure's slot only after its agent closed (it
// was between two pieces of a large copy, outside the slot, while the
// revocation drained) finds it still saying "closed", and reports the peer
// lost: freed for reuse, the slot read as revoked, access denied (seen in
// CI: TestConformanceShared/Fault/PassiveClosed/write).
func TestShmClosedSlotStaysClosed(t *testing.T) {
	p := newShmPair(t, 4096, agent.AccessWrite)
	pc, w, want := copierSlot(t, p)
	pc.sh.mu.Lock()
	tbl := pc.sh.table.ref() // the copier's mapping outlives the connection
	pc.sh.mu.Unlock()
	defer tbl.unref()
	require.NoError(t, p.a.Close())
	seen, ok := w.try(want)
	require.False(t, ok, "a closed agent's slot let a copy in")
	require.Equal(t, want&^3|slotClosed, seen)
	require.ErrorIs(t, pc.revoked(&shmXfer{w: w, want: want}, seen, p.exp.Key()), agent.ErrRemoteLost)
}
