//go:build linux

package cma

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/pattern"
)

// The lease-free path for ordinary host memory ("cma+table"): exposures
// of the Go heap published in the lease table, copied with cross-memory
// attach inside their slot. The revocation tests of shm_test.go run over
// both kinds of memory (pairKinds).

// newHeapPair is newShmPair over size bytes of the Go heap.
func newHeapPair(t *testing.T, size int, acc agent.Access, opts ...Option) *shmPair {
	t.Helper()
	p := &shmPair{heap: make([]byte, size)}
	p.a, p.ba = newAgent(t, opts...)
	p.c, p.bc = newAgent(t, opts...)
	var err error
	p.exp, err = p.a.Expose(acc, []agent.Local{agent.DRAM(p.heap)})
	require.NoError(t, err)
	t.Cleanup(p.exp.Revoke)
	return p
}

// connect makes p's connection with a one-byte transfer at remote, and
// gives its lease table a moment to arrive.
func (p *shmPair) connect(t *testing.T, op agent.Op, remote uint64) {
	t.Helper()
	var b [1]byte
	require.NoError(t, waitX(t, p.post(t, op, b[:], remote, nil)))
	time.Sleep(10 * time.Millisecond)
}

// Transfers of up to 1 MiB of an exposure on the Go heap skip leases;
// larger ones use them. Notifications arrive either way.
func TestTableReadWrite(t *testing.T) {
	for _, size := range []int{1, 4 << 10, 64 << 10, shmInline, shmInline + 1} {
		want := Name + "+table"
		if size > shmInline {
			want = Name
		}
		p := newHeapPair(t, size+8192, agent.AccessRead)
		base := agent.DRAM(p.heap).Addr
		pattern.Fill(p.heap, 7, 0, 0)
		p.connect(t, agent.OpRead, base)
		dst := make([]byte, size)
		x := p.post(t, agent.OpRead, dst, base+100, []byte("done"))
		require.NoError(t, waitX(t, x))
		require.Equal(t, want, x.Path(), "READ of %d bytes", size)
		require.Equal(t, p.heap[100:100+size], dst)
		ev := <-p.exp.Events()
		require.Equal(t, agent.EventNotify, ev.Kind)
		require.Equal(t, "done", string(ev.Msg))
		// Past the exposure's end: refused, as by a lease.
		x = p.post(t, agent.OpRead, make([]byte, 16), base+uint64(len(p.heap))-8, nil)
		require.ErrorIs(t, waitX(t, x), agent.ErrAccessDenied)

		w := newHeapPair(t, size, agent.AccessWrite)
		wbase := agent.DRAM(w.heap).Addr
		w.connect(t, agent.OpWrite, wbase)
		src := make([]byte, size)
		pattern.Fill(src, 9, 0, 0)
		x = w.post(t, agent.OpWrite, src, wbase, nil)
		require.NoError(t, waitX(t, x))
		require.Equal(t, want, x.Path(), "WRITE of %d bytes", size)
		require.Equal(t, src, w.heap)
		// The wrong access: refused.
		x = w.post(t, agent.OpRead, make([]byte, 16), wbase, nil)
		require.ErrorIs(t, waitX(t, x), agent.ErrAccessDenied)
	}
}

// An exposure of several regions, even touching, goes to leases: a range
// across two of them is refused there, and the table's span could not say
// so.
func TestTableSeveralRegions(t *testing.T) {
	a, _ := newAgent(t)
	c, _ := newAgent(t)
	mem := make([]byte, 3*4096)
	pattern.Fill(mem, 5, 0, 0)
	e, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(mem[:4096]), agent.DRAM(mem[4096 : 2*4096]), agent.DRAM(mem[2*4096:])})
	require.NoError(t, err)
	t.Cleanup(e.Revoke)
	p := &shmPair{a: a, c: c, heap: mem, exp: e}
	base := agent.DRAM(mem).Addr
	p.connect(t, agent.OpRead, base)
	dst := make([]byte, 4096)
	x := p.post(t, agent.OpRead, dst, base+4096, nil)
	require.NoError(t, waitX(t, x))
	require.Equal(t, Name, x.Path())
	require.Equal(t, mem[4096:2*4096], dst)
	x = p.post(t, agent.OpRead, dst, base+2048, nil)
	require.ErrorIs(t, waitX(t, x), agent.ErrAccessDenied, "a range across two regions")
}

// Off on either side (WithLeaseFree(false), or WithSharedMemory(false),
// whose lease table it uses), heap memory goes through leases.
func TestTableOff(t *testing.T) {
	for _, opt := range []struct {
		name string
		o    Option
	}{{"lease-free", WithLeaseFree(false)}, {"shared memory", WithSharedMemory(false)}} {
		for _, side := range []string{"exposing", "copying"} {
			p := &shmPair{heap: make([]byte, 4096)}
			if side == "exposing" {
				p.a, p.ba = newAgent(t, opt.o)
				p.c, p.bc = newAgent(t)
			} else {
				p.a, p.ba = newAgent(t)
				p.c, p.bc = newAgent(t, opt.o)
			}
			var err error
			p.exp, err = p.a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(p.heap)})
			require.NoError(t, err)
			base := agent.DRAM(p.heap).Addr
			p.connect(t, agent.OpRead, base)
			x := p.post(t, agent.OpRead, make([]byte, 64), base, nil)
			require.NoError(t, waitX(t, x))
			require.Equal(t, Name, x.Path(), "%s off on the %s side", opt.name, side)
			p.exp.Revoke()
		}
	}
}
