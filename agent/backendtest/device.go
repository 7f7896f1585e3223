package backendtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/internal/pattern"
)

// placement says which descriptors of each side live in device memory.
type placement struct {
	name          string
	local, remote func(i int) bool
}

func onHost(int) bool          { return false }
func onDevice(int) bool        { return true }
func evenOnDevice(i int) bool  { return i%2 == 0 }
func thirdOnDevice(i int) bool { return i%3 == 0 }

var (
	placements = []placement{
		{"LocalVRAM", onDevice, onHost},
		{"RemoteVRAM", onHost, onDevice},
		{"BothVRAM", onDevice, onDevice},
		// Every pairing of host and device memory in one request.
		{"Interleaved", evenOnDevice, thirdOnDevice},
	}
	devLayouts = []layout{
		{"1B", []int{1}},
		{"4095B", []int{4095}},
		{"1MiB+13", []int{1<<20 + 13}}, // 17 staging chunks
		{"1000x4KiB", repeat(1000, 4<<10)},
		{"300xOdd", repeat(300, oddSizes...)},
		{"Mixed", []int{1, 64<<10 + 1, 3, 300<<10 + 7, 4 << 10, 17}},
	}
)

// devReach is what an agent's backends do with device memory.
type devReach struct {
	// native names a backend that moves device memory itself (UCX built
	// with CUDA); "" if none.
	native string
	// remote: some backend reaches a peer's device memory, staged by the
	// peer's agent (agent.DeviceStager) or natively.
	remote bool
	// cfg is the suite's configuration: its DirectDevice says which
	// transfers the backend moves without staging (devicePath).
	cfg Config
}

// path is the path a transfer of segs over backend takes (devicePath).
func (r devReach) path(backend string, segs []agent.Segment) string {
	return devicePath(r.cfg, backend, segs)
}

// direct reports whether the backend moves segs' GPU memory itself
// (Config.DirectDevice), without staging.
func (r devReach) direct(segs []agent.Segment) bool {
	return strings.HasSuffix(devicePath(r.cfg, "", segs), "+"+r.cfg.DirectDevice) && r.cfg.DirectDevice != ""
}

func reachOf(bs []agent.Backend) devReach {
	var r devReach
	for _, b := range bs {
		if b.Supports(agent.KindVRAM) {
			r.native, r.remote = b.Name(), true
		}
		if s, ok := b.(agent.DeviceStager); ok && s.StagesDevice() {
			r.remote = true
		}
	}
	return r
}

// skipNative skips t for backends that move device memory themselves: the
// simulated GPU's memory is not addressable by them.
func (r devReach) skipNative(t *testing.T) {
	t.Helper()
	if r.native != "" {
		t.Skipf("backend %s moves GPU memory itself: the simulated GPU's memory cannot serve it (run on a GPU machine)", r.native)
	}
}

// newDevAgent starts an agent on a fresh set of the backends under test,
// with drv as its device driver and the suite's staging; opts come last.
// It closes the agent when the test ends.
func newDevAgent(t *testing.T, cfg Config, drv devmem.Driver, opts ...agent.Option) (*agent.Agent, devReach) {
	t.Helper()
	bs, err := cfg.New()
	require.NoError(t, err, "factory")
	r := reachOf(bs)
	r.cfg = cfg
	return startDevAgent(t, bs, drv, opts...), r
}

func startDevAgent(t *testing.T, bs []agent.Backend, drv devmem.Driver, opts ...agent.Option) *agent.Agent {
	t.Helper()
	opts = append([]agent.Option{agent.WithBackends(bs...), agent.WithDevice(drv), agent.WithStaging(devChunk, devPool)}, opts...)
	a, err := agent.New(opts...)
	require.NoError(t, err, "agent.New")
	t.Cleanup(func() { assert.NoError(t, a.Close(), "agent.Close") })
	return a
}

// devSideOf lays out sizes for agent a (drv its driver), registers the
// descriptors with a, and frees them when the test ends; the descriptors
// hold pattern 0.
func devSideOf(t testing.TB, a *agent.Agent, drv devmem.Driver, gpu int, sizes []int, onDev func(int) bool) *devSide {
	t.Helper()
	s, err := newDevSide(drv, gpu, sizes, onDev)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, s.free(), "free device memory") })
	regs, err := registerAll(a, s.locals)
	require.NoError(t, err)
	t.Cleanup(func() { release(regs) })
	return s
}

// filled is devSideOf filled with a fresh pattern, and that pattern.
func filled(t testing.TB, a *agent.Agent, drv devmem.Driver, gpu int, sizes []int, onDev func(int) bool) (*devSide, uint64) {
	t.Helper()
	s := devSideOf(t, a, drv, gpu, sizes, onDev)
	seed := pattern.NextSeed()
	require.NoError(t, s.Fill(seed))
	return s, seed
}

func anyOf(n int, f func(int) bool) bool {
	for i := range n {
		if f(i) {
			return true
		}
	}
	return false
}

// devPair is an active and a passive agent, each with simulated GPUs of
// its own.
type devPair struct {
	a, p   *agent.Agent
	as, ps *devmem.Sim
	reach  devReach // of a's backends
}

func newDevPair(t *testing.T, cfg Config) *devPair {
	t.Helper()
	d := &devPair{as: devmem.NewSim(2), ps: devmem.NewSim(2)}
	d.a, d.reach = newDevAgent(t, cfg, d.as)
	d.p, _ = newDevAgent(t, cfg, d.ps)
	return d
}

// testDevice runs the device-memory cases in this process; the
// cross-process ones run under CrossProcess.
func testDevice(t *testing.T, cfg Config) {
	t.Run("Refused", func(t *testing.T) { testDeviceRefused(t, cfg) })
	t.Run("Transfer", func(t *testing.T) { testDeviceTransfer(t, cfg) })
	t.Run("Batched", func(t *testing.T) { testDeviceBatched(t, cfg) })
	t.Run("Overlap", func(t *testing.T) { testDeviceOverlap(t, cfg) })
	t.Run("Fault", func(t *testing.T) { testDeviceFault(t, cfg) })
}

// testDeviceTransfer moves every device layout, in both directions, with
// device memory on the active side, the passive side, both, and
// interleaved with host memory. A backend that cannot reach a peer's
// device memory must refuse the cases with remote device memory with
// ErrNoBackend.
func testDeviceTransfer(t *testing.T, cfg Config) {
	d := newDevPair(t, cfg)
	d.reach.skipNative(t)
	for _, op := range ops {
		for _, pl := range placements {
			for _, l := range devLayouts {
				t.Run(fmt.Sprintf("%v/%s/%s", op, pl.name, l.name), func(t *testing.T) {
					d.transfer(t, op, l.sizes, pl, []byte(fmt.Sprintf("%v %s %s done", op, pl.name, l.name)))
				})
			}
			t.Run(fmt.Sprintf("%v/%s/NoNotify", op, pl.name), func(t *testing.T) {
				d.transfer(t, op, devLayouts[2].sizes, pl, nil)
			})
		}
	}
}

// transfer is the device version of the suite's transfer: every byte of
// both sides checked, guards included, the data in place when a WRITE's
// notification arrives, a READ unaffected by the passive side reusing its
// memory as soon as the notification says it may, and every staging
// buffer back in its pool when the transfer is done.
func (d *devPair) transfer(t *testing.T, op agent.Op, sizes []int, pl placement, notify []byte) {
	t.Helper()
	pb, pSeed := filled(t, d.p, d.ps, passiveGPU, sizes, pl.remote)
	ab, aSeed := filled(t, d.a, d.as, activeGPU, sizes, pl.local)
	e := exposeLocals(t, d.p, op.Access(), pb.locals)
	segs := segmentsOf(ab.locals, pb.regions(), pSeed)
	x, err := d.a.Post(context.Background(), agent.Request{Op: op, Peer: d.p.Info(), Key: e.Key(), Segments: segs, Notify: notify})
	if anyOf(len(sizes), pl.remote) && !d.reach.remote {
		require.ErrorIs(t, err, agent.ErrNoBackend, "%v of a peer's device memory over a backend that cannot reach it", op)
		require.ErrorContains(t, err, "GPU memory")
		require.Nil(t, x)
		require.NoError(t, ab.Check(aSeed), "active memory after a refused %v", op)
		require.NoError(t, pb.Check(pSeed), "passive memory after a refused %v", op)
		return
	}
	require.NoError(t, err, "Post")
	want := pSeed
	if op == agent.OpWrite {
		want = aSeed
	}
	if notify != nil {
		ev := waitEvent(t, e, hangGuard)
		require.Equal(t, agent.EventNotify, ev.Kind, "event %+v", ev)
		require.NoError(t, ev.Err, "the notification vouches for bytes that did not all reach the device")
		assert.Equal(t, d.a.ID(), ev.From, "notification sender")
		assert.True(t, bytes.Equal(notify, ev.Msg), "notification %q, want %q", ev.Msg, notify)
		if op == agent.OpWrite {
			require.NoError(t, pb.Check(want), "passive memory when the bound notification arrived")
		}
		e.Revoke()
		if op == agent.OpRead {
			require.NoError(t, pb.Fill(pattern.NextSeed()), "the passive side reuses its memory")
		}
	}
	require.NoError(t, waitXfer(t, x), "%v over %s", op, x.Path())
	require.Zero(t, d.a.Stats().StagingBuffers, "staging buffers in use on the active side once the transfer is done")
	e.Revoke()
	require.Zero(t, d.p.Stats().StagingBuffers, "staging buffers in use on the passive side once its exposure is revoked")
	require.NoError(t, ab.Check(want), "active memory")
	if notify == nil || op == agent.OpWrite {
		require.NoError(t, pb.Check(want), "passive memory")
	}
	assert.Equal(t, d.reach.path(x.Backend(), segs), x.Path(), "the path of device memory")
	assert.Equal(t, uint64(sum(sizes)), x.Bytes())
	assert.Equal(t, d.a.ID(), e.Peer(), "exposure's peer")
	if notify == nil {
		noEvent(t, e)
	}
}

// testDeviceRefused checks the device memory an agent cannot use: a
// pointer its driver does not know, an agent with no driver, and a peer's
// device memory over a backend that cannot reach it.
func testDeviceRefused(t *testing.T, cfg Config) {
	sim := devmem.NewSim(2)
	a, reach := newDevAgent(t, cfg, sim)
	reach.skipNative(t)
	ps := devmem.NewSim(2)
	p, _ := newDevAgent(t, cfg, ps)
	pb, pSeed := filled(t, p, ps, passiveGPU, []int{4 << 10, 4 << 10}, onDevice)
	pe := exposeLocals(t, p, agent.AccessRead, pb.locals)

	good, err := sim.Alloc(activeGPU, 8<<10)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sim.Free(good) })
	other := devmem.NewSim(2) // another process's GPU, as far as a's driver knows
	elsewhere, err := other.Alloc(activeGPU, 4<<10)
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Free(elsewhere) })

	host := make([]byte, 4<<10)
	bad := []struct {
		name  string
		local agent.Local
	}{
		{"NoAllocation", agent.Device(0x10000, 4<<10, agent.KindVRAM, activeGPU)},
		{"AnotherDriversPointer", agent.Device(elsewhere, 4<<10, agent.KindVRAM, activeGPU)},
		{"PastTheAllocation", agent.Device(good+4<<10, 8<<10, agent.KindVRAM, activeGPU)},
		{"WrongGPU", agent.Device(good, 4<<10, agent.KindVRAM, passiveGPU)},
		{"NoSuchGPU", agent.Device(good, 4<<10, agent.KindVRAM, 7)},
	}
	for _, c := range bad {
		t.Run("UnknownPointer/"+c.name, func(t *testing.T) {
			refusedAt(t, a, p, pe, pb, []agent.Local{agent.DRAM(host), c.local}, devmem.ErrNotDevice)
		})
	}

	t.Run("NoDriver", func(t *testing.T) {
		n, _ := newDevAgent(t, cfg, unavailableDevice{})
		refusedAt(t, n, p, pe, pb, []agent.Local{agent.DRAM(host), agent.Device(good, 4<<10, agent.KindVRAM, activeGPU)}, devmem.ErrUnavailable)
		if !reach.remote {
			return
		}
		// The peer's agent stages its own device memory: an agent without
		// a driver reaches it all the same.
		e := exposeLocals(t, p, agent.AccessRead, pb.locals)
		lb, _ := side(t, n, []int{4 << 10, 4 << 10})
		require.NoError(t, postWait(t, n, agent.Request{Op: agent.OpRead, Peer: p.Info(), Key: e.Key(), Segments: segmentsOf(lb.locals, pb.regions(), 0)}))
		require.NoError(t, lb.Check(pSeed), "host memory READ by an agent without a driver from a peer's device memory")
	})

	t.Run("DefaultDriver", func(t *testing.T) {
		if v := os.Getenv(devmem.EnvDevice); v != "" {
			t.Skipf("%s=%q chooses the process's driver", devmem.EnvDevice, v)
		}
		if _, err := devmem.CUDA().Devices(); !errors.Is(err, devmem.ErrUnavailable) {
			t.Skipf("this machine has a CUDA driver (%v): an agent's default driver is available", err)
		}
		n := newAgent(t, cfg) // no WithDevice: the CUDA driver, which is not there
		refusedAt(t, n, p, pe, pb, []agent.Local{agent.DRAM(host), agent.Device(good, 4<<10, agent.KindVRAM, activeGPU)}, devmem.ErrUnavailable)
	})

	t.Run("RemoteUnreachable", func(t *testing.T) {
		if !reach.remote {
			remoteUnreachable(t, a, sim, p, pe, pb, pSeed)
		}
		// The same backends, hiding that they stage a peer's device memory.
		bs, err := cfg.New()
		require.NoError(t, err)
		for i, b := range bs {
			bs[i] = wrap(b, wrapper{})
		}
		h := startDevAgent(t, bs, sim)
		remoteUnreachable(t, h, sim, p, pe, pb, pSeed)
	})
}

// refusedAt checks that a refuses locals, whose region 1 is device memory
// it cannot use, at Post and at Expose, with ErrInvalid and cause, naming
// the region, before anything starts.
func refusedAt(t *testing.T, a, p *agent.Agent, pe *agent.Exposure, pb *devSide, locals []agent.Local, cause error) {
	t.Helper()
	before := a.Stats()
	for _, op := range ops {
		segs := make([]agent.Segment, len(locals))
		for i, l := range locals {
			segs[i] = agent.Segment{Local: l, Remote: agent.Region{Addr: pb.locals[i].Addr, Len: l.Len, Kind: agent.KindVRAM, Device: passiveGPU}}
		}
		x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: pe.Key(), Segments: segs, Notify: []byte("never")})
		require.ErrorIs(t, err, agent.ErrInvalid, "%v from device memory the agent cannot use", op)
		require.ErrorIs(t, err, cause)
		require.ErrorContains(t, err, "region 1")
		require.Nil(t, x)
	}
	for _, acc := range []agent.Access{agent.AccessRead, agent.AccessWrite} {
		e, err := a.Expose(acc, locals)
		require.ErrorIs(t, err, agent.ErrInvalid, "Expose for %v of device memory the agent cannot use", acc)
		require.ErrorIs(t, err, cause)
		require.ErrorContains(t, err, "region 1")
		require.Nil(t, e)
	}
	after := a.Stats()
	assert.Equal(t, before.InFlight, after.InFlight, "transfers in flight")
	assert.Equal(t, before.Exposed, after.Exposed, "exposures")
	assert.Zero(t, after.StagingBuffers, "staging buffers in use")
	noEvent(t, pe)
}

// remoteUnreachable checks, on an agent a whose backends cannot reach a
// peer's device memory, that a transfer to p's device memory fails with
// ErrNoBackend before anything moves, while a's own device memory still
// goes, staged, to p's host memory.
func remoteUnreachable(t *testing.T, a *agent.Agent, drv devmem.Driver, p *agent.Agent, pe *agent.Exposure, pb *devSide, pSeed uint64) {
	t.Helper()
	lb, lSeed := side(t, a, []int{4 << 10, 4 << 10})
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: p.Info(), Key: pe.Key(), Segments: segmentsOf(lb.locals, pb.regions(), 0)})
	require.ErrorIs(t, err, agent.ErrNoBackend, "READ of a peer's device memory")
	require.ErrorContains(t, err, "GPU memory")
	require.Nil(t, x)
	require.NoError(t, lb.Check(lSeed))
	require.NoError(t, pb.Check(pSeed))
	noEvent(t, pe)

	// Local device memory is the agent's own to stage.
	hb, hSeed := side(t, p, []int{64<<10 + 5})
	he := exposeLocals(t, p, agent.AccessRead, hb.locals)
	db := devSideOf(t, a, drv, activeGPU, []int{64<<10 + 5}, onDevice)
	x, err = a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: p.Info(), Key: he.Key(), Segments: segmentsOf(db.locals, hb.regions(), 0)})
	require.NoError(t, err, "READ into local device memory")
	require.NoError(t, waitXfer(t, x))
	assert.Equal(t, x.Backend()+"+staging", x.Path())
	require.NoError(t, db.Check(hSeed))
}
