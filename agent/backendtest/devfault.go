package backendtest

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/internal/pattern"
	"github.com/goxfer/goxfer/internal/retry"
)

// watchedDevice is a simulator whose streams count what the agent asks of
// them, and tell when a copy of each kind was first enqueued and first
// completed.
type watchedDevice struct {
	*devmem.Sim
	streams, copies, syncs atomic.Int64

	mu    sync.Mutex
	first map[string]chan struct{} // by "to-host", "to-device", "device-to-device", and those with "+enqueued"
}

func newWatched(sim *devmem.Sim) *watchedDevice {
	d := &watchedDevice{Sim: sim, first: map[string]chan struct{}{}}
	for _, k := range []string{"to-host", "to-device", "device-to-device"} {
		d.first[k] = make(chan struct{})
		d.first[k+"+enqueued"] = make(chan struct{})
	}
	return d
}

// synced is closed once a Sync (or Close) has waited for a copy of kind
// ("to-host", "to-device" or "device-to-device"): a chunk has been staged,
// or copied by a backend's own device path.
func (d *watchedDevice) synced(kind string) <-chan struct{} { return d.first[kind] }

// enqueued is closed once a copy of kind has been enqueued: staging has
// begun.
func (d *watchedDevice) enqueued(kind string) <-chan struct{} { return d.first[kind+"+enqueued"] }

func (d *watchedDevice) fire(kind string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	select {
	case <-d.first[kind]:
	default:
		close(d.first[kind])
	}
}

func (d *watchedDevice) NewStream(dev int) (devmem.Stream, error) {
	s, err := d.Sim.NewStream(dev)
	if err != nil {
		return nil, err
	}
	d.streams.Add(1)
	return &watchedStream{Stream: s, d: d}, nil
}

// watchedStream is used by one goroutine at a time, as every Stream.
type watchedStream struct {
	devmem.Stream
	d                     *watchedDevice
	toHost, toDevice, d2d bool // copies enqueued since the last Sync
}

func (s *watchedStream) ToHost(dst []byte, src uintptr) error {
	s.d.copies.Add(1)
	s.toHost = true
	err := s.Stream.ToHost(dst, src)
	s.d.fire("to-host+enqueued")
	return err
}

func (s *watchedStream) ToDevice(dst uintptr, src []byte) error {
	s.d.copies.Add(1)
	s.toDevice = true
	err := s.Stream.ToDevice(dst, src)
	s.d.fire("to-device+enqueued")
	return err
}

func (s *watchedStream) Copy(dst, src uintptr, n int) error {
	s.d.copies.Add(1)
	s.d2d = true
	err := s.Stream.Copy(dst, src, n)
	s.d.fire("device-to-device+enqueued")
	return err
}

func (s *watchedStream) Sync() error {
	err := s.Stream.Sync()
	s.d.syncs.Add(1)
	s.synced()
	return err
}

func (s *watchedStream) Close() error {
	err := s.Stream.Close()
	s.synced()
	return err
}

func (s *watchedStream) synced() {
	if s.toHost {
		s.d.fire("to-host")
	}
	if s.toDevice {
		s.d.fire("to-device")
	}
	if s.d2d {
		s.d.fire("device-to-device")
	}
	s.toHost, s.toDevice, s.d2d = false, false, false
}

// stageKind is the kind of copy that stages local device memory for op:
// out of the device before a WRITE sends it, into it after a READ received.
func stageKind(op agent.Op) string {
	if op == agent.OpWrite {
		return "to-host"
	}
	return "to-device"
}

// testDeviceBatched checks that many small device descriptors are staged
// in batches: a copy per descriptor, but one wait per chunk, on one
// stream, not one wait per descriptor.
func testDeviceBatched(t *testing.T, cfg Config) {
	const blocks, size = 1000, 4 << 10
	chunks := int64((blocks*size + devChunk - 1) / devChunk)
	sim := devmem.NewSim(2)
	wd := newWatched(sim)
	a, reach := newDevAgent(t, cfg, wd)
	reach.skipNative(t)
	p, _ := newDevAgent(t, cfg, devmem.NewSim(2))
	for _, op := range ops {
		t.Run(op.String(), func(t *testing.T) {
			ab, aSeed := filled(t, a, sim, activeGPU, repeat(blocks, size), onDevice) // through sim: not counted
			pb, pSeed := side(t, p, repeat(blocks, size))
			e := expose(t, p, op.Access(), pb)
			streams, copies, syncs := wd.streams.Load(), wd.copies.Load(), wd.syncs.Load()
			require.NoError(t, postWait(t, a, agent.Request{Op: op, Peer: p.Info(), Key: e.Key(), Segments: segmentsOf(ab.locals, pb.regions(), pSeed)}))
			streams, copies, syncs = wd.streams.Load()-streams, wd.copies.Load()-copies, wd.syncs.Load()-syncs
			t.Logf("%v of %d device blocks in %d chunks: %d copies, %d syncs, %d new streams", op, blocks, chunks, copies, syncs, streams)
			assert.Equal(t, int64(blocks), copies, "one copy per block")
			assert.LessOrEqual(t, syncs, chunks+2, "waits for the copies: one per chunk of %d bytes, not one per block", devChunk)
			assert.LessOrEqual(t, streams, int64(1), "streams made: the agent reuses its streams")
			e.Revoke()
			want := pSeed
			if op == agent.OpWrite {
				want = aSeed
			}
			require.NoError(t, ab.Check(want), "active memory")
			require.NoError(t, pb.Check(want), "passive memory")
		})
	}
}

// testDeviceOverlap shows the staging pipeline's overlap from the
// simulator's own record: the active agent's device is slow (each chunk's
// copy takes milliseconds), its backend marks in the same record when each
// part of the transfer was posted and when it finished (a "send"), and its
// peer grants each lease late, as a busy process does. For a WRITE some
// device-to-host copy must run entirely within the send of an earlier
// chunk; for a READ some host-to-device copy entirely within the receive
// of a later chunk. This is an ordering check on recorded intervals, not a
// wall-clock bound: a pipeline that stages chunk i+1 only once chunk i is
// sent cannot pass it, however fast the machine.
func testDeviceOverlap(t *testing.T, cfg Config) {
	if cfg.DirectDevice != "" {
		t.Skipf("the backend moves GPU memory itself (%s): staging's overlap is checked by RunDevice with its own path off", cfg.DirectDevice)
	}
	const (
		chunk  = 256 << 10
		chunks = 16
		rate   = 64 << 20 // bytes/s: 4 ms a chunk
		delay  = 20 * time.Millisecond
	)
	for _, op := range ops {
		t.Run(op.String(), func(t *testing.T) {
			sim := devmem.NewSim(2)
			bs, err := cfg.New()
			require.NoError(t, err)
			reachOf(bs).skipNative(t)
			marks := &sendMarks{sim: sim}
			for i, b := range bs {
				bs[i] = wrap(b, wrapper{post: marks.post})
			}
			a := startDevAgent(t, bs, sim, agent.WithStaging(chunk, 16<<20))
			pbs, err := cfg.New()
			require.NoError(t, err)
			for i, b := range pbs {
				pbs[i] = wrap(b, wrapper{host: slowPeer(delay)})
			}
			p := startDevAgent(t, pbs, devmem.NewSim(2))

			ab, aSeed := filled(t, a, sim, activeGPU, []int{chunks * chunk}, onDevice)
			pb, pSeed := side(t, p, []int{chunks * chunk})
			e := expose(t, p, op.Access(), pb)
			sim.SetRate(rate)
			sim.Record(true)
			x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: e.Key(), Segments: segmentsOf(ab.locals, pb.regions(), 0)})
			require.NoError(t, err)
			require.NoError(t, waitXfer(t, x))
			marks.wait()
			events := sim.Events()
			sim.Record(false)
			sim.SetRate(0)
			e.Revoke()
			want := pSeed
			if op == agent.OpWrite {
				want = aSeed
			}
			require.NoError(t, ab.Check(want), "active memory")
			require.NoError(t, pb.Check(want), "passive memory")

			kind := stageKind(op)
			var sends, copies []devmem.Event
			for _, ev := range events {
				switch ev.Kind {
				case "send":
					sends = append(sends, ev)
				case kind:
					copies = append(copies, ev)
				}
			}
			require.Len(t, sends, chunks, "parts posted to %s: one per chunk\n%s", x.Backend(), timeline(events))
			require.Len(t, copies, chunks, "%s copies: one per chunk\n%s", kind, timeline(events))
			found := false
			for _, s := range sends {
				for _, c := range copies {
					found = found || (s.Start <= c.Start && c.End <= s.End)
				}
			}
			require.True(t, found, "no %s copy ran while a part was on its way over %s: the pipeline does not overlap\n%s", kind, x.Backend(), timeline(events))
		})
	}
}

// timeline lists a simulator's record, for failure messages.
func timeline(events []devmem.Event) string {
	var b strings.Builder
	for _, ev := range events {
		fmt.Fprintf(&b, "  %-9s %8d B  %9.3f ms .. %9.3f ms\n", ev.Kind, ev.Bytes, ev.Start.Seconds()*1e3, ev.End.Seconds()*1e3)
	}
	return b.String()
}

// lateCopies returns the copies in events that ended after the mark of
// kind did: after the moment it records.
func lateCopies(events []devmem.Event, mark string) []devmem.Event {
	var at time.Duration = -1
	for _, ev := range events {
		if ev.Kind == mark {
			at = ev.Start
		}
	}
	var late []devmem.Event
	for _, ev := range events {
		if (ev.Kind == "to-host" || ev.Kind == "to-device" || ev.Kind == "device-to-device") && at >= 0 && ev.End > at {
			late = append(late, ev)
		}
	}
	return late
}

// settle is how long the fault cases watch for copies that should not
// come: several chunks' worth of copying at their slowed rate.
const settle = 50 * time.Millisecond

func testDeviceFault(t *testing.T, cfg Config) {
	// Decided here, not inside an attempt: a skip there would only retry.
	_, reach := newDevAgent(t, cfg, devmem.NewSim(1))
	reach.skipNative(t)
	needRemote := func(t *testing.T) {
		t.Helper()
		if !reach.remote {
			t.Skip("the backends do not stage a peer's device memory: this agent's device memory is not staged for a peer")
		}
	}
	for _, op := range ops {
		t.Run(fmt.Sprintf("Cancel/%v", op), func(t *testing.T) {
			retry.Until(t, attempts, func(t *testing.T) bool { return cancelStaged(t, cfg, op) })
		})
	}
	t.Run("CloseWhileStaging/Active", func(t *testing.T) {
		retry.Until(t, attempts, func(t *testing.T) bool { return closeWhileStaging(t, cfg) })
	})
	t.Run("CloseWhileStaging/Passive", func(t *testing.T) {
		needRemote(t)
		retry.Until(t, attempts, func(t *testing.T) bool { return closeWhileLeased(t, cfg) })
	})
	for _, op := range ops {
		t.Run(fmt.Sprintf("PeerKilled/ParentActive/%v", op), func(t *testing.T) {
			needCrossProcess(t, cfg)
			retry.Until(t, attempts, func(t *testing.T) bool { return killedMidStaging(t, cfg, op) })
		})
		t.Run(fmt.Sprintf("PeerKilled/ChildActive/%v", op), func(t *testing.T) {
			needCrossProcess(t, cfg)
			needRemote(t)
			var torn error
			retry.Until(t, attempts, func(t *testing.T) bool { return killedMidLease(t, cfg, op, &torn) })
			if torn != nil {
				t.Fatalf("a WRITE cut short left bytes in the exposed GPU memory that are neither the old nor the new ones (only flushed staging may reach the device): %v", torn)
			}
		})
	}
}

// slowStaged starts a staged transfer of op between a fresh pair: 4 MiB
// of device memory on the active side (64 chunks), copied at 16 MiB/s, so
// 4 ms a chunk; the passive side's memory is device memory too where the
// backends reach it. It returns once the first chunk has been staged
// (copied out of the device for a WRITE, into it for a READ), or false if
// the transfer finished first.
func slowStaged(t *testing.T, cfg Config, op agent.Op) (d *devPair, x *agent.Xfer, ab, pb *devSide, e *agent.Exposure, pSeed uint64, ok bool) {
	t.Helper()
	const size = 4 << 20
	d = &devPair{as: devmem.NewSim(2), ps: devmem.NewSim(2)}
	wd := newWatched(d.as)
	d.a, d.reach = newDevAgent(t, cfg, wd)
	d.p, _ = newDevAgent(t, cfg, d.ps)
	remote := onHost
	if d.reach.remote {
		remote = onDevice
	}
	ab, _ = filled(t, d.a, d.as, activeGPU, []int{size}, onDevice)
	pb, pSeed = filled(t, d.p, d.ps, passiveGPU, []int{size}, remote)
	e = exposeLocals(t, d.p, op.Access(), pb.locals)
	d.as.SetRate(16 << 20)
	d.as.Record(true)
	segs := segmentsOf(ab.locals, pb.regions(), 0)
	x, err := d.a.Post(context.Background(), agent.Request{Op: op, Peer: d.p.Info(), Key: e.Key(), Segments: segs})
	require.NoError(t, err)
	t.Cleanup(func() { waitXfer(t, x) })
	kind := stageKind(op)
	if d.reach.direct(segs) {
		kind = "device-to-device" // the backend copies the peer's mapped memory
	}
	select {
	case <-wd.synced(kind):
	case <-x.Done():
		return d, x, ab, pb, e, pSeed, false
	case <-time.After(hangGuard):
		t.Fatalf("no chunk staged within %v", hangGuard)
	}
	return d, x, ab, pb, e, pSeed, !isDone(x)
}

// cancelStaged cancels a staged transfer after its first chunk: it must
// end with ErrCancelled, every staging buffer back in its pool once it is
// done, no copy running afterwards, and both agents still usable.
func cancelStaged(t *testing.T, cfg Config, op agent.Op) bool {
	d, x, _, pb, e, pSeed, ok := slowStaged(t, cfg, op)
	if !ok {
		return false
	}
	x.Cancel(context.Canceled)
	err := waitXfer(t, x)
	d.as.Mark("done", 0)()
	inUse := d.a.Stats().StagingBuffers
	t.Logf("%v over %s done after Cancel: %v", op, x.Path(), err)
	if err == nil {
		return false
	}
	require.ErrorIs(t, err, agent.ErrCancelled)
	require.ErrorIs(t, err, context.Canceled)
	require.Zero(t, inUse, "staging buffers in use once the cancelled transfer is done")
	time.Sleep(settle)
	events := d.as.Events()
	d.as.Record(false)
	d.as.SetRate(0)
	require.Empty(t, lateCopies(events, "done"), "copies of the cancelled transfer ended after it was done\n%s", timeline(events))
	e.Revoke()
	require.Zero(t, d.p.Stats().StagingBuffers, "staging buffers in use on the passive side once its exposure is revoked")
	if op == agent.OpRead {
		require.NoError(t, pb.Check(pSeed), "a cancelled READ leaves the passive memory alone")
	}
	// Both agents are still usable.
	d.transfer(t, op, []int{devChunk*3 + 5}, placement{"after cancel", onDevice, pb.onDev0}, []byte("after cancel"))
	return true
}

// onDev0 is a placement function with the first descriptor where s has
// its own.
func (s *devSide) onDev0(int) bool { return s.onDev[0] }

// closeWhileStaging closes the active agent while a slow staged READ into
// its device memory runs: Close returns, the transfer is done by then, no
// copy into the device ends after Close returned, and the agent holds no
// staging memory any more.
func closeWhileStaging(t *testing.T, cfg Config) bool {
	d, x, _, _, e, _, ok := slowStaged(t, cfg, agent.OpRead)
	if !ok {
		return false
	}
	require.NoError(t, CloseWithin(t, d.a, hangGuard, "Close during a staged READ"))
	d.as.Mark("closed", 0)()
	require.True(t, isDone(x), "Close returned before its staged transfer was done")
	err := x.Err()
	t.Logf("staged READ over %s after Close: %v", x.Path(), err)
	if err != nil {
		require.ErrorIs(t, err, agent.ErrClosed)
	}
	st := d.a.Stats()
	assert.Zero(t, st.StagingBuffers, "staging buffers in use after Close")
	assert.Zero(t, st.StagingBytes, "staging memory held after Close")
	time.Sleep(settle)
	events := d.as.Events()
	d.as.Record(false)
	d.as.SetRate(0)
	require.Empty(t, lateCopies(events, "closed"), "copies into the device ended after Close returned\n%s", timeline(events))
	e.Revoke()
	require.Zero(t, d.p.Stats().StagingBuffers, "staging buffers in use on the passive side")
	return err != nil
}

// closeWhileLeased closes the passive agent while a peer's slow WRITE is
// staged into its device memory (64 MiB at 64 MiB/s: several leases, each
// tens of milliseconds): Close returns once the leases are done, no copy
// into its device ends after that, and it holds no staging memory. Where
// the backend copies into the peer's mapped memory itself (DirectDevice),
// the copies are the active side's, watched and slowed there.
func closeWhileLeased(t *testing.T, cfg Config) bool {
	const size = 64 << 20 // more than cma leases ahead (4 × 4 MiB), so that Close interrupts it
	ps, as := devmem.NewSim(2), devmem.NewSim(2)
	copier := ps // the simulator that copies into ps's memory
	if cfg.DirectDevice != "" {
		copier = as
	}
	wd := newWatched(copier)
	var pd, ad devmem.Driver = ps, as
	if copier == ps {
		pd = wd
	} else {
		ad = wd
	}
	p, _ := newDevAgent(t, cfg, pd)
	a, _ := newDevAgent(t, cfg, ad)
	pb, _ := filled(t, p, ps, passiveGPU, []int{size}, onDevice)
	ab, _ := side(t, a, []int{size})
	e := exposeLocals(t, p, agent.AccessWrite, pb.locals)
	copier.SetRate(64 << 20)
	copier.Record(true)
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: p.Info(), Key: e.Key(), Segments: segmentsOf(ab.locals, pb.regions(), 0)})
	require.NoError(t, err)
	t.Cleanup(func() { waitXfer(t, x) })
	select {
	case <-wd.enqueued("to-device"):
	case <-x.Done():
		return false
	case <-time.After(hangGuard):
		t.Fatalf("no lease staged within %v", hangGuard)
	}
	if isDone(x) {
		return false
	}
	require.NoError(t, CloseWithin(t, p, hangGuard, "Close during a peer's staged WRITE"))
	copier.Mark("closed", 0)()
	st := p.Stats()
	assert.Zero(t, st.StagingBuffers, "staging buffers in use after Close")
	assert.Zero(t, st.StagingBytes, "staging memory held after Close")
	err = waitXfer(t, x)
	t.Logf("WRITE over %s after the passive agent closed: %v", x.Path(), err)
	if err != nil {
		require.ErrorIs(t, err, agent.ErrRemoteLost)
	}
	time.Sleep(settle)
	events := copier.Events()
	copier.Record(false)
	copier.SetRate(0)
	require.Empty(t, lateCopies(events, "closed"), "copies into the device ended after Close returned\n%s", timeline(events))
	return err != nil
}

// killedMidStaging kills a passive child process while this process
// stages a large transfer to or from it: the transfer must fail with
// ErrRemoteLost within cfg.LostWithin, and leave no staging buffer in use.
func killedMidStaging(t *testing.T, cfg Config, op agent.Op) bool {
	const size = 16 << 20
	sim := devmem.NewSim(2)
	a, reach := newDevAgent(t, cfg, sim)
	c := startDevChild(t)
	remote := onHost
	if reach.remote {
		remote = onDevice
	}
	r := c.must(request{Cmd: "expose", Access: op.Access(), Sizes: []int{size}, Seed: pattern.NextSeed(), Dev: devMask(1, remote)})
	ab, _ := filled(t, a, sim, activeGPU, []int{size}, onDevice)
	sim.SetRate(32 << 20) // half a second of copies
	x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: c.info, Key: agent.Key(r.Key), Segments: segmentsOf(ab.locals, r.Regions, 0)})
	require.NoError(t, err)
	t.Cleanup(func() { waitXfer(t, x) })
	c.must(request{Cmd: "wait-access", ID: r.ID})
	if isDone(x) {
		return false
	}
	start := time.Now()
	c.Kill()
	err = waitXfer(t, x)
	lost := time.Since(start)
	inUse := a.Stats().StagingBuffers
	sim.SetRate(0)
	if err == nil {
		return false
	}
	requireLost(t, cfg, x, err, lost, "process was killed")
	require.Zero(t, inUse, "staging buffers in use once the transfer is done")
	return true
}

// killedMidLease kills an active child process while it transfers to or
// from this process's device memory, which this process stages for it:
// the exposure must hear of the lost peer within cfg.LostWithin, and the
// staging buffers its leases held must come back. For a WRITE, *torn is
// set to where the exposed memory holds neither its old bytes nor the
// written ones.
func killedMidLease(t *testing.T, cfg Config, op agent.Op, torn *error) bool {
	const size = 16 << 20
	ps := devmem.NewSim(2)
	p, _ := newDevAgent(t, cfg, ps)
	c := startDevChild(t)
	c.must(request{Cmd: "add-peer", Info: ptr(p.Info())})
	pb, pSeed := filled(t, p, ps, passiveGPU, []int{size}, onDevice)
	e := exposeLocals(t, p, op.Access(), pb.locals)
	ps.SetRate(32 << 20)
	wSeed := pattern.NextSeed()
	c.must(request{Cmd: "post", Op: op, Peer: p.ID(), Key: keyBytes(e.Key()), Regions: pb.regions(), Seed: wSeed, Async: true})
	deadline := time.Now().Add(hangGuard)
	for e.Peer() == uuid.Nil {
		require.True(t, time.Now().Before(deadline), "the child's transfer did not access the exposure within %v", hangGuard)
		time.Sleep(100 * time.Microsecond)
	}
	start := time.Now()
	c.Kill()
	requirePeerLost(t, cfg, e, c.info.ID, start, "process was killed")
	eventually(t, func() bool { return p.Stats().StagingBuffers == 0 }, "the staging buffers of the lost peer's leases come back")
	e.Revoke()
	ps.SetRate(0)
	if op == agent.OpRead {
		require.NoError(t, pb.Check(pSeed), "a READ leaves the exposed device memory alone")
	} else {
		// Every byte is the old or the new pattern: a WRITE cut short
		// must not leave in the device what a staging buffer held before.
		*torn = pb.oldOrNew(pSeed, wSeed)
	}
	return true
}
