//go:build linux

package cma

// Findings of the shared-memory attack review (issue 17) that failed
// before their fixes: a sparse pool committed in the copier's memory by
// MAP_POPULATE, and a stranger stalling revocations with counts in its own
// lease table.

import (
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/shm"
)

// rssShmem returns this process's resident shared memory (RssShmem), in
// bytes.
func rssShmem(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	require.NoError(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) == 3 && f[0] == "RssShmem:" {
			n, err := strconv.ParseInt(f[1], 10, 64)
			require.NoError(t, err)
			return n << 10
		}
	}
	t.Fatal("no RssShmem")
	return 0
}

// A pool from AllocHost is zeroed and costs no memory until it is used
// (a memfd's pages are made on first touch). Exposing 4 KiB of a large
// pool to a same-host peer must not make the peer commit the whole pool:
// the copier maps every segment with MAP_POPULATE, which read-faults every
// page of the memory file, and a shmem read fault allocates the page. A
// 256 MiB pool of which 4 KiB is exposed becomes 256 MiB resident, and
// the copier's reader goroutine is blocked in mmap meanwhile (0.7 s a GiB
// here). A peer exposing a sparse pool of 1 TiB (shm.MaxSize; or a
// hostile exposer claiming so in a tSeg) makes the copier commit it all.
func TestShmAttackSparsePoolCommitted(t *testing.T) {
	const size = 256 << 20
	a, _ := newAgent(t)
	c, _ := newAgent(t)
	buf, err := shm.Alloc(size)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, buf.Free()) })
	e, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(buf.Bytes()[:4096])})
	require.NoError(t, err)
	t.Cleanup(e.Revoke)
	before := rssShmem(t)
	base := agent.DRAM(buf.Bytes()).Addr
	start := time.Now()
	require.Eventually(t, func() bool {
		x, err := c.Post(t.Context(), agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: e.Key(), Backend: Name,
			Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 16)), Remote: agent.Region{Addr: base, Len: 16, Kind: agent.KindDRAM}}}})
		require.NoError(t, err)
		return waitX(t, x) == nil && x.Path() == "cma+shm"
	}, 10*time.Second, 5*time.Millisecond)
	grew := rssShmem(t) - before
	t.Logf("first transfer through the mapping after %v; resident shared memory grew by %d MiB", time.Since(start), grew>>20)
	require.Less(t, grew, int64(32<<20), "the copier committed the whole sparse pool: it exposed 4 KiB of %d MiB", size>>20)
}

// Every exposure of shared memory is published on every connection that
// agreed shared memory, whether its copier holds the key or not. A
// stranger (a same-user process that speaks the protocol and holds the
// key of one exposure of its own, enough to pass the handshake under
// Yama) writes a nonzero count of copies inside into every slot of its
// own lease table: it must not make the Revoke of an exposure it never
// held the key of wait for it (docs/shm.md: "A peer cannot make another
// peer's revocation wait"). An honest copier writes the key's proof into
// the slot before it enters: a count without a proof is no honest copy.
//
// Exposures of the Go heap are published in the same tables (cma+table):
// the same holds for them.
func TestShmAttackStrangerStallsRevoke(t *testing.T) {
	for _, kind := range pairKinds {
		t.Run(kind.name, func(t *testing.T) { testStrangerStallsRevoke(t, kind.new) })
	}
}

func testStrangerStallsRevoke(t *testing.T, newPair func(*testing.T, int, agent.Access, ...Option) *shmPair) {
	const timeout = time.Second
	// p: the exposing agent, an honest copier and the exposure it uses.
	p := newPair(t, 64<<10, agent.AccessRead, WithTimeout(timeout))
	base := agent.DRAM(p.bytes()).Addr
	require.Eventually(t, func() bool {
		x := p.post(t, agent.OpRead, make([]byte, 16), base, nil)
		return waitX(t, x) == nil && x.Path() == p.path()
	}, 5*time.Second, 5*time.Millisecond)

	// The stranger: its own agent, holding the key of another exposure.
	st, bst := newAgent(t)
	umem := make([]byte, 64)
	u, err := p.a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(umem)})
	require.NoError(t, err)
	t.Cleanup(u.Revoke)
	post := func() error {
		x, err := st.Post(t.Context(), agent.Request{Op: agent.OpRead, Peer: p.a.Info(), Key: u.Key(), Backend: Name,
			Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 64)), Remote: agent.DRAM(umem).Region}}})
		require.NoError(t, err)
		return waitX(t, x)
	}
	require.NoError(t, post())
	var sp *shmPeer
	require.Eventually(t, func() bool {
		bst.mu.Lock()
		ps := bst.peers[p.a.ID()]
		bst.mu.Unlock()
		if len(ps) != 1 {
			return false
		}
		ps[0].sh.mu.Lock()
		defer ps[0].sh.mu.Unlock()
		sp = &ps[0].sh
		return sp.table != nil
	}, 5*time.Second, 5*time.Millisecond, "the stranger has no lease table")
	sp.mu.Lock()
	tbl := sp.table.mem
	for i := range sp.slots {
		atomic.StoreUint32(slotAt(tbl, i).readers, 1)
	}
	sp.mu.Unlock()

	start := time.Now()
	p.exp.Revoke()
	took := time.Since(start)
	t.Logf("Revoke of the honest pair's exposure took %v with the stranger connected", took)
	require.Less(t, took, timeout/2, "a stranger that never held the key made the exposure's Revoke wait for it")
}
