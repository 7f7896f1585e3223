package agent_test

// Attack tests on GPU memory staging (issue 14): the active side's
// pipelined staged transfer, peers' staged leases, over a controllable
// backend, mem and tcp, against the simulated device. Tests that expose a
// defect are skipped unless ATTACK14=1; the others are promises that hold.
// Lease-level tests are in attack14_internal_test.go.

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/devmem"
)

// ctlBackend holds every part posted to it until the test finishes it or
// it is cancelled, so that tests decide when each chunk's backend is done.
type ctlBackend struct {
	posted chan *ctlPart
}

type ctlPart struct {
	w      *agent.Work
	finish chan error
	ended  chan struct{}
}

func newCtl() *ctlBackend { return &ctlBackend{posted: make(chan *ctlPart, 1024)} }

func (b *ctlBackend) Name() string                                                { return "ctl" }
func (b *ctlBackend) Start(agent.Host) ([]byte, error)                            { return []byte("ctl"), nil }
func (b *ctlBackend) Supports(k agent.MemKind) bool                               { return k == agent.KindDRAM }
func (b *ctlBackend) Reachable(context.Context, agent.Info) error                 { return nil }
func (b *ctlBackend) Close() error                                                { return nil }
func (b *ctlBackend) Notify(context.Context, agent.Info, agent.Key, []byte) error { return nil }
func (b *ctlBackend) Post(w *agent.Work) error {
	p := &ctlPart{w: w, finish: make(chan error, 1), ended: make(chan struct{})}
	go func() {
		defer close(p.ended)
		select {
		case err := <-p.finish:
			w.Finish(err)
		case <-w.Cancelled():
			w.Finish(w.CancelErr())
		}
	}()
	b.posted <- p
	return nil
}

func ctlPeer() agent.Info {
	return agent.Info{ID: uuid.New(), Conns: []agent.ConnInfo{{Backend: "ctl"}}}
}

// vram allocates n bytes on GPU dev of sim, filled with fill (zeros if nil).
func vram(t *testing.T, sim *devmem.Sim, dev, n int, fill []byte) agent.Local {
	t.Helper()
	p, err := sim.Alloc(dev, n)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sim.Free(p) })
	if fill == nil {
		fill = make([]byte, n)
	}
	require.NoError(t, devmem.CopyToDevice(sim, dev, p, fill[:n]))
	return agent.Device(p, n, agent.KindVRAM, uint32(dev))
}

func readVRAM(t *testing.T, sim *devmem.Sim, l agent.Local) []byte {
	t.Helper()
	out := make([]byte, l.Len)
	require.NoError(t, devmem.CopyToHost(sim, int(l.Device), out, uintptr(l.Addr)))
	return out
}

func randBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return b
}

func newStagingAgent(t *testing.T, dev devmem.Driver, chunk, pool int, bs ...agent.Backend) *agent.Agent {
	t.Helper()
	a, err := agent.New(agent.WithBackends(bs...), agent.WithDevice(dev), agent.WithStaging(chunk, pool))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, a.Close()) })
	return a
}

func requireNoStaging(t *testing.T, as ...*agent.Agent) {
	t.Helper()
	for _, a := range as {
		st := a.Stats()
		assert.Zero(t, st.StagingBuffers, "staging buffers in use")
		assert.Zero(t, st.InFlight, "transfers in flight")
	}
}

// postCtl posts op of local over ctl, against an arbitrary remote region.
func postCtl(t *testing.T, a *agent.Agent, op agent.Op, peer agent.Info, local agent.Local, notify []byte) *agent.Xfer {
	t.Helper()
	x, err := a.Post(context.Background(), agent.Request{
		Op: op, Peer: peer, Key: agent.NewKey(), Notify: notify,
		Segments: []agent.Segment{{Local: local, Remote: agent.Region{Addr: 0x100000, Len: local.Len}}},
	})
	require.NoError(t, err)
	return x
}

func isDone(x *agent.Xfer) bool {
	select {
	case <-x.Done():
		return true
	default:
		return false
	}
}

// TestAttack14CancelWhileWaitingForAPoolBuffer: a transfer whose chunk
// waits for a staging buffer that another transfer holds ends at once on
// Cancel, with ErrCancelled, without waiting for the other transfer.
func TestAttack14CancelWhileWaitingForAPoolBuffer(t *testing.T) {
	sim := devmem.NewSim(1)
	ctl := newCtl()
	a := newStagingAgent(t, sim, 64<<10, 128<<10, ctl) // one chunk's buffer for transfers
	peer := ctlPeer()
	holder := postCtl(t, a, agent.OpWrite, peer, vram(t, sim, 0, 64<<10, nil), nil)
	held := <-ctl.posted // holder's chunk holds the only buffer
	waiter := postCtl(t, a, agent.OpWrite, peer, vram(t, sim, 0, 64<<10, nil), nil)
	waiter.Cancel(errors.New("caller gave up"))
	<-waiter.Done()
	require.ErrorIs(t, waiter.Err(), agent.ErrCancelled)
	assert.False(t, isDone(holder), "the other transfer was disturbed")
	select {
	case p := <-ctl.posted:
		t.Fatalf("a cancelled transfer posted a chunk: %v", p.w.Segments)
	default:
	}
	held.finish <- nil
	<-holder.Done()
	require.NoError(t, holder.Err())
	requireNoStaging(t, a)
}

// TestAttack14CloseWhileWaitingForAPoolBuffer: Close with one transfer's
// chunk held by the backend and another's waiting for a buffer cancels
// both, returns, and leaves no staging buffer in use or pinned memory held.
func TestAttack14CloseWhileWaitingForAPoolBuffer(t *testing.T) {
	sim := devmem.NewSim(1)
	ctl := newCtl()
	a, err := agent.New(agent.WithBackends(ctl), agent.WithDevice(sim), agent.WithStaging(64<<10, 128<<10))
	require.NoError(t, err)
	peer := ctlPeer()
	x1 := postCtl(t, a, agent.OpRead, peer, vram(t, sim, 0, 64<<10, nil), nil)
	p1 := <-ctl.posted
	x2 := postCtl(t, a, agent.OpWrite, peer, vram(t, sim, 0, 64<<10, nil), nil)
	require.NoError(t, a.Close())
	for _, x := range []*agent.Xfer{x1, x2} {
		require.True(t, isDone(x), "Close returned before a transfer was done")
		require.ErrorIs(t, x.Err(), agent.ErrClosed)
	}
	<-p1.ended
	st := a.Stats()
	assert.Zero(t, st.StagingBuffers)
	assert.Zero(t, st.StagingBytes, "pinned memory held after Close")
}

// TestAttack14PeerDepartedMidStaging: PeerDeparted aborts a staged
// transfer with parts in flight with ErrRemoteLost (not ErrCancelled) and
// every staging buffer comes back.
func TestAttack14PeerDepartedMidStaging(t *testing.T) {
	sim := devmem.NewSim(1)
	ctl := newCtl()
	a := newStagingAgent(t, sim, 64<<10, 1<<20, ctl)
	peer := ctlPeer()
	x := postCtl(t, a, agent.OpRead, peer, vram(t, sim, 0, 1<<20, nil), []byte("n"))
	for range 4 { // four chunks in flight
		<-ctl.posted
	}
	a.PeerDeparted(peer.ID, errors.New("registry: gone"))
	<-x.Done()
	require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
	assert.NotErrorIs(t, x.Err(), agent.ErrCancelled)
	requireNoStaging(t, a)
}

// TestAttack14PartFailureAndNotifyOrder: the notification goes with the
// last part, posted only once every other part has finished; a part that
// fails fails the transfer, cancels the parts in flight, posts no
// notification and gives every buffer back.
func TestAttack14PartFailureAndNotifyOrder(t *testing.T) {
	sim := devmem.NewSim(1)
	ctl := newCtl()
	a := newStagingAgent(t, sim, 64<<10, 1<<20, ctl)
	peer := ctlPeer()
	const chunks = 6
	src := randBytes(chunks * 64 << 10)
	for _, op := range []agent.Op{agent.OpWrite, agent.OpRead} {
		t.Run("order-"+op.String(), func(t *testing.T) {
			x := postCtl(t, a, op, peer, vram(t, sim, 0, len(src), src), []byte("done"))
			finished := 0
			for finished < chunks {
				var batch []*ctlPart
				batch = append(batch, <-ctl.posted)
			more:
				for {
					select {
					case p := <-ctl.posted:
						batch = append(batch, p)
					default:
						break more
					}
				}
				for _, p := range batch {
					if p.w.Notify != nil {
						assert.Equal(t, chunks-1, finished, "the notification went out before every other part finished")
					}
					if op == agent.OpWrite {
						// The part's buffer holds the device bytes of its chunk.
						off := finished * 64 << 10
						assert.Equal(t, src[off:off+64<<10], p.w.Segments[0].Local.Mem, "chunk %d staged", finished)
					}
					p.finish <- nil
					<-p.ended
					finished++
				}
			}
			<-x.Done()
			require.NoError(t, x.Err())
			requireNoStaging(t, a)
		})
	}
	t.Run("failure", func(t *testing.T) {
		x := postCtl(t, a, agent.OpWrite, peer, vram(t, sim, 0, len(src), src), []byte("done"))
		var parts []*ctlPart
		for range 4 {
			parts = append(parts, <-ctl.posted)
		}
		parts[1].finish <- errors.New("injected part failure")
		<-x.Done()
		require.ErrorContains(t, x.Err(), "injected part failure")
		for _, p := range parts {
			<-p.ended
			assert.Nil(t, p.w.Notify)
		}
		select {
		case p := <-ctl.posted:
			t.Fatalf("a part was posted after the failure (notify %q)", p.w.Notify)
		default:
		}
		requireNoStaging(t, a)
	})
}

// gateDev delays every copy into device memory until the gate opens, as a
// slow asynchronous copy would: the copy runs, after the gate, on a
// goroutine of its own, and Sync waits for it. landed counts the copies
// done, queued those enqueued.
type gateDev struct {
	*devmem.Sim
	gate    chan struct{}
	entered chan struct{}
	queued  atomic.Int64
	landed  atomic.Int64
}

func newGateDev(sim *devmem.Sim) *gateDev {
	return &gateDev{Sim: sim, gate: make(chan struct{}), entered: make(chan struct{}, 1)}
}

func (d *gateDev) NewStream(dev int) (devmem.Stream, error) {
	s, err := d.Sim.NewStream(dev)
	if err != nil {
		return nil, err
	}
	return &gateStream{Stream: s, d: d}, nil
}

type gateStream struct {
	devmem.Stream
	d  *gateDev
	wg sync.WaitGroup
}

func (s *gateStream) ToDevice(dst uintptr, src []byte) error {
	s.d.queued.Add(1)
	select {
	case s.d.entered <- struct{}{}:
	default:
	}
	s.wg.Go(func() {
		<-s.d.gate
		_ = s.Stream.ToDevice(dst, src)
		_ = s.Stream.Sync()
		s.d.landed.Add(1)
	})
	return nil
}

func (s *gateStream) Sync() error  { s.wg.Wait(); return s.Stream.Sync() }
func (s *gateStream) Close() error { s.wg.Wait(); return s.Stream.Close() }

// TestAttack14NoCopyIntoDeviceAfterDoneOrClose: a READ cancelled, or an
// agent closed, while a chunk's host-to-device copy runs: Done closes, and
// Close returns, only once that copy has landed.
func TestAttack14NoCopyIntoDeviceAfterDoneOrClose(t *testing.T) {
	for _, how := range []string{"cancel", "close"} {
		t.Run(how, func(t *testing.T) {
			sim := devmem.NewSim(1)
			gd := newGateDev(sim)
			ctl := newCtl()
			a, err := agent.New(agent.WithBackends(ctl), agent.WithDevice(gd), agent.WithStaging(64<<10, 1<<20))
			require.NoError(t, err)
			defer a.Close()
			x := postCtl(t, a, agent.OpRead, ctlPeer(), vram(t, sim, 0, 256<<10, nil), nil)
			first := <-ctl.posted
			first.finish <- nil // its bytes are in the buffer: the H2D starts
			<-gd.entered
			closed := make(chan error, 1)
			if how == "cancel" {
				x.Cancel(nil)
			} else {
				go func() { closed <- a.Close() }()
			}
			// The copy is held: neither Done nor Close may come now. Let
			// the agent get as far as it will.
			for range 100 {
				time.Sleep(time.Millisecond)
				require.False(t, isDone(x), "Done while a copy into the device was still running")
				select {
				case <-closed:
					t.Fatal("Close returned while a copy into the device was still running")
				default:
				}
			}
			close(gd.gate)
			<-x.Done()
			assert.Equal(t, gd.queued.Load(), gd.landed.Load(), "copies into the device still pending at Done")
			if how == "close" {
				require.NoError(t, <-closed)
			}
			require.Error(t, x.Err())
			requireNoStaging(t, a)
		})
	}
}

// TestAttack14MixedSegmentsEveryByte: one request mixes host memory and
// GPU memory of two GPUs, on either side, in thousands of segments of odd
// sizes that cross chunk boundaries, READ and WRITE, over mem and tcp.
// Every byte is checked, the notification arrives, and no staging buffer
// stays in use.
func TestAttack14MixedSegmentsEveryByte(t *testing.T) {
	for _, backend := range []string{"mem", "tcp"} {
		t.Run(backend, func(t *testing.T) {
			sim := devmem.NewSim(2)
			mk := func() agent.Backend {
				if backend == "mem" {
					return mem.New()
				}
				return tcp.New()
			}
			act := newStagingAgent(t, sim, 64<<10, 1<<20, mk())
			pas := newStagingAgent(t, sim, 64<<10, 1<<20, mk())
			for _, shape := range []struct {
				name     string
				n, maxSg int
			}{{"small", 200 << 10, 300}, {"large", 2<<20 + 333, 150 << 10}} {
				for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
					t.Run(shape.name+"-"+op.String(), func(t *testing.T) {
						n := shape.n
						src := randBytes(n)
						var lfill, rfill []byte
						if op == agent.OpWrite {
							lfill = src
						} else {
							rfill = src
						}
						// Three places per side: host, GPU 0, GPU 1, each n bytes;
						// segment i lives at the same offset in one of them.
						place := func(fill []byte) []agent.Local {
							h := make([]byte, n)
							copy(h, fill)
							return []agent.Local{agent.DRAM(h), vram(t, sim, 0, n, fill), vram(t, sim, 1, n, fill)}
						}
						loc, rem := place(lfill), place(rfill)
						exp, err := pas.Expose(op.Access(), rem)
						require.NoError(t, err)
						defer exp.Revoke()
						type span struct{ off, l, li, ri int }
						var spans []span
						var segs []agent.Segment
						for off := 0; off < n; {
							l := min(n-off, 1+rand.IntN(shape.maxSg))
							s := span{off, l, rand.IntN(3), rand.IntN(3)}
							spans = append(spans, s)
							lr := loc[s.li]
							lr.Addr += uint64(off)
							lr.Len = uint64(l)
							if lr.Mem != nil {
								lr.Mem = lr.Mem[off : off+l]
							}
							rr := rem[s.ri].Region
							rr.Addr += uint64(off)
							rr.Len = uint64(l)
							segs = append(segs, agent.Segment{Local: lr, Remote: rr})
							off += l
						}
						x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(), Segments: segs, Notify: []byte("done")})
						require.NoError(t, err)
						<-x.Done()
						require.NoError(t, x.Err())
						assert.Equal(t, backend+"+staging", x.Path())
						ev := <-exp.Events()
						require.Equal(t, agent.EventNotify, ev.Kind)
						require.NoError(t, ev.Err)
						dst := rem
						which := func(s span) int { return s.ri }
						if op == agent.OpRead {
							dst, which = loc, func(s span) int { return s.li }
						}
						got := make([][]byte, 3)
						got[0] = dst[0].Mem
						got[1], got[2] = readVRAM(t, sim, dst[1]), readVRAM(t, sim, dst[2])
						bad := 0
						for _, s := range spans {
							if !bytes.Equal(src[s.off:s.off+s.l], got[which(s)][s.off:s.off+s.l]) {
								bad++
							}
						}
						require.Zero(t, bad, "of %d segments, %d arrived wrong", len(spans), bad)
						// The active side holds no staging once the transfer
						// is done. The passive side's leases are released
						// once their frame is answered, which over tcp can be
						// just after the notification (it travels on another
						// connection): Revoke waits for them.
						requireNoStaging(t, act)
						exp.Revoke()
						requireNoStaging(t, pas)
					})
				}
			}
		})
	}
}

// TestAttack14NotifyNeverOvertakesTheDevice: a WRITE into the peer's GPU
// memory: while the peer's copy into its device is held, the peer gets no
// notification and the transfer does not complete; when the notification
// comes, the device holds every byte. Over mem and tcp.
func TestAttack14NotifyNeverOvertakesTheDevice(t *testing.T) {
	for _, backend := range []string{"mem", "tcp"} {
		t.Run(backend, func(t *testing.T) {
			sim := devmem.NewSim(1)
			gd := newGateDev(sim)
			mk := func() agent.Backend {
				if backend == "mem" {
					return mem.New()
				}
				return tcp.New()
			}
			act := newStagingAgent(t, sim, 64<<10, 1<<20, mk())
			pas := newStagingAgent(t, gd, 64<<10, 1<<20, mk())
			const n = 100 << 10
			src := randBytes(n)
			dst := vram(t, sim, 0, n, nil)
			exp, err := pas.Expose(agent.AccessWrite, []agent.Local{dst})
			require.NoError(t, err)
			defer exp.Revoke()
			x, err := act.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: pas.Info(), Key: exp.Key(),
				Segments: []agent.Segment{{Local: agent.DRAM(src), Remote: dst.Region}}, Notify: []byte("done")})
			require.NoError(t, err)
			<-gd.entered
			for range 50 {
				time.Sleep(time.Millisecond)
				select {
				case ev := <-exp.Events():
					t.Fatalf("notification %v before the bytes reached the device", ev)
				default:
				}
				require.False(t, isDone(x), "the WRITE completed before the bytes reached the device")
			}
			close(gd.gate)
			ev := <-exp.Events()
			require.Equal(t, agent.EventNotify, ev.Kind)
			require.Equal(t, src, readVRAM(t, sim, dst))
			<-x.Done()
			require.NoError(t, x.Err())
			requireNoStaging(t, act, pas)
		})
	}
}

// syncCounter counts the Syncs of the streams of the device it wraps.
type syncCounter struct {
	*devmem.Sim
	syncs atomic.Int64
}

func (d *syncCounter) NewStream(dev int) (devmem.Stream, error) {
	s, err := d.Sim.NewStream(dev)
	if err != nil {
		return nil, err
	}
	return countedStream{s, &d.syncs}, nil
}

type countedStream struct {
	devmem.Stream
	n *atomic.Int64
}

func (s countedStream) Sync() error { s.n.Add(1); return s.Stream.Sync() }

// TestAttack14ManySmallBlocksFewSyncs: the issue asks that thousands of
// small device descriptors cost few stream syncs, not one per block. The
// active side keeps it (one sync per chunk). The passive side does not: a
// peer reading 512 blocks of this agent's GPU memory costs one
// device-to-host sync per block, so a decode worker pulling a KV cache of
// small blocks over tcp waits once per block.
func TestAttack14ManySmallBlocksFewSyncs(t *testing.T) {
	const blocks, bs = 512, 1 << 10
	sim := devmem.NewSim(1)
	actDev, pasDev := &syncCounter{Sim: sim}, &syncCounter{Sim: sim}
	act := newStagingAgent(t, actDev, 1<<20, 8<<20, mem.New())
	pas := newStagingAgent(t, pasDev, 1<<20, 8<<20, mem.New())
	src := randBytes(2 * blocks * bs)
	remote := vram(t, sim, 0, len(src), src)
	local := vram(t, sim, 0, len(src), nil)
	exp, err := pas.Expose(agent.AccessRead, []agent.Local{remote})
	require.NoError(t, err)
	defer exp.Revoke()
	var segs []agent.Segment
	for i := range blocks { // every other block: none merges with the next
		off := uint64(2 * i * bs)
		l := local
		l.Addr, l.Len = l.Addr+off, bs
		r := remote.Region
		r.Addr, r.Len = r.Addr+off, bs
		segs = append(segs, agent.Segment{Local: l, Remote: r})
	}
	actDev.syncs.Store(0)
	pasDev.syncs.Store(0)
	x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(), Segments: segs})
	require.NoError(t, err)
	<-x.Done()
	require.NoError(t, x.Err())
	got := readVRAM(t, sim, local)
	for i := range blocks {
		off := 2 * i * bs
		require.Equal(t, src[off:off+bs], got[off:off+bs])
	}
	assert.LessOrEqual(t, actDev.syncs.Load(), int64(8), "active side: syncs for %d blocks", blocks)
	t.Logf("syncs for %d blocks: active %d, passive %d", blocks, actDev.syncs.Load(), pasDev.syncs.Load())
	if pasDev.syncs.Load() > 8 {
	}
	assert.LessOrEqual(t, pasDev.syncs.Load(), int64(8), "passive side: syncs for a peer's read of %d blocks", blocks)
}

// TestAttack14StagingOptionsThatCannotStage: WithStaging accepts a chunk
// and pool when "half the pool holds a chunk", but buffers come in
// power-of-two classes and a lease takes at least 256 KiB: with a chunk
// that is not a power of two, or a pool under 512 KiB, accepted options
// make every staged transfer, or every peer access to GPU memory, fail.
func TestAttack14StagingOptionsThatCannotStage(t *testing.T) {
	sim := devmem.NewSim(1)
	t.Run("chunk-not-a-power-of-two", func(t *testing.T) {
		// Refused where it is given, saying what would work.
		_, err := agent.New(agent.WithBackends(mem.New()), agent.WithDevice(sim), agent.WithStaging(96<<10, 192<<10))
		require.ErrorIs(t, err, agent.ErrInvalidOption)
		require.ErrorContains(t, err, "power of two")
	})
	t.Run("small-pool", func(t *testing.T) {
		act := newStagingAgent(t, sim, 64<<10, 1<<20, mem.New())
		pas := newStagingAgent(t, sim, 64<<10, 256<<10, mem.New()) // lease half: 128 KiB
		src := randBytes(4096)
		rl := vram(t, sim, 0, 4096, src)
		exp, err := pas.Expose(agent.AccessRead, []agent.Local{rl})
		require.NoError(t, err)
		defer exp.Revoke()
		dst := make([]byte, 4096)
		x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: rl.Region}}})
		require.NoError(t, err)
		<-x.Done()
		require.NoError(t, x.Err(), "a peer's 4 KiB READ of GPU memory with WithStaging(64 KiB, 256 KiB)")
		require.Equal(t, src, dst)
	})
}

// barrierDev makes the first two device-to-host copies wait for each
// other (or for a second), so that two leases each hold a buffer before
// either asks for its next one.
type barrierDev struct {
	*devmem.Sim
	n    atomic.Int64
	both chan struct{}
}

func (d *barrierDev) NewStream(dev int) (devmem.Stream, error) {
	s, err := d.Sim.NewStream(dev)
	if err != nil {
		return nil, err
	}
	return barrierStream{s, d}, nil
}

type barrierStream struct {
	devmem.Stream
	d *barrierDev
}

func (s barrierStream) ToHost(dst []byte, src uintptr) error {
	switch s.d.n.Add(1) {
	case 1:
		select {
		case <-s.d.both:
		case <-time.After(2 * time.Second): // a fixed agent may never send the second
		}
	case 2:
		close(s.d.both)
	}
	return s.Stream.ToHost(dst, src)
}

// TestAttack14ConcurrentPeersDeadlockTheLeasePool: two peers read this
// agent's GPU memory at once over mem, each span two pieces that fit the
// lease pool together. Each lease takes its first buffer, then waits for
// a second that the other holds: both transfers fail after the lease wait
// (10 s by default), though each alone goes through.
func TestAttack14ConcurrentPeersDeadlockTheLeasePool(t *testing.T) {
	defer agent.SetStageWaitForTest(time.Hour)()
	const piece = 256 << 10
	sim := devmem.NewSim(1)
	bd := &barrierDev{Sim: sim, both: make(chan struct{})}
	pas := newStagingAgent(t, bd, 64<<10, 1<<20, mem.New()) // lease pool 512 KiB: two pieces
	src := randBytes(4 * piece)
	rl := vram(t, sim, 0, len(src), src)
	exp, err := pas.Expose(agent.AccessRead, []agent.Local{rl})
	require.NoError(t, err)
	defer exp.Revoke()
	var wg sync.WaitGroup
	errs := make([]error, 2)
	dsts := make([][]byte, 2)
	for i := range 2 {
		act := newStagingAgent(t, sim, 64<<10, 1<<20, mem.New())
		dsts[i] = make([]byte, 2*piece)
		var segs []agent.Segment
		for j := range 2 {
			r := rl.Region
			r.Addr, r.Len = r.Addr+uint64((2*i+j)*piece), piece
			segs = append(segs, agent.Segment{Local: agent.DRAM(dsts[i][j*piece : (j+1)*piece]), Remote: r})
		}
		wg.Go(func() {
			x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(), Segments: segs})
			if err == nil {
				<-x.Done()
				err = x.Err()
			}
			errs[i] = err
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(3 * time.Second): // a hang guard: the reads take milliseconds when they work
		go func() { _ = pas.Close() }() // wakes the waits
		<-done
		t.Fatalf("two peers' reads that each fit the lease pool wait for each other's buffers (until stageWait, 10 s by default): %v", errs)
	}
	for i, err := range errs {
		assert.NoError(t, err, "peer %d's read of two pieces that fit the lease pool", i)
		if err == nil {
			assert.Equal(t, src[2*i*piece:(2*i+2)*piece], dsts[i])
		}
	}
	exp.Revoke() // waits for the leases, which may end just after the reads did
	requireNoStaging(t, pas)
}

// freePort returns a loopback address nothing listens on now.
func freePort(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// TestAttack14CutWriteLandsStaleBytesOverTCP: a peer's WRITE into this
// agent's GPU memory over tcp is cut mid-payload (the connection drops).
// The tcp server releases the frame's lease, and Release copies the whole
// staging buffer into the device: past the cut, the device now holds what
// the pooled buffer held before, here another exposure's bytes, which
// the peer never sent. With host memory those bytes would be untouched.
func TestAttack14CutWriteLandsStaleBytesOverTCP(t *testing.T) {
	const n = 1 << 20
	sim := devmem.NewSim(1)
	listen := freePort(t)
	proxy := newCutProxy(t, listen)
	victim := newStagingAgent(t, sim, 64<<10, 4<<20, tcp.New(tcp.WithListenAddr(listen), tcp.WithAdvertiseAddr(proxy.ln.Addr().String())))
	peer := newStagingAgent(t, sim, 64<<10, 4<<20, tcp.New())
	secretL := vram(t, sim, 0, n, nil)
	targetL := vram(t, sim, 0, n, nil)
	secret, err := victim.Expose(agent.AccessWrite, []agent.Local{secretL})
	require.NoError(t, err)
	defer secret.Revoke()
	target, err := victim.Expose(agent.AccessWrite, []agent.Local{targetL})
	require.NoError(t, err)
	write := func(key agent.Key, to agent.Local, b byte) error {
		x, err := peer.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: victim.Info(), Key: key,
			Segments: []agent.Segment{{Local: agent.DRAM(bytes.Repeat([]byte{b}, n)), Remote: to.Region}}})
		require.NoError(t, err)
		<-x.Done()
		return x.Err()
	}
	require.NoError(t, write(secret.Key(), secretL, 0xAA)) // leaves 0xAA in a pooled 1 MiB buffer
	proxy.budget.Store(n / 2)
	require.Error(t, write(target.Key(), targetL, 0x55), "the cut WRITE failed")
	target.Revoke() // every lease released: whatever was flushed is in the device
	got := readVRAM(t, sim, targetL)
	stale := bytes.Count(got, []byte{0xAA})
	assert.Zero(t, stale, "bytes of another exposure's WRITE landed in this one's GPU memory (%d of them); sent: %d, untouched: %d",
		stale, bytes.Count(got, []byte{0x55}), bytes.Count(got, []byte{0}))
}

// TestAttack14DeniedPieceFlushesStaleBytes: a peer's WRITE frame names
// two pieces: one of this agent's GPU memory, one outside the exposure.
// The frame is refused, its payload discarded, but the lease has already
// staged the first piece, and Release copies that buffer, never filled,
// into the device: the stale bytes of an earlier access (here another
// exposure's WRITE) land in GPU memory the refused WRITE named. mem fills
// each piece as it slices it and keeps the promise; tcp and cma slice the
// whole frame first.
func TestAttack14DeniedPieceFlushesStaleBytes(t *testing.T) {
	const n = 64 << 10
	for _, backend := range []string{"mem", "tcp", "cma"} {
		t.Run(backend, func(t *testing.T) {
			if backend != "mem" {
			}
			sim := devmem.NewSim(1)
			mk := map[string]func() agent.Backend{
				"mem": func() agent.Backend { return mem.New() },
				"tcp": func() agent.Backend { return tcp.New() },
				"cma": func() agent.Backend { return cma.New() },
			}[backend]
			victim := newStagingAgent(t, sim, 64<<10, 4<<20, mk())
			peer := newStagingAgent(t, sim, 64<<10, 4<<20, mk())
			secretL, targetL := vram(t, sim, 0, n, nil), vram(t, sim, 0, n, nil)
			secret, err := victim.Expose(agent.AccessWrite, []agent.Local{secretL})
			require.NoError(t, err)
			defer secret.Revoke()
			target, err := victim.Expose(agent.AccessWrite, []agent.Local{targetL})
			require.NoError(t, err)
			x, err := peer.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: victim.Info(), Key: secret.Key(),
				Segments: []agent.Segment{{Local: agent.DRAM(bytes.Repeat([]byte{0xAA}, n)), Remote: secretL.Region}}})
			if backend == "cma" && err != nil {
				t.Skipf("cma unavailable: %v", err)
			}
			require.NoError(t, err)
			<-x.Done()
			require.NoError(t, x.Err())
			outside := targetL.Region
			outside.Addr, outside.Len = outside.Addr+16<<20, 4096
			in := targetL.Region
			in.Len = n / 2
			x, err = peer.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: victim.Info(), Key: target.Key(),
				Segments: []agent.Segment{
					{Local: agent.DRAM(bytes.Repeat([]byte{0x55}, n/2)), Remote: in},
					{Local: agent.DRAM(make([]byte, 4096)), Remote: outside},
				}})
			require.NoError(t, err)
			<-x.Done()
			require.ErrorIs(t, x.Err(), agent.ErrAccessDenied)
			target.Revoke()
			got := readVRAM(t, sim, targetL)
			assert.Zero(t, bytes.Count(got, []byte{0xAA}), "bytes of another exposure's WRITE landed in the GPU memory of a refused WRITE (0x55: %d, untouched: %d)",
				bytes.Count(got, []byte{0x55}), bytes.Count(got, []byte{0}))
			requireNoStaging(t, victim, peer)
		})
	}
}

// TestAttack14CancelStorm: many staged transfers at once, READ and WRITE,
// GPU memory on either side, each cancelled at a random point: every one
// ends, with success or ErrCancelled; a READ that succeeded holds every
// byte; no staging buffer stays in use on either side, and no goroutine
// outlives the test (goleak).
func TestAttack14CancelStorm(t *testing.T) {
	for _, backend := range []string{"mem", "tcp"} {
		t.Run(backend, func(t *testing.T) {
			sim := devmem.NewSim(2)
			sim.SetRate(2 << 30)
			mk := func() agent.Backend {
				if backend == "mem" {
					return mem.New()
				}
				return tcp.New()
			}
			act := newStagingAgent(t, sim, 64<<10, 1<<20, mk())
			pas := newStagingAgent(t, sim, 64<<10, 1<<20, mk())
			const n = 512 << 10
			src := randBytes(n)
			var wg sync.WaitGroup
			for i := range 24 {
				op := []agent.Op{agent.OpRead, agent.OpWrite}[i%2]
				lv, rv := i/2%2 == 0, i/4%2 == 0
				if !lv && !rv {
					rv = true
				}
				mkl := func(gpu bool, fill []byte) agent.Local {
					if gpu {
						return vram(t, sim, i%2, n, fill)
					}
					b := make([]byte, n)
					copy(b, fill)
					return agent.DRAM(b)
				}
				var loc, rem agent.Local
				if op == agent.OpRead {
					loc, rem = mkl(lv, nil), mkl(rv, src)
				} else {
					loc, rem = mkl(lv, src), mkl(rv, nil)
				}
				exp, err := pas.Expose(op.Access(), []agent.Local{rem})
				require.NoError(t, err)
				x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(),
					Segments: []agent.Segment{{Local: loc, Remote: rem.Region}}, Notify: []byte("n")})
				require.NoError(t, err)
				wg.Go(func() {
					defer exp.Revoke()
					for range rand.IntN(50) {
						runtime.Gosched()
					}
					x.Cancel(nil)
					<-x.Done()
					if err := x.Err(); err != nil {
						assert.ErrorIs(t, err, agent.ErrCancelled)
						return
					}
					if op == agent.OpRead {
						got := loc.Mem
						if lv {
							got = readVRAM(t, sim, loc)
						}
						assert.True(t, bytes.Equal(src, got), "a READ that succeeded holds every byte")
					}
				})
			}
			wg.Wait()
			requireNoStaging(t, act, pas)
		})
	}
}

// cutProxy forwards TCP connections to target; once armed with a budget,
// it cuts every connection after that many more bytes from client to
// server.
type cutProxy struct {
	ln     net.Listener
	target string
	budget atomic.Int64 // < 0: unlimited
	mu     sync.Mutex
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newCutProxy(t *testing.T, target string) *cutProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &cutProxy{ln: ln, target: target}
	p.budget.Store(-1)
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *cutProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		p.wg.Go(func() { p.pipe(s, c, true) })
		p.wg.Go(func() { p.pipe(c, s, false) })
	}
}

func (p *cutProxy) pipe(dst, src net.Conn, up bool) {
	defer p.cutAll()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && up {
			if b := p.budget.Load(); b >= 0 {
				if int64(n) > b {
					n = int(b)
				}
				if p.budget.Add(-int64(n)) <= 0 {
					_, _ = dst.Write(buf[:n])
					return
				}
			}
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *cutProxy) cutAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
}

func (p *cutProxy) close() {
	_ = p.ln.Close()
	p.cutAll()
	p.wg.Wait()
}
