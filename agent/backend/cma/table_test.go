//go:build linux

package cma

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

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

// BenchmarkTablePost measures one transfer of an exposure on the Go heap
// by cma+table, from Post to Done, in one process (the copier's whole
// cost: lookup, slot, one process_vm_readv/writev call, notification
// queued), beside one raw call of the same bytes (raw).
func BenchmarkTablePost(b *testing.B) {
	for _, size := range []int{4 << 10, 64 << 10, 1 << 20} {
		for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
			b.Run(fmt.Sprintf("%v/%dKiB", op, size>>10), func(b *testing.B) {
				a, _ := newAgent(b)
				c, _ := newAgent(b)
				remote := make([]byte, size)
				e, err := a.Expose(op.Access(), []agent.Local{agent.DRAM(remote)})
				require.NoError(b, err)
				b.Cleanup(e.Revoke)
				local := make([]byte, size)
				req := agent.Request{Op: op, Peer: a.Info(), Key: e.Key(), Backend: Name, Notify: []byte("done"),
					Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: agent.DRAM(remote).Region}}}
				benchPosts(b, c, e, req, Name+"+table", size)
			})
			b.Run(fmt.Sprintf("%v/%dKiB/raw", op, size>>10), func(b *testing.B) {
				remote, local := make([]byte, size), make([]byte, size)
				segs := []agent.Segment{{Local: agent.DRAM(local), Remote: agent.DRAM(remote).Region}}
				v := new(iovecs)
				b.SetBytes(int64(size))
				for b.Loop() {
					require.NoError(b, vmSegments(os.Getpid(), op == agent.OpWrite, segs, v))
				}
			})
		}
	}
}

// A copier whose peer's process is gone: the system call fails with
// ESRCH, and the transfer with ErrRemoteLost, as under a lease. Across
// processes, the conformance suite kills children in the middle of
// transfers.
func TestTableCopyPeerGone(t *testing.T) {
	cmd := exec.Command("true")
	require.NoError(t, cmd.Run())
	dead := cmd.Process.Pid // exited and reaped
	buf := make([]byte, 4096)
	segs := []agent.Segment{{Local: agent.DRAM(buf), Remote: agent.DRAM(buf).Region}}
	err := vmSegments(dead, false, segs, new(iovecs))
	require.ErrorIs(t, err, unix.ESRCH)
	st := &xstate{p: &peer{}, x: &agent.Work{Op: agent.OpRead}}
	require.ErrorIs(t, st.copyError(err), agent.ErrRemoteLost)
}

// More ranges than one system call takes (IOV_MAX) are copied in several.
func TestTableManyRanges(t *testing.T) {
	p := newHeapPair(t, 3000*16, agent.AccessRead)
	pattern.Fill(p.heap, 3, 0, 0)
	base := agent.DRAM(p.heap).Addr
	p.connect(t, agent.OpRead, base)
	dst := make([]byte, len(p.heap))
	var segs []agent.Segment
	for i := 0; i < len(dst); i += 16 {
		segs = append(segs, agent.Segment{Local: agent.DRAM(dst[i : i+16]), Remote: agent.Region{Addr: base + uint64(i), Len: 16, Kind: agent.KindDRAM}})
	}
	x, err := p.c.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: p.a.Info(), Key: p.exp.Key(), Backend: Name, Segments: segs})
	require.NoError(t, err)
	require.NoError(t, waitX(t, x))
	require.Equal(t, Name+"+table", x.Path())
	require.Equal(t, p.heap, dst)
}
