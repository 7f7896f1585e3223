//go:build linux

package cma

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/shm"
	"github.com/goxfer/goxfer/internal/pattern"
)

// shmPair is two agents in this process, each with one cma backend (b is
// the copier's), and a shared buffer of size bytes exposed by a for acc.
type shmPair struct {
	a, c   *agent.Agent // exposing, copying
	ba, bc *Backend
	buf    *shm.Buffer
	exp    *agent.Exposure
}

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
		require.NoError(t, waitX(t, w.post(t, agent.OpWrite, src, agent.DRAM(w.buf.Bytes()).Addr, nil)))
		require.Equal(t, src, w.buf.Bytes())
		// The second transfer needs no mapping request: same slot.
		require.NoError(t, waitX(t, w.post(t, agent.OpWrite, src[:10], agent.DRAM(w.buf.Bytes()).Addr+5, nil)))
	}
}
