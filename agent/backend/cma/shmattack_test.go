//go:build linux

package cma

import (
	"bytes"
	"cmp"
	"context"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/shm"
)

// Attacks on the shared-memory path's slot reuse (issue 17): a lease-table
// slot freed by a revocation is taken by the next exposure whose key homes
// there, with the next generation. A copier that found the old exposure
// just before (a transfer racing the revocation: a worker re-entering the
// slot between pieces, a transfer posted with a token being closed) must
// neither unbalance the slot's count nor reach the new exposure with the
// old key.

// slotReuse sets up a pair whose copier mapped the exposing side's table,
// and an exposure A of buf[0:4096] the copier found: its slot and stamp.
// The buffer is shared memory or, for the lease-free path of the Go heap
// (cma+table), which uses the same slots, a heap buffer (pairKinds).
type slotReuse struct {
	p    *shmPair
	pc   *peer
	base uint64
	slot int
	w    slotWords
	want uint64
	keyA agent.Key
}

func newSlotReuse(t *testing.T, timeout time.Duration, newPair func(*testing.T, int, agent.Access, ...Option) *shmPair) *slotReuse {
	t.Helper()
	// p.exp (the whole buffer) stays exposed: the segment stays mapped,
	// so the exposures below cost no segment frames.
	p := newPair(t, 64<<10, agent.AccessRead, WithTimeout(timeout))
	r := &slotReuse{p: p, base: agent.DRAM(p.bytes()).Addr}
	require.NoError(t, waitX(t, p.post(t, agent.OpRead, make([]byte, 16), r.base, nil)))
	require.Eventually(t, func() bool {
		x := p.post(t, agent.OpRead, make([]byte, 16), r.base, nil)
		return waitX(t, x) == nil && x.Path() == p.path()
	}, 5*time.Second, 5*time.Millisecond)
	a, err := p.a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(p.bytes()[:4096])})
	require.NoError(t, err)
	r.keyA = a.Key()
	p.exp = a // copierSlot looks for p.exp
	r.pc, r.w, r.want = copierSlot(t, p)
	r.slot = r.slotOf(t, r.keyA)
	a.Revoke()
	return r
}

// slotOf returns the copier's table slot holding key's hash.
func (r *slotReuse) slotOf(t *testing.T, key agent.Key) int {
	t.Helper()
	sp := &r.pc.sh
	sp.mu.Lock()
	defer sp.mu.Unlock()
	h := keyHash(key)
	for j := range maxProbe {
		k := (home(h, sp.slots) + j) & (sp.slots - 1)
		if readSlot(sp.table.mem, k).hash == h {
			return k
		}
	}
	t.Fatal("not published")
	return -1
}

// exposeInto exposes buf[8192:12288] again and again, revoking each
// exposure, until one's key takes slot: that one is returned, live.
// during runs concurrently until then; it calls ready once it runs.
func (r *slotReuse) exposeInto(t *testing.T, during func(stop <-chan struct{}, ready func())) *agent.Exposure {
	t.Helper()
	stop, started := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); during(stop, sync.OnceFunc(func() { close(started) })) }()
	defer wg.Wait()
	defer close(stop)
	<-started
	// A key homes to a given slot one time in maxSlots (8192): 1<<16
	// tries missed with odds e^-8 per call, and CI saw it once across the
	// calls of a run; 1<<19 tries miss with odds e^-64, and take no longer
	// when they hit.
	for range 1 << 19 {
		e, err := r.p.a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(r.p.bytes()[8192:12288])})
		require.NoError(t, err)
		if home(keyHash(e.Key()), maxSlots) == r.slot {
			t.Cleanup(e.Revoke) // before the buffer is freed
			return e
		}
		e.Revoke()
	}
	t.Fatalf("no key homed to slot %d (key A's home %d)", r.slot, home(keyHash(r.keyA), maxSlots))
	return nil
}

// A copier entering a slot with the stamp of a revoked exposure (it found
// the slot before the revocation, and enters after: what a copy worker
// does between pieces) counts itself in and out. If the slot is reused
// for a new exposure in between, the count must stay balanced: a count
// that wrapped below zero would make the new exposure's Revoke wait for a
// copier that does not exist, the whole timeout, and then drop the
// connection, failing every transfer on it.
func TestShmAttackStaleEnterAcrossReuse(t *testing.T) {
	for _, kind := range pairKinds {
		t.Run(kind.name, func(t *testing.T) { testStaleEnterAcrossReuse(t, kind.new) })
	}
}

func testStaleEnterAcrossReuse(t *testing.T, newPair func(*testing.T, int, agent.Access, ...Option) *shmPair) {
	const timeout = time.Second
	for trial := range 10 {
		r := newSlotReuse(t, timeout, newPair)
		var entered atomic.Int64
		e := r.exposeInto(t, func(stop <-chan struct{}, ready func()) {
			for {
				ready()
				select {
				case <-stop:
					return
				default:
				}
				for range 64 {
					r.w.enter(r.want) // stale: never gets in
				}
				entered.Add(64)
			}
		})
		n := atomic.LoadUint32(r.w.readers)
		t.Logf("trial %d: %d stale enters raced the reuse of slot %d; readers now %d", trial, entered.Load(), r.slot, n)
		require.Zero(t, n, "the slot's count of copies inside is unbalanced after its reuse")
		start := time.Now()
		e.Revoke()
		require.Less(t, time.Since(start), timeout/2, "Revoke of the new exposure waited for a copier that is not inside")
	}
}

// A copier resolving a revoked key while its slot is reused must not
// come away with the new exposure's stamp: it would enter the slot, as
// live, and copy through the old exposure's span (the view it read
// before the reuse) after the old exposure's Revoke returned.
func TestShmAttackStaleKeyAcrossReuse(t *testing.T) {
	for _, kind := range pairKinds {
		t.Run(kind.name, func(t *testing.T) { testStaleKeyAcrossReuse(t, kind.new) })
	}
}

func testStaleKeyAcrossReuse(t *testing.T, newPair func(*testing.T, int, agent.Access, ...Option) *shmPair) {
	for trial := range 10 {
		r := newSlotReuse(t, time.Second, newPair)
		var hits, tries atomic.Int64
		var got atomic.Uint64
		e := r.exposeInto(t, func(stop <-chan struct{}, ready func()) {
			x := &agent.Work{Op: agent.OpRead, Key: r.keyA, Segments: []agent.Segment{{
				Local:  agent.DRAM(make([]byte, 4096)),
				Remote: agent.Region{Addr: r.base, Len: 4096, Kind: agent.KindDRAM},
			}}}
			h := keyHash(r.keyA)
			ops := make([]shmOp, 1)
			for {
				ready()
				select {
				case <-stop:
					return
				default:
				}
				tries.Add(1)
				if tx, _, _ := r.pc.resolveOnce(x, h, ops); tx != nil {
					hits.Add(1)
					got.Store(tx.want)
					tx.release()
				}
			}
		})
		t.Logf("trial %d: %d resolves of the revoked key raced the reuse of slot %d", trial, tries.Load(), r.slot)
		require.Zero(t, hits.Load(), "a revoked key resolved to the live stamp %#x of exposure %v in its old slot: the copy would enter and write the old span after Revoke returned", got.Load(), e.Key())
	}
}

// A segment the copier could not map (mmap failing for want of memory or
// address space: RLIMIT_AS, vm.max_map_count; here a memory file sealed
// against writes, which fails mmap the same way) is logged and left out:
// "transfers of it go to leases". Then the exposing side, honest, drops
// the segment once its exposures are revoked. The copier must take the
// drop of a segment it was sent and left out as the drop it is, not as a
// protocol violation that ends the connection (failing every transfer on
// it and telling the exposures bound to it that the peer is lost); and a
// transfer of an exposure lying in it must not wait for it (segWait) as
// for a segment still in the socket, every time.
func TestShmAttackUnmappableSegment(t *testing.T) {
	const remote = 0x7000_0000
	key := agent.NewKey()
	ft := newFakeTable(t, 16)
	putSlot(ft.mem, home(keyHash(key), 16), slotView{hash: keyHash(key), lo: remote, hi: remote + 1<<20, acc: agent.AccessRead, segs: []uint64{1}}, 1, 1<<2|slotLive)
	drop := make(chan struct{})
	fs := shmExposer(t, func(c *net.UnixConn) {
		ft.send(c)
		fd, err := unix.MemfdCreate("unmappable", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		require.NoError(t, err)
		defer unix.Close(fd)
		require.NoError(t, unix.Ftruncate(fd, 1<<20))
		_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE)
		require.NoError(t, err)
		sendSeg(c, 1, fd, 1<<20, remote)
		go func() {
			<-drop
			sendFD(c, header{typ: tSegDrop, id: 1}, nil, -1)
		}()
	}, nil)
	a, b := newAgent(t, WithTimeout(2*time.Second))
	require.NoError(t, a.Notify(context.Background(), fs.info, agent.NewKey(), []byte("hi"))) // connects
	var p *peer
	require.Eventually(t, func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		if ps := b.peers[fs.info.ID]; len(ps) == 1 {
			p = ps[0]
			p.sh.mu.Lock()
			defer p.sh.mu.Unlock()
			return p.sh.table != nil
		}
		return false
	}, 5*time.Second, 5*time.Millisecond)
	// The segment is read, and left out: polled, as a fixed sleep could
	// end before the reader got to it and resolve would wait for it.
	require.Eventually(t, func() bool {
		p.sh.mu.Lock()
		defer p.sh.mu.Unlock()
		return p.sh.unmapped[1]
	}, 5*time.Second, time.Millisecond, "the unmappable segment was not read and left out")

	x := &agent.Work{Op: agent.OpRead, Key: key, Segments: []agent.Segment{{
		Local: agent.DRAM(make([]byte, 100)), Remote: agent.Region{Addr: remote, Len: 100, Kind: agent.KindDRAM}}}}
	start := time.Now()
	_, ok := p.resolve(x, make([]shmOp, 1))
	took := time.Since(start)
	require.False(t, ok)
	t.Logf("a transfer of the exposure in the unmapped segment waited %v before leases", took)

	close(drop)
	time.Sleep(50 * time.Millisecond)
	select {
	case <-p.dead:
		t.Fatalf("the drop of a segment left out ended the connection: %v", p.failure())
	default:
	}
	require.Less(t, took, segWait/2, "a segment that could not be mapped was waited for as one still in the socket")
}

// An exposing side that exposes and revokes one block of a pool at a
// time (a KV-cache pool serving one request after another) sends the
// pool's segment, drops it when its last exposure is revoked, and sends
// it again with the next exposure. The frames must reach the copier in
// that order: a segment sent again before the drop of its last sending
// reads as "shared twice", a protocol violation, and the copier drops
// the connection, failing whatever runs on it. The sender takes the
// queued frames, then the connection's write lock: an Expose in between
// (the socket idle, the queue empty) sends the segment at once, ahead of
// the drop the sender holds. Here the write lock is held (as a grant
// being written would) while the drop is queued and taken, so that the
// sender waits in that window; the next Expose comes as it is released.
func TestShmAttackSegmentResentBeforeDrop(t *testing.T) {
	for round := range 20 {
		p := newShmPair(t, 64<<10, agent.AccessRead)
		base := agent.DRAM(p.buf.Bytes()).Addr
		require.Eventually(t, func() bool {
			x := p.post(t, agent.OpRead, make([]byte, 16), base, nil)
			return waitX(t, x) == nil && x.Path() == "cma+shm"
		}, 5*time.Second, 5*time.Millisecond)
		pc, _, _ := copierSlot(t, p)
		p.ba.pub.mu.Lock()
		require.Len(t, p.ba.pub.conns, 1)
		var s *server
		for c := range p.ba.pub.conns {
			s = c
		}
		p.ba.pub.mu.Unlock()

		s.wmu.Lock()
		p.exp.Revoke() // the segment's last exposure: its drop is queued
		taken := func() bool {
			p.ba.pub.mu.Lock()
			defer p.ba.pub.mu.Unlock()
			return len(s.sh.out) == 0
		}
		for !taken() {
			runtime.Gosched()
		}
		s.wmu.Unlock()
		e, err := p.a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(p.buf.Bytes()[:4096])})
		require.NoError(t, err)
		t.Cleanup(e.Revoke)
		time.Sleep(20 * time.Millisecond)
		select {
		case <-pc.dead:
			t.Fatalf("round %d: the copier dropped the connection: %v", round, pc.failure())
		default:
		}
	}
}

// The span check is the span of the exposure's regions: for an exposure
// of regions in two segments, every other segment lying between them in
// the exposing process is inside the span. A copier holding the key of a
// WRITE exposure of the outer two must not write through it into the
// middle segment, which only a READ exposure grants (published on the
// same connection, so mapped there): leases refuse such a range, and so
// must the mapping, where the exposure's slot names all its segments.
func TestShmAttackSpanCoversOtherSegment(t *testing.T) {
	a, _ := newAgent(t)
	c, _ := newAgent(t)
	var bufs []*shm.Buffer
	for range 3 {
		buf, err := shm.Alloc(64 << 10)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, buf.Free()) })
		bufs = append(bufs, buf)
	}
	slices.SortFunc(bufs, func(x, y *shm.Buffer) int {
		return cmp.Compare(agent.DRAM(x.Bytes()).Addr, agent.DRAM(y.Bytes()).Addr)
	})
	lo, mid, hi := bufs[0], bufs[1], bufs[2]
	r, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(mid.Bytes())})
	require.NoError(t, err)
	t.Cleanup(r.Revoke)
	w, err := a.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(lo.Bytes()[:4096]), agent.DRAM(hi.Bytes()[:4096])})
	require.NoError(t, err)
	t.Cleanup(w.Revoke)
	write := func(at uint64, n int) *agent.Xfer {
		x, err := c.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: a.Info(), Key: w.Key(), Backend: Name,
			Segments: []agent.Segment{{Local: agent.DRAM(bytes.Repeat([]byte{0xEE}, n)), Remote: agent.Region{Addr: at, Len: uint64(n), Kind: agent.KindDRAM}}}})
		require.NoError(t, err)
		_ = waitX(t, x)
		return x
	}
	require.Eventually(t, func() bool {
		x := write(agent.DRAM(lo.Bytes()).Addr, 16)
		return x.Err() == nil && x.Path() == "cma+shm"
	}, 5*time.Second, 5*time.Millisecond)
	x := write(agent.DRAM(mid.Bytes()).Addr, 4096)
	t.Logf("a WRITE with the key of an exposure of other segments into a read-only exposed one: path %s, err %v", x.Path(), x.Err())
	require.Error(t, x.Err(), "a write key reached a segment its exposure does not lie in")
	require.Equal(t, make([]byte, 4096), mid.Bytes()[:4096])
}
