//go:build linux

package cma

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// An honest copier with more transfers in flight than the exposing side's
// per-connection lease limit (maxLeases, 1024) must not be cut off as a
// limit breaker: the docs promise that any number of concurrent transfers
// share one connection. The copying side does not bound its lease requests
// in flight per connection, so the 1025th request arrives while the
// previous 1024 grants are still held (their ends are queued behind the
// requests), and the exposing side drops the connection with errLimit:
// every transfer in flight fails with ErrRemoteLost, and the honest peer
// is counted in LimitRejected.
func TestAttackConcurrentTransfersOverLeaseLimit(t *testing.T) {
	for _, tc := range []struct {
		name string
		n    int // transfers
		size int // bytes each
		opts []Option
	}{
		{"OneChunk", 2 * maxLeases, 4 << 10, nil},                                                       // one lease each
		{"Pipelined", maxLeases, 256 << 10, []Option{WithLeaseSize(64 << 10), WithChunkSize(64 << 10)}}, // two leases each in flight
	} {
		t.Run(tc.name, func(t *testing.T) {
			backendtest.Watchdog(t, 2*time.Minute)
			a, ab := newAgent(t, tc.opts...)
			p, pb := newAgent(t, tc.opts...)
			n, size := tc.n, tc.size
			src, e := exposeRead(t, p, n*size)
			before := pb.Stats()
			dst := make([]byte, len(src))
			// Connect first, so that every transfer shares the one connection.
			require.NoError(t, ab.Reachable(context.Background(), p.Info()))
			xs := readSlices(t, a, p.Info(), e.Key(), dst, agent.DRAM(src).Region, n, size)
			failed, first := waitAll(t, xs, 60*time.Second, "concurrent transfers")
			assert.Zero(t, failed, "%d of %d concurrent transfers failed, first: %v", failed, n, first)
			assert.Equal(t, Stats{}, delta(pb.Stats(), before), "the exposing side counted an honest peer's fault")
		})
	}
}

// A peer declared departed while its probe is in flight: the probe is
// forgotten (PeerDeparted), yet when it then succeeds its connection, reader
// and writer live on, listed nowhere a transfer or a departure finds them,
// until the agent closes. Each departure that meets a probe leaks one
// connection, and every connection counts against the exposing side's
// WithMaxConnsPerProcess.
func TestAttackDepartureDuringProbeLeaksConnection(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	a, ab := newAgent(t, WithTimeout(5*time.Second))
	g := newGatedExposer(t)
	const rounds = 3
	for i := range rounds {
		reached := make(chan error, 1)
		go func() { reached <- ab.Reachable(context.Background(), g.info) }()
		require.Eventually(t, func() bool { return g.accepted.Load() == int64(i+1) }, 5*time.Second, time.Millisecond)
		a.PeerDeparted(g.info.ID, errors.New("registry: entry deleted"))
		g.gate <- struct{}{}
		require.NoError(t, <-reached, "the probe's verdict reaches the caller already waiting")
	}
	// The departed peer's probe connections should be closed: nothing can
	// use them, and the peer was declared gone. Their readers close them
	// after the probes' verdicts, and the fake sees it later still: polled.
	state := func() (listed, live int) {
		ab.mu.Lock()
		defer ab.mu.Unlock()
		return len(ab.peers[g.info.ID]), len(ab.live)
	}
	if !assert.Eventually(t, func() bool { listed, _ := state(); return listed == 0 && g.open.Load() == 0 }, 5*time.Second, time.Millisecond) {
		listed, live := state()
		assert.Zero(t, listed, "departed peer still listed after 5 s")
		assert.Zero(t, g.open.Load(), "connections of probes forgotten by PeerDeparted are still open after 5 s (%d live readers in the backend)", live)
	}
}

// Cancel, PeerDeparted and an exposing side's Revoke race transfers of every
// shape (one chunk on the reader, one lease of several chunks, several
// leases), their last chunk included, again and again: every transfer
// finishes; after Done the local buffer is never written again (a canary
// laid right after Done survives); after Revoke returns, exposed memory is
// never written again.
func TestAttackCancelDepartRevokeRace(t *testing.T) {
	backendtest.Watchdog(t, 3*time.Minute)
	opts := []Option{WithChunkSize(4 << 10), WithLeaseSize(64 << 10), WithWorkers(2), WithTimeout(10 * time.Second)}
	a, _ := newAgent(t, opts...)
	p, _ := newAgent(t, opts...)
	const (
		canary = 0xCC
		fill   = 0x5A
	)
	sizes := []int{4 << 10, 48 << 10, 512 << 10}
	deadline := time.Now().Add(4 * time.Second)
	var wg sync.WaitGroup
	var posted, cancelled, departed, ok atomic.Int64
	errc := make(chan error, 16)
	report := func(err error) {
		select {
		case errc <- err:
		default:
		}
	}
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), uint64(time.Now().UnixNano())))
			for time.Now().Before(deadline) {
				size := sizes[r.IntN(len(sizes))]
				op := agent.OpRead
				if r.IntN(2) == 0 {
					op = agent.OpWrite
				}
				local, exposed := make([]byte, size), make([]byte, size)
				if op == agent.OpRead {
					for i := range exposed {
						exposed[i] = fill
					}
				} else {
					for i := range local {
						local[i] = fill
					}
				}
				e, err := p.Expose(op.Access(), []agent.Local{agent.DRAM(exposed)})
				if err != nil {
					report(err)
					return
				}
				x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: e.Key(),
					Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: agent.DRAM(exposed).Region}}})
				if err != nil {
					e.Revoke()
					continue // a departure may fail the choice
				}
				posted.Add(1)
				spin := r.IntN(20000)
				for i := 0; i < spin && !backendtest.Finished(x); i++ {
				}
				revoked := false
				switch r.IntN(4) {
				case 0:
					x.Cancel(nil)
					cancelled.Add(1)
				case 1:
					a.PeerDeparted(p.ID(), errors.New("registry: late heartbeat"))
					departed.Add(1)
				case 2:
					if op == agent.OpWrite {
						e.Revoke()
						revoked = true
					}
				}
				var snap []byte
				if revoked {
					snap = bytes.Clone(exposed)
				}
				select {
				case <-x.Done():
				case <-time.After(30 * time.Second):
					report(fmt.Errorf("a %v of %d bytes did not finish", op, size))
					return
				}
				if x.Err() == nil {
					ok.Add(1)
				}
				if op == agent.OpRead {
					for i := range local {
						local[i] = canary
					}
				}
				if !revoked {
					e.Revoke()
					snap = bytes.Clone(exposed)
				}
				time.Sleep(time.Duration(r.IntN(200)) * time.Microsecond)
				if op == agent.OpRead && bytes.IndexByte(local, fill) >= 0 {
					report(fmt.Errorf("a READ of %d bytes wrote its local buffer after Done (err %v)", size, x.Err()))
				}
				if op == agent.OpWrite && !bytes.Equal(snap, exposed) {
					report(fmt.Errorf("a WRITE of %d bytes landed in exposed memory after Revoke returned (err %v)", size, x.Err()))
				}
			}
		}()
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Error(err)
	}
	t.Logf("%d posted, %d succeeded, %d cancelled, %d departures", posted.Load(), ok.Load(), cancelled.Load(), departed.Load())
	require.NoError(t, backendtest.CloseWithin(t, a, 20*time.Second, "after the races"))
}

// Agent.Close of the copying side races Cancel, PeerDeparted and transfers
// of every shape, on fresh agents each round: Close returns, every
// transfer finishes, no local buffer is written after Done, and once both
// agents closed no goroutine of theirs is left (guards' callbacks,
// writers, readers, probes, workers).
func TestAttackCloseRaceNoHangNoLeak(t *testing.T) {
	backendtest.Watchdog(t, 3*time.Minute)
	ignore := goleak.IgnoreCurrent()
	r := rand.New(rand.NewPCG(1, uint64(time.Now().UnixNano())))
	for round := range 30 {
		opts := []Option{WithChunkSize(4 << 10), WithLeaseSize(64 << 10), WithWorkers(2)}
		a, err := agent.New(agent.WithBackends(New(opts...)))
		require.NoError(t, err)
		p, err := agent.New(agent.WithBackends(New(opts...)))
		require.NoError(t, err)
		src := bytes.Repeat([]byte{0x5A}, 512<<10)
		e, err := p.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
		require.NoError(t, err)
		var xs []*agent.Xfer
		var locals [][]byte
		for i := range 8 {
			size := []int{4 << 10, 48 << 10, 512 << 10}[i%3]
			dst := make([]byte, size)
			x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: p.Info(), Key: e.Key(),
				Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: agent.DRAM(src).Addr, Len: uint64(size)}}}})
			require.NoError(t, err)
			xs, locals = append(xs, x), append(locals, dst)
		}
		time.Sleep(time.Duration(r.IntN(300)) * time.Microsecond)
		var wg sync.WaitGroup
		wg.Add(3)
		go func() { defer wg.Done(); xs[r.IntN(len(xs))].Cancel(nil) }()
		go func() { defer wg.Done(); a.PeerDeparted(p.ID(), errors.New("gone")) }()
		closed := make(chan error, 1)
		go func() { defer wg.Done(); closed <- a.Close() }()
		select {
		case err := <-closed:
			require.NoError(t, err)
		case <-time.After(20 * time.Second):
			t.Fatalf("round %d: Agent.Close hung", round)
		}
		wg.Wait()
		for i, x := range xs {
			require.True(t, backendtest.Finished(x), "round %d: a transfer outlived Agent.Close", round)
			for j := range locals[i] {
				locals[i][j] = 0xCC
			}
		}
		e.Revoke()
		require.NoError(t, p.Close())
		time.Sleep(time.Millisecond)
		for i := range locals {
			require.Equal(t, -1, bytes.IndexByte(locals[i], 0x5A), "round %d: a local buffer was written after Close returned", round)
		}
	}
	goleak.VerifyNone(t, ignore)
}

// serverConns returns the exposing side's accepted connections.
func serverConns(b *Backend) []*net.UnixConn { return b.conns.Members() }

// The exposing side cuts an honest copier's connection itself (here: a
// frame that stalled, forced with a read deadline) while large chunks of a
// WRITE are being copied under its leases. Revoke must not return before the
// copier's chunks in flight returned: no byte lands after it.
func TestAttackExposerDropMidCopyNoLateWrite(t *testing.T) {
	backendtest.Watchdog(t, 2*time.Minute)
	const size = 96 << 20
	opts := []Option{WithChunkSize(32 << 20), WithLeaseSize(32 << 20), WithWorkers(2)}
	a, _ := newAgent(t, opts...)
	p, pb := newAgent(t, opts...)
	local, exposed := bytes.Repeat([]byte{0xAA}, size), make([]byte, size)
	for round := range 3 {
		clear(exposed)
		e, err := p.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(exposed)})
		require.NoError(t, err)
		before := pb.Stats()
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: p.Info(), Key: e.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: agent.DRAM(exposed).Region}}})
		require.NoError(t, err)
		for atomicLoad(&exposed[0]) != 0xAA && !backendtest.Finished(x) {
		}
		for delta(pb.Stats(), before).Timeouts == 0 && !backendtest.Finished(x) {
			for _, c := range serverConns(pb) {
				_ = c.SetReadDeadline(time.Unix(1, 0))
			}
			time.Sleep(50 * time.Microsecond)
		}
		e.Revoke()
		snap := bytes.Clone(exposed)
		backendtest.DoneWithin(t, x, 20*time.Second, "exposer drop")
		time.Sleep(10 * time.Millisecond)
		require.True(t, bytes.Equal(snap, exposed), "round %d: bytes landed in exposed memory after Revoke returned (transfer: %v)", round, x.Err())
		t.Logf("round %d: transfer %v", round, x.Err())
	}
}

// A hostile copier that holds a lease, gets dropped, and then keeps its end
// open while writing as fast as it can: the exposing side's wait for its
// close is bounded by WithTimeout all the same (the deadline is absolute),
// so Revoke returns.
func TestAttackDroppedCopierFloodsRevokeBounded(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	const timeout = 300 * time.Millisecond
	_, exp, p, _ := holdLease(t, WithTimeout(timeout))
	p.send(header{typ: 42}, nil, nil) // dropped for this
	stop := make(chan struct{})
	flooded := make(chan struct{})
	go func() {
		defer close(flooded)
		p.spam(make([]byte, 64<<10), 100*time.Millisecond, stop)
	}()
	defer func() { close(stop); <-flooded }()
	start := time.Now()
	revoked := make(chan struct{})
	go func() { exp.Revoke(); close(revoked) }()
	select {
	case <-revoked:
		assert.GreaterOrEqual(t, time.Since(start), timeout/3, "Revoke returned before the dropped copier could have stopped")
	case <-time.After(10 * timeout):
		t.Fatal("a dropped copier that floods its end keeps Revoke waiting past the timeout")
	}
}

// Callers of Reachable with contexts of every length wait on one probe of a
// silent peer: each returns by its own deadline, and Close, long before the
// probe's timeout, ends the probe and every caller still waiting.
func TestAttackProbeManyContextsThenClose(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	a, ab := newAgent(t, WithTimeout(time.Minute))
	s := newSilentPeer(t)
	type res struct {
		d   time.Duration // 0: no deadline
		err error
		at  time.Duration
	}
	out := make(chan res, 32)
	start := time.Now()
	for i := range 24 {
		d := time.Duration(0)
		if i%3 != 0 {
			d = time.Duration(20+i*15) * time.Millisecond
		}
		go func() {
			ctx := context.Background()
			if d > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, d)
				defer cancel()
			}
			err := ab.Reachable(ctx, s.info)
			out <- res{d, err, time.Since(start)}
		}()
	}
	var rs []res
	for range 16 { // the callers with deadlines
		r := <-out
		require.NotZero(t, r.d, "a caller without a deadline returned before Close: %v", r.err)
		require.ErrorIs(t, r.err, context.DeadlineExceeded)
		assert.Less(t, r.at, r.d+250*time.Millisecond, "a caller returned long after its deadline")
		rs = append(rs, r)
	}
	closeStart := time.Now()
	require.NoError(t, a.Close())
	assert.Less(t, time.Since(closeStart), 2*time.Second, "Close waited for the probe's timeout")
	for range 8 {
		select {
		case r := <-out:
			require.Zero(t, r.d)
			require.Error(t, r.err)
		case <-time.After(5 * time.Second):
			t.Fatal("a caller waiting on the probe did not return after Close")
		}
	}
}

// Under Yama mode 1: a key of a revoked exposure names nobody; the
// exception is withdrawn when the named connection is dropped for a
// protocol error, and with two named connections of one process it stays
// until both are gone.
func TestAttackYamaExceptionLifecycle(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	y := newFakeYama()
	a, b := yamaAgent(t, y)
	src := make([]byte, 4096)
	old, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	old.Revoke()
	p := dialRaw(t, b)
	in, err := p.helloWithKey(old.Key(), agent.AccessRead, a)
	require.NoError(t, err)
	assert.Equal(t, uint8(ptrRefused), in.ptracer, "a revoked exposure's key")
	assert.Empty(t, y.changes())

	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	defer exp.Revoke()
	p1, p2 := dialRaw(t, b), dialRaw(t, b)
	for _, q := range []*rawPeer{p1, p2} {
		in, err := q.helloWithKey(exp.Key(), agent.AccessRead, a)
		require.NoError(t, err)
		require.Equal(t, uint8(ptrNamed), in.ptracer)
	}
	assert.Equal(t, uintptr(os.Getpid()), y.current())
	p1.send(header{typ: 42}, nil, nil) // dropped for a protocol error
	_, err = p1.br.ReadByte()
	require.Error(t, err)
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, uintptr(os.Getpid()), y.current(), "withdrawn while another named connection of the process lives")
	_ = p2.c.Close()
	require.Eventually(t, func() bool { return y.current() == 0 }, 5*time.Second, time.Millisecond, "the exception outlived every named connection")
	assert.NotContains(t, y.changes(), ptracerAnyValue)
}

// A hostile exposing side answers every lease request twice, after a
// random delay, while the copier cancels some transfers: the second answer
// is a protocol error that drops the connection; every transfer finishes
// promptly, and none writes its local buffer after Done.
func TestAttackDoubleGrantsWithCancel(t *testing.T) {
	backendtest.Watchdog(t, 2*time.Minute)
	src := bytes.Repeat([]byte{0x5A}, 256<<10) // the fake exposer's memory: this process's
	f := newFakeExposer(t, func(c *net.UnixConn, br *bufio.Reader) {
		var mu sync.Mutex
		readFrames(c, br, func(f *frame) {
			if f.typ != tBegin {
				return
			}
			id := f.id
			go func() {
				time.Sleep(time.Duration(rand.IntN(300)) * time.Microsecond)
				b := make([]byte, hdrSize)
				(&header{typ: tGrant, status: stOK, id: id}).put(b)
				mu.Lock()
				defer mu.Unlock()
				_, _ = c.Write(b)
				_, _ = c.Write(b)
			}()
		})
	})
	a, ab := newAgent(t, WithTimeout(5*time.Second), WithChunkSize(4<<10), WithLeaseSize(64<<10))
	before := ab.Stats()
	for round := range 200 {
		size := []int{4 << 10, 48 << 10, 256 << 10}[round%3]
		dst := make([]byte, size)
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: f.info, Key: agent.NewKey(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src[:size]).Region}}})
		if err != nil {
			continue
		}
		if round%2 == 0 {
			time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
			x.Cancel(nil)
		}
		backendtest.DoneWithin(t, x, 10*time.Second, "double grants")
		if x.Err() != nil && !errors.Is(x.Err(), agent.ErrCancelled) {
			require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
		}
		for i := range dst {
			dst[i] = 0xCC
		}
		time.Sleep(300 * time.Microsecond)
		require.Equal(t, -1, bytes.IndexByte(dst, 0x5A), "round %d: bytes copied after the transfer finished (%v)", round, x.Err())
	}
	t.Logf("counted: %+v", delta(ab.Stats(), before))
}

// A peer whose process stalls (here: a fake exposing side that stops
// reading after the handshake, as a SIGSTOPped one would): notifications
// are queued for the writer without bound until the write times out, so a
// sender in a loop grows the copying process's memory by its rate times
// WithTimeout, with every Notify reporting success. Before the writer queue
// a Notify waited for the socket.
func TestAttackNotifyQueueUnbounded(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	f := newFakeExposer(t, func(c *net.UnixConn, br *bufio.Reader) {}) // never reads again
	_, ab := newAgent(t, WithTimeout(3*time.Second))
	msg := make([]byte, 64<<10)
	key := agent.NewKey()
	// As the agent does before every Notify: choose the backend, connecting.
	require.NoError(t, ab.Reachable(context.Background(), f.info))
	require.NoError(t, ab.Notify(context.Background(), f.info, key, msg))
	ab.mu.Lock()
	p := ab.peers[f.info.ID][0]
	ab.mu.Unlock()
	const limit = 256 << 20 // stop before the machine suffers
	var sent, accepted int
	maxQueued := 0
	start := time.Now()
	for time.Since(start) < 2*time.Second && maxQueued < limit {
		sent++
		if ab.Notify(context.Background(), f.info, key, msg) == nil {
			accepted++
		}
		p.qmu.Lock()
		maxQueued = max(maxQueued, len(p.q))
		p.qmu.Unlock()
	}
	t.Logf("%d notifications of 64 KiB sent in %v to a peer that reads nothing, %d reported sent; up to %d MiB queued",
		sent, time.Since(start).Round(time.Millisecond), accepted, maxQueued>>20)
	assert.Less(t, maxQueued, 16<<20, "the writer's queue grows without bound while the peer reads nothing")
}

// A Notify waiting for room in the queue of a peer that reads nothing
// returns once its context is done, with the context's cause, not after
// WithTimeout; the peer stays connected.
func TestNotifyWaitEndsWithContext(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	f := newFakeExposer(t, func(c *net.UnixConn, br *bufio.Reader) {}) // never reads again
	_, ab := newAgent(t, WithTimeout(time.Minute))
	msg := make([]byte, 64<<10)
	key := agent.NewKey()
	require.NoError(t, ab.Reachable(context.Background(), f.info))
	ab.mu.Lock()
	p := ab.peers[f.info.ID][0]
	ab.mu.Unlock()
	full := func() bool {
		p.qmu.Lock()
		defer p.qmu.Unlock()
		return p.qnote+len(msg) > maxQueuedNotify
	}
	for !full() {
		require.NoError(t, ab.Notify(context.Background(), f.info, key, msg))
	}
	cause := errors.New("the caller gave up")
	for _, stop := range []struct {
		name string
		ctx  func() (context.Context, context.CancelFunc)
	}{
		{"deadline", func() (context.Context, context.CancelFunc) {
			return context.WithTimeoutCause(context.Background(), 100*time.Millisecond, cause)
		}},
		{"cancel", func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancelCause(context.Background())
			stop := time.AfterFunc(100*time.Millisecond, func() { cancel(cause) })
			return ctx, func() { stop.Stop(); cancel(nil) }
		}},
	} {
		ctx, cancel := stop.ctx()
		start := time.Now()
		err := ab.Notify(ctx, f.info, key, msg)
		cancel()
		require.ErrorIs(t, err, cause, stop.name)
		assert.Less(t, time.Since(start), 10*time.Second, "%s: Notify waited for the timeout", stop.name)
		assert.False(t, p.broken.Load(), "%s: the peer failed", stop.name)
	}
}
