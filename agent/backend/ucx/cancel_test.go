//go:build ucx

package ucx

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
	"github.com/goxfer/goxfer/agent/devmem"
)

// waitDone waits up to d for x to finish and returns how long it took.
func waitDone(t *testing.T, x *agent.Xfer, d time.Duration, what string) time.Duration {
	t.Helper()
	start := time.Now()
	select {
	case <-x.Done():
		return time.Since(start)
	case <-time.After(d):
		t.Fatalf("%s: still running after %v", what, d)
		return 0
	}
}

// A cancelled WRITE whose lease request the peer answers late: the
// transfer ends at the cancel, without the grant; the grant, when it
// comes, is no protocol error, moves no byte, and its lease is released
// (the exposure's revocation, which waits for leases, is not held up).
func TestCancelledRequestLateGrantReleased(t *testing.T) {
	const size = 1 << 20
	pb := New(WithTimeout(time.Minute))
	p := backendtest.NewAgent(t, pb)
	// Closed first, also on failure: a lease the exposing side still holds
	// is released when the connection goes, not held up its Close.
	a, ua := newUCXAgent(t, WithTimeout(time.Minute))
	dst := make([]byte, size)
	exp, err := p.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(dst)})
	require.NoError(t, err)
	src := bytes.Repeat([]byte{0x5A}, size)
	post := func() *agent.Xfer {
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: p.Info(), Key: exp.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(src), Remote: agent.DRAM(dst).Region}}})
		require.NoError(t, err)
		return x
	}
	require.NoError(t, backendtestWait(t, post()), "a first WRITE connects")
	clear(dst)

	// Freeze the exposing side's progress thread: the request waits.
	// (Thawed when the test ends, also on failure: its Close waits.)
	thaw := make(chan struct{})
	var once sync.Once
	thawNow := func() { once.Do(func() { close(thaw) }) }
	t.Cleanup(thawNow)
	frozen := make(chan struct{})
	require.NoError(t, pb.submit(command{run: func(*loop) { close(frozen); <-thaw }}))
	<-frozen
	before := ua.Stats()
	x := post()
	time.Sleep(50 * time.Millisecond) // the request is out
	x.Cancel(errors.New("caller gave up"))
	took := waitDone(t, x, 2*time.Second, "a WRITE cancelled while its lease request is unanswered")
	require.ErrorIs(t, x.Err(), agent.ErrCancelled)
	t.Logf("cancelled WRITE ended %v after the cancel", took)
	thawNow()

	// The late grant comes and is dropped, and its lease released.
	require.Eventually(t, func() bool {
		left := 0
		onLoop(t, ua, func(l *loop) {
			for _, q := range l.outs[p.ID()] {
				left += len(q.abandoned) + len(q.wins)
			}
		})
		return left == 0
	}, 5*time.Second, 10*time.Millisecond, "the late answer to the cancelled request never came")
	require.Zero(t, since(ua.Stats(), before).ProtocolErrors, "the late grant counted as a protocol error")
	require.Eventually(t, func() bool {
		var n int
		onLoop(t, pb, func(l *loop) { n = l.leases })
		return n == 0
	}, 5*time.Second, 10*time.Millisecond, "the exposing side still holds the late-granted lease")
	require.Equal(t, make([]byte, size), dst, "a cancelled WRITE moved bytes after its late grant")

	revoked := make(chan struct{})
	go func() { exp.Revoke(); close(revoked) }()
	select {
	case <-revoked:
	case <-time.After(5 * time.Second):
		t.Error("revocation waits for the lease of a cancelled transfer")
	}
}

// backendtestWait waits for x (at most 10 s) and returns its error.
func backendtestWait(t *testing.T, x *agent.Xfer) error {
	t.Helper()
	waitDone(t, x, 10*time.Second, "transfer")
	return x.Err()
}

// A cancelled READ that the exposing side is to push into this side's
// memory, to a frozen peer: the request cannot simply be abandoned (the
// peer holds keys to the memory and may write when it thaws), so after
// the grace the connection is dropped and the transfer ends once its
// endpoint is closed, promptly rather than at WithTimeout.
func TestCancelledPushedReadAgainstFrozenPeer(t *testing.T) {
	peer, host := backendtest.StartStuck(t, New(WithTimeout(time.Minute)))
	ub := New(WithTimeout(time.Minute))
	a := backendtest.NewAgent(t, ub)
	dst := make([]byte, 1<<20)
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: peer, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: uint64(len(dst))}}}})
	require.NoError(t, err)
	time.Sleep(200 * time.Millisecond) // the peer is frozen in Open
	x.Cancel(errors.New("caller gave up"))
	took := waitDone(t, x, 5*time.Second, "a cancelled READ pushed by a frozen peer")
	require.ErrorIs(t, x.Err(), agent.ErrCancelled)
	grace := ub.cfg.cancelGrace()
	require.GreaterOrEqual(t, took, grace/2, "ended before its grace: the connection cannot have been dropped")
	t.Logf("cancelled READ ended %v after the cancel (grace %v)", took, grace)
	var outs int
	onLoop(t, ub, func(l *loop) { outs = len(l.outs[peer.ID]) + len(l.dying) })
	require.Zero(t, outs, "the connection the peer could still write through is not closed")
	host.Thaw()
}

// A peer asks this side, whose UCX has no CUDA, for GPU memory it
// exposes: the request is refused cleanly (no mapping, no byte), both for
// a READ and a WRITE. The asking side is made to believe its UCX reaches
// GPU memory, which is how a peer with a CUDA-enabled UCX asks.
func TestVRAMRefusedWithoutCUDA(t *testing.T) {
	sim := devmem.NewSim(1)
	pb := New()
	p, err := agent.New(agent.WithBackends(pb), agent.WithDevice(sim))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	if pb.cuda {
		t.Skip("this UCX reaches CUDA memory")
	}
	require.False(t, pb.Supports(agent.KindVRAM))
	const size = 1 << 20
	ptr, err := sim.Alloc(0, size)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sim.Free(ptr) })
	vram := agent.Device(ptr, size, agent.KindVRAM, 0)

	// Registering device memory without CUDA is harmless: nothing mapped.
	h, err := pb.RegisterMem(vram)
	require.NoError(t, err)
	require.Nil(t, h)
	require.NoError(t, pb.DeregisterMem(h))
	reg, err := p.Register(vram)
	require.NoError(t, err)
	defer reg.Release()
	pb.regMu.RLock()
	nregs := len(pb.regs)
	pb.regMu.RUnlock()
	require.Zero(t, nregs, "GPU memory mapped by a UCX without CUDA")

	ab := New()
	a := backendtest.NewAgent(t, ab)
	ab.cuda = true // as a CUDA-enabled UCX would report; set before any transfer
	for _, acc := range []agent.Access{agent.AccessRead, agent.AccessWrite} {
		exp, err := p.Expose(acc, []agent.Local{vram})
		require.NoError(t, err)
		op := agent.OpRead
		if acc == agent.AccessWrite {
			op = agent.OpWrite
		}
		before := pb.Stats()
		local := make([]byte, size)
		x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: exp.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: vram.Region}}})
		require.NoError(t, err)
		require.ErrorIs(t, backendtestWait(t, x), agent.ErrAccessDenied, "%v of GPU memory this UCX cannot reach", op)
		require.ErrorContains(t, x.Err(), "is GPU memory, which this side's UCX cannot reach")
		require.Equal(t, uint64(1), since(pb.Stats(), before).Denied)
		exp.Revoke()
	}
}
