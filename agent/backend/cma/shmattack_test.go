//go:build linux

package cma

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
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
type slotReuse struct {
	p    *shmPair
	pc   *peer
	base uint64
	slot int
	w    slotWords
	want uint64
	keyA agent.Key
}

func newSlotReuse(t *testing.T, timeout time.Duration) *slotReuse {
	t.Helper()
	// p.exp (the whole buffer) stays exposed: the segment stays mapped,
	// so the exposures below cost no segment frames.
	p := newShmPair(t, 64<<10, agent.AccessRead, WithTimeout(timeout))
	r := &slotReuse{p: p, base: agent.DRAM(p.buf.Bytes()).Addr}
	require.NoError(t, waitX(t, p.post(t, agent.OpRead, make([]byte, 16), r.base, nil)))
	require.Eventually(t, func() bool {
		x := p.post(t, agent.OpRead, make([]byte, 16), r.base, nil)
		return waitX(t, x) == nil && x.Path() == "cma+shm"
	}, 5*time.Second, 5*time.Millisecond)
	a, err := p.a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(p.buf.Bytes()[:4096])})
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
	for range 1 << 16 {
		e, err := r.p.a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(r.p.buf.Bytes()[8192:12288])})
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
	const timeout = time.Second
	for trial := range 10 {
		r := newSlotReuse(t, timeout)
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
	for trial := range 10 {
		r := newSlotReuse(t, time.Second)
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
