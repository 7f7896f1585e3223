//go:build linux

package cma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/shm"
	"github.com/goxfer/goxfer/internal/pattern"
)

// shmPair is two agents in this process, each with one cma backend (b is
// the copier's), and a shared buffer of size bytes exposed by a for acc,
// or (newHeapPair) a buffer on the Go heap.
type shmPair struct {
	a, c   *agent.Agent // exposing, copying
	ba, bc *Backend
	buf    *shm.Buffer // nil: heap
	heap   []byte
	exp    *agent.Exposure
}

// bytes returns the exposed buffer.
func (p *shmPair) bytes() []byte {
	if p.buf != nil {
		return p.buf.Bytes()
	}
	return p.heap
}

// path is the path of a transfer of the pair's that skips leases.
func (p *shmPair) path() string {
	if p.buf != nil {
		return Name + "+shm"
	}
	return Name + "+table"
}

// pairKinds are the memories the lease table serves without leases:
// shared segments (copied through a mapping) and the Go heap (copied with
// cross-memory attach).
var pairKinds = []struct {
	name string
	new  func(t *testing.T, size int, acc agent.Access, opts ...Option) *shmPair
}{{"shm", newShmPair}, {"heap", newHeapPair}}

func newShmPair(t *testing.T, size int, acc agent.Access, opts ...Option) *shmPair {
	t.Helper()
	p := &shmPair{}
	p.a, p.ba = newAgent(t, opts...)
	p.c, p.bc = newAgent(t, opts...)
	buf, err := shm.Alloc(size)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, buf.Free()) })
	p.buf = buf
	p.exp, err = p.a.Expose(acc, []agent.Local{agent.DRAM(buf.Bytes())})
	require.NoError(t, err)
	t.Cleanup(p.exp.Revoke)
	return p
}

func (p *shmPair) post(t *testing.T, op agent.Op, local []byte, remote uint64, notify []byte) *agent.Xfer {
	t.Helper()
	x, err := p.c.Post(context.Background(), agent.Request{Op: op, Peer: p.a.Info(), Key: p.exp.Key(), Backend: Name, Notify: notify,
		Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: agent.Region{Addr: remote, Len: uint64(len(local)), Kind: agent.KindDRAM}}}})
	require.NoError(t, err)
	return x
}

func waitX(t *testing.T, x *agent.Xfer) error {
	t.Helper()
	select {
	case <-x.Done():
		return x.Err()
	case <-time.After(30 * time.Second):
		t.Fatal("transfer hangs")
		return nil
	}
}

func TestShmReadWrite(t *testing.T) {
	for _, size := range []int{4 << 10, 3 << 20, 40 << 20} {
		p := newShmPair(t, size+8192, agent.AccessRead)
		base := agent.DRAM(p.buf.Bytes()).Addr
		pattern.Fill(p.buf.Bytes(), 7, 0, 0)
		dst := make([]byte, size)
		// The first transfer connects; the lease table and the segments
		// arrive right after, so it may use leases.
		require.NoError(t, waitX(t, p.post(t, agent.OpRead, dst[:1], base, nil)))
		time.Sleep(10 * time.Millisecond)
		x := p.post(t, agent.OpRead, dst, base+100, []byte("done"))
		require.NoError(t, waitX(t, x))
		require.Equal(t, "cma+shm", x.Path())
		require.Equal(t, p.buf.Bytes()[100:100+size], dst)
		ev := <-p.exp.Events()
		require.Equal(t, agent.EventNotify, ev.Kind)
		require.Equal(t, "done", string(ev.Msg))

		w := newShmPair(t, size, agent.AccessWrite)
		src := make([]byte, size)
		pattern.Fill(src, 9, 0, 0)
		require.NoError(t, waitX(t, w.post(t, agent.OpWrite, src[:1], agent.DRAM(w.buf.Bytes()).Addr, nil)))
		time.Sleep(10 * time.Millisecond)
		x = w.post(t, agent.OpWrite, src, agent.DRAM(w.buf.Bytes()).Addr, nil)
		require.NoError(t, waitX(t, x))
		require.Equal(t, "cma+shm", x.Path())
		require.Equal(t, src, w.buf.Bytes())
		// The second transfer needs no mapping request: same slot.
		require.NoError(t, waitX(t, w.post(t, agent.OpWrite, src[:10], agent.DRAM(w.buf.Bytes()).Addr+5, nil)))
	}
}

// Revocation is exact on the shared-memory path: once Revoke returns, no
// copy of the peer's touches the memory, whatever was in flight. WRITEs
// from several goroutines stamp the exposed buffer with their own byte;
// after Revoke the buffer must never change again, and later transfers
// are refused.
func TestShmRevokeStopsWrites(t *testing.T) {
	for _, kind := range pairKinds {
		t.Run(kind.name, func(t *testing.T) { testRevokeStopsWrites(t, kind.new) })
	}
}

func testRevokeStopsWrites(t *testing.T, newPair func(*testing.T, int, agent.Access, ...Option) *shmPair) {
	for round := range 20 {
		p := newPair(t, 3<<20, agent.AccessWrite)
		base := agent.DRAM(p.bytes()).Addr
		size := func(g int) int { return 1<<20 + g*4096 } // inline and worker copies both
		if p.buf == nil {
			size = func(g int) int { return 1<<20 - g*4096 } // every one lease-free
		}
		stop := make(chan struct{})
		done := make(chan error, 4)
		for g := range 4 {
			go func() {
				src := bytes.Repeat([]byte{byte(g + 1)}, size(g))
				for {
					select {
					case <-stop:
						done <- nil
						return
					default:
					}
					x := p.post(t, agent.OpWrite, src, base, nil)
					if err := waitX(t, x); err != nil {
						if !errors.Is(err, agent.ErrAccessDenied) {
							done <- err
							return
						}
					}
				}
			}()
		}
		time.Sleep(time.Duration(round%5) * time.Millisecond)
		p.exp.Revoke()
		snap := bytes.Clone(p.bytes())
		time.Sleep(20 * time.Millisecond)
		close(stop)
		for range 4 {
			require.NoError(t, <-done)
		}
		require.True(t, bytes.Equal(snap, p.bytes()), "round %d: the buffer changed after Revoke returned", round)
		err := waitX(t, p.post(t, agent.OpWrite, []byte{1}, base, nil))
		require.ErrorIs(t, err, agent.ErrAccessDenied)
	}
}

// copierSlot returns the copier's peer and the slot its lease table holds
// for the pair's exposure, with the stamp found there, once a transfer of
// 16 bytes at the exposure's start went through it (the copier's proof is
// in the slot).
func copierSlot(t *testing.T, p *shmPair) (*peer, slotWords, uint64) {
	t.Helper()
	base := agent.DRAM(p.bytes()).Addr
	for deadline := time.Now().Add(5 * time.Second); ; {
		op := agent.OpRead
		if p.exp.Access() == agent.AccessWrite {
			op = agent.OpWrite
		}
		x := p.post(t, op, make([]byte, 16), base, nil)
		require.NoError(t, waitX(t, x))
		if x.Path() == p.path() {
			break
		}
		require.True(t, time.Now().Before(deadline), "no transfer went through the lease table")
		time.Sleep(5 * time.Millisecond)
	}
	p.bc.mu.Lock()
	ps := p.bc.peers[p.a.ID()]
	p.bc.mu.Unlock()
	require.Len(t, ps, 1)
	sp := &ps[0].sh
	sp.mu.Lock()
	defer sp.mu.Unlock()
	require.NotNil(t, sp.table)
	hash := keyHash(p.exp.Key())
	h := home(hash, sp.slots)
	for j := range maxProbe {
		k := (h + j) & (sp.slots - 1)
		if readSlot(sp.table.mem, k).hash == hash {
			w := slotAt(sp.table.mem, k)
			return ps[0], w, atomic.LoadUint64(w.stamp)
		}
	}
	t.Fatal("the exposure is not published to the copier")
	return nil, slotWords{}, 0
}

// A copier stuck inside a mapping (frozen, or hostile: it entered the
// slot and never leaves) holds Revoke up for WithTimeout at most: then
// its connection is dropped and Revoke returns.
func TestShmRevokeBoundedStuckReader(t *testing.T) {
	for _, kind := range pairKinds {
		t.Run(kind.name, func(t *testing.T) {
			const timeout = 300 * time.Millisecond
			p := kind.new(t, 4096, agent.AccessRead, WithTimeout(timeout))
			base := agent.DRAM(p.bytes()).Addr
			require.NoError(t, waitX(t, p.post(t, agent.OpRead, make([]byte, 16), base, nil)))
			_, w, want := copierSlot(t, p)
			require.True(t, w.enter(want)) // and never leaves
			start := time.Now()
			p.exp.Revoke()
			took := time.Since(start)
			require.GreaterOrEqual(t, took, timeout-10*time.Millisecond)
			require.Less(t, took, 3*timeout)
			t.Logf("Revoke returned %v after the stuck copier's timeout of %v", took, timeout)
		})
	}
}

// A copier whose connection closes while inside a mapping (its process
// died in the middle of a copy: the kernel closes its socket only after
// its memory is gone) does not hold Revoke up: the exposing side sees the
// end of the connection and stops waiting at once.
func TestShmRevokeCopierGone(t *testing.T) {
	for _, kind := range pairKinds {
		t.Run(kind.name, func(t *testing.T) {
			const timeout = 5 * time.Second
			p := kind.new(t, 4096, agent.AccessRead, WithTimeout(timeout))
			base := agent.DRAM(p.bytes()).Addr
			require.NoError(t, waitX(t, p.post(t, agent.OpRead, make([]byte, 16), base, nil)))
			pc, w, want := copierSlot(t, p)
			require.True(t, w.enter(want))
			start := time.Now()
			go func() {
				time.Sleep(50 * time.Millisecond)
				_ = pc.c.Close() // as the kernel would at exit
			}()
			p.exp.Revoke()
			took := time.Since(start)
			require.Less(t, took, time.Second, "Revoke waited for a copier whose connection ended")
			t.Logf("Revoke returned %v after it began, the copier's end closing at 50ms", took)
		})
	}
}

// The copier rechecks the slot's stamp on every copy: after Revoke a stamp
// found before is refused (the copy is not made), and the transfer is
// denied.
func TestShmStaleMappingRefused(t *testing.T) {
	for _, kind := range pairKinds {
		t.Run(kind.name, func(t *testing.T) {
			p := kind.new(t, 4096, agent.AccessRead)
			base := agent.DRAM(p.bytes()).Addr
			require.NoError(t, waitX(t, p.post(t, agent.OpRead, make([]byte, 16), base, nil)))
			_, w, want := copierSlot(t, p)
			p.exp.Revoke()
			require.False(t, w.enter(want), "a revoked slot let a copy in")
			err := waitX(t, p.post(t, agent.OpRead, make([]byte, 16), base, nil))
			require.ErrorIs(t, err, agent.ErrAccessDenied)
		})
	}
}

// enter is try without the stamp, for tests.
func (w slotWords) enter(want uint64) bool {
	_, ok := w.try(want)
	return ok
}

// A copy refused because the exposing agent is closing reports the peer
// lost, even when the slot is freed (its revocation drained: the refused
// copy left it) before the error is made. It read the stamp again once,
// found the slot free and said "access denied: revoked" (seen in CI:
// PassiveClosed/write over shared memory).
func TestShmClosingRefusalAfterSlotFreed(t *testing.T) {
	key := agent.NewKey()
	ft := newFakeTable(t, 16)
	i := home(keyHash(key), 16)
	const gen = 5
	putSlot(ft.mem, i, slotView{hash: keyHash(key), lo: 0x7000_0000, hi: 0x7000_1000, acc: agent.AccessWrite, segs: []uint64{1}}, 1, gen<<2|slotLive)
	w := slotAt(ft.mem, i)
	tx := &shmXfer{w: w, want: gen<<2 | slotLive}
	p := &peer{}
	for _, tc := range []struct {
		state uint64
		want  error
	}{{slotClosed, agent.ErrRemoteLost}, {slotRevoked, agent.ErrAccessDenied}} {
		atomic.StoreUint64(w.stamp, gen<<2|tc.state)
		seen, ok := w.try(tx.want)
		require.False(t, ok)
		require.Zero(t, atomic.LoadUint32(w.readers), "a refused copy left the slot")
		atomic.StoreUint64(w.stamp, gen<<2) // drained and freed, as Unpublish does
		err := p.revoked(tx, seen, key)
		require.ErrorIs(t, err, tc.want, "state %d", tc.state)
		atomic.StoreUint64(w.stamp, (gen+1)<<2|slotLive) // reused by another exposure
		require.ErrorIs(t, p.revoked(tx, seen, key), tc.want, "state %d, slot reused", tc.state)
	}
}

// Memory of a shared buffer cannot be freed while exposed: Free refuses,
// and succeeds once the exposure is revoked.
func TestShmFreeWhileExposed(t *testing.T) {
	a, _ := newAgent(t)
	buf, err := shm.Alloc(8192)
	require.NoError(t, err)
	e, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(buf.Bytes()[100:200])})
	require.NoError(t, err)
	require.ErrorIs(t, buf.Free(), shm.ErrBusy)
	e.Revoke()
	require.NoError(t, buf.Free())
	require.NoError(t, buf.Free()) // again: nothing
}

// Off on either side, the pair uses leases: the path is plain cma.
func TestShmOff(t *testing.T) {
	for _, side := range []string{"exposing", "copying"} {
		p := &shmPair{}
		if side == "exposing" {
			p.a, p.ba = newAgent(t, WithSharedMemory(false))
			p.c, p.bc = newAgent(t)
		} else {
			p.a, p.ba = newAgent(t)
			p.c, p.bc = newAgent(t, WithSharedMemory(false))
		}
		buf, err := shm.Alloc(4096)
		require.NoError(t, err)
		p.buf = buf
		p.exp, err = p.a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(buf.Bytes())})
		require.NoError(t, err)
		x := p.post(t, agent.OpRead, make([]byte, 64), agent.DRAM(buf.Bytes()).Addr, nil)
		require.NoError(t, waitX(t, x))
		require.Equal(t, Name, x.Path(), side)
		p.exp.Revoke()
		require.NoError(t, buf.Free())
	}
}

// Transfers over memory partly in a segment and partly on the Go heap use
// leases for the whole transfer; heap-only exposures are published for
// cross-memory attach ("cma+table") if they are one region.
func TestShmMixedAndHeap(t *testing.T) {
	a, _ := newAgent(t)
	c, _ := newAgent(t)
	buf, err := shm.Alloc(4096)
	require.NoError(t, err)
	t.Cleanup(func() { _ = buf.Free() })
	heap := bytes.Repeat([]byte{7}, 4096)
	pattern.Fill(buf.Bytes(), 3, 0, 0)
	e, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(buf.Bytes()), agent.DRAM(heap)})
	require.NoError(t, err)
	t.Cleanup(e.Revoke)
	seg := func(local []byte, remote []byte) agent.Segment {
		return agent.Segment{Local: agent.DRAM(local), Remote: agent.DRAM(remote).Region}
	}
	d1, d2 := make([]byte, 4096), make([]byte, 4096)
	x, err := c.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: e.Key(), Backend: Name,
		Segments: []agent.Segment{seg(d1, buf.Bytes()), seg(d2, heap)}})
	require.NoError(t, err)
	require.NoError(t, waitX(t, x))
	require.Equal(t, Name, x.Path())
	require.Equal(t, buf.Bytes(), d1)
	require.Equal(t, heap, d2)
	x, err = c.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: e.Key(), Backend: Name,
		Segments: []agent.Segment{seg(d1[:10], buf.Bytes()[5:15])}})
	require.NoError(t, err)
	require.NoError(t, waitX(t, x))
	require.Equal(t, Name+"+shm", x.Path())

	h, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(heap)})
	require.NoError(t, err)
	t.Cleanup(h.Revoke)
	for range 3 {
		x, err = c.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: h.Key(), Backend: Name,
			Segments: []agent.Segment{seg(d2, heap)}})
		require.NoError(t, err)
		require.NoError(t, waitX(t, x))
		require.Equal(t, Name+"+table", x.Path())
		require.Equal(t, heap, d2)
	}

	// Two heap regions with a gap between them: leases serve the
	// exposure, and refuse a READ of the gap.
	gapped := bytes.Repeat([]byte{9}, 3*4096)
	g, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(gapped[:4096]), agent.DRAM(gapped[2*4096:])})
	require.NoError(t, err)
	t.Cleanup(g.Revoke)
	x, err = c.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: g.Key(), Backend: Name,
		Segments: []agent.Segment{seg(d2, gapped[2*4096:])}})
	require.NoError(t, err)
	require.NoError(t, waitX(t, x))
	require.Equal(t, Name, x.Path())
	require.Equal(t, gapped[2*4096:], d2)
	x, err = c.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: g.Key(), Backend: Name,
		Segments: []agent.Segment{seg(d2, gapped[4096:2*4096])}})
	require.NoError(t, err)
	require.ErrorIs(t, waitX(t, x), agent.ErrAccessDenied, "a READ of the gap")
}

// BenchmarkShmPost measures one transfer through a peer's shared memory,
// from Post to Done, in one process (the copier's whole cost: lookup,
// copy, notification queued): 4 KiB and 64 KiB, READ and WRITE.
func BenchmarkShmPost(b *testing.B) {
	for _, size := range []int{4 << 10, 64 << 10} {
		for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
			b.Run(fmt.Sprintf("%v/%dKiB", op, size>>10), func(b *testing.B) {
				a, _ := newAgent(b)
				c, _ := newAgent(b)
				buf, err := shm.Alloc(size)
				require.NoError(b, err)
				e, err := a.Expose(op.Access(), []agent.Local{agent.DRAM(buf.Bytes())})
				require.NoError(b, err)
				b.Cleanup(func() { e.Revoke(); _ = buf.Free() })
				local := make([]byte, size)
				req := agent.Request{Op: op, Peer: a.Info(), Key: e.Key(), Backend: Name, Notify: []byte("done"),
					Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: agent.DRAM(buf.Bytes()).Region}}}
				benchPosts(b, c, e, req, Name+"+shm", size)
			})
		}
	}
}

// Neighbouring copies contiguous on both sides merge; copies that are not,
// or whose slices were cut to their length, stay apart.
func TestShmMergeOps(t *testing.T) {
	l, r := make([]byte, 64), make([]byte, 64)
	ops := mergeOps([]shmOp{
		{l[0:8], r[0:8]}, {l[8:16], r[8:16]}, // merge
		{l[16:24:24], r[24:32]}, // remote not contiguous with the previous
		{l[24:32], r[32:40]},    // local: the previous was cut to its length
		{l[32:40], r[40:48]},    // merges with the previous
	})
	require.Len(t, ops, 3)
	require.Len(t, ops[0].local, 16)
	require.Len(t, ops[1].local, 8)
	require.Len(t, ops[2].local, 16)
	require.Equal(t, &r[32], &ops[2].remote[0])
}

// BenchmarkShmNotified measures a 4 KiB READ through shared memory from
// Post to the exposure's notification event, in one process: the one-way
// notification's cost (direct write, the exposing side's reader, Deliver,
// the event's receiver).
func BenchmarkShmNotified(b *testing.B) {
	a, _ := newAgent(b)
	c, _ := newAgent(b)
	buf, err := shm.Alloc(4096)
	require.NoError(b, err)
	e, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(buf.Bytes())})
	require.NoError(b, err)
	b.Cleanup(func() { e.Revoke(); _ = buf.Free() })
	local := make([]byte, 4096)
	req := agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: e.Key(), Backend: Name, Notify: []byte("done"),
		Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: agent.DRAM(buf.Bytes()).Region}}}
	post := func() {
		x, err := c.Post(context.Background(), req)
		require.NoError(b, err)
		<-x.Done()
		require.NoError(b, x.Err())
		<-e.Events()
	}
	post()
	time.Sleep(20 * time.Millisecond)
	b.ResetTimer()
	for b.Loop() {
		post()
	}
}

// benchPosts runs req from c in a loop, each to Done, once a first one went
// by path (the exposure's events drained meanwhile): the benchmarks of
// transfers without a lease round trip.
func benchPosts(b *testing.B, c *agent.Agent, e *agent.Exposure, req agent.Request, path string, size int) {
	post := func() *agent.Xfer {
		x, err := c.Post(context.Background(), req)
		require.NoError(b, err)
		<-x.Done()
		require.NoError(b, x.Err())
		return x
	}
	post()
	time.Sleep(20 * time.Millisecond)
	require.Equal(b, path, post().Path())
	stop := make(chan struct{})
	drained := make(chan struct{})
	go func() { // the exposure's events
		defer close(drained)
		for {
			select {
			case <-e.Events():
			case <-stop:
				return
			}
		}
	}()
	defer func() { close(stop); <-drained }()
	b.SetBytes(int64(size))
	b.ResetTimer()
	for b.Loop() {
		post()
	}
}
