//go:build linux

package cma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
	"github.com/goxfer/goxfer/agent/devmem"
)

// newVMMBuf is newGBuf in memory of AllocShareable (a VMM allocation,
// shared by file descriptor).
func newVMMBuf(t testing.TB, sim *devmem.Sim, n int, fill []byte) gbuf {
	t.Helper()
	all := bytes.Repeat([]byte{0xEE}, n+2*guardLen)
	copy(all[guardLen:], fill)
	p, err := sim.AllocShareable(1, len(all))
	require.NoError(t, err)
	t.Cleanup(func() { _ = sim.Free(p) })
	require.NoError(t, devmem.CopyToDevice(sim, 1, p, all))
	return gbuf{sim: sim, vram: true, base: p, n: n}
}

// mappingsDrop waits until sim has want imported mappings open.
func mappingsDrop(t testing.TB, sim *devmem.Sim, want int, what string) {
	t.Helper()
	require.Eventually(t, func() bool { return sim.Mappings() == want }, 10*time.Second, time.Millisecond,
		"%s: %d mappings open, want %d", what, sim.Mappings(), want)
}

// READ and WRITE of a peer's GPU memory, cudaMalloc-style (a handle) and
// VMM (a file descriptor over the socket), into GPU or host memory here,
// in one window or several: every byte arrives, the guards stay intact,
// the path is "cma+ipc", no staging buffer is used on either side, the
// notification comes after the bytes, and the mappings go once the
// exposure is revoked.
func TestIPCReadWrite(t *testing.T) {
	sim := devmem.NewSim(2)
	act, _ := ipcAgent(t, sim, 0, WithDeviceWindow(4<<20))
	pas, _ := ipcAgent(t, sim, 0)
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		for _, vmm := range []bool{false, true} {
			for _, localVRAM := range []bool{true, false} {
				for _, n := range []int{1, 4096 + 3, 3<<20 + 17, 13<<20 + 5} {
					name := fmt.Sprintf("%v/vmm=%v/local=%s/%d", op, vmm, kindName(localVRAM), n)
					t.Run(name, func(t *testing.T) {
						src := randomBytes(n)
						var lfill, rfill []byte
						if op == agent.OpWrite {
							lfill = src
						} else {
							rfill = src
						}
						loc := newGBuf(t, sim, localVRAM, n, lfill)
						var rem gbuf
						if vmm {
							rem = newVMMBuf(t, sim, n, rfill)
						} else {
							rem = newGBuf(t, sim, true, n, rfill)
						}
						exp, err := pas.Expose(op.Access(), []agent.Local{rem.local()})
						require.NoError(t, err)
						x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(), Notify: []byte("done"),
							Segments: []agent.Segment{{Local: loc.local(), Remote: rem.local().Region}}})
						require.NoError(t, err)
						backendtest.DoneWithin(t, x, 30*time.Second, name)
						require.NoError(t, x.Err())
						assert.Equal(t, Name+"+ipc", x.Path())
						loc.check(t, src, "the local buffer")
						rem.check(t, src, "the peer's buffer")
						ev := event(t, exp)
						require.Equal(t, agent.EventNotify, ev.Kind)
						require.NoError(t, ev.Err)
						assert.Zero(t, pas.Stats().StagingBuffers, "staging buffers of the exposing side")
						assert.Zero(t, act.Stats().StagingBuffers, "staging buffers of the copying side")
						assert.Equal(t, 1, sim.Mappings(), "the peer's allocation is mapped once")
						exp.Revoke()
						mappingsDrop(t, sim, 0, "after Revoke")
					})
				}
			}
		}
	}
}

// Which path a transfer takes: device memory on either side goes over
// IPC, except local GPU memory against the peer's host memory (staged by
// this agent); with the path off on either side, everything with GPU
// memory is staged.
func TestIPCPathChoice(t *testing.T) {
	sim := devmem.NewSim(2)
	on, _ := ipcAgent(t, sim, 0)
	on2, _ := ipcAgent(t, sim, 0)
	off, _ := devAgent(t, sim, 0)
	for _, tc := range []struct {
		name          string
		act, pas      *agent.Agent
		local, remote bool // GPU memory
		want          string
	}{
		{"vram-vram", on, on2, true, true, Name + "+ipc"},
		{"dram-vram", on, on2, false, true, Name + "+ipc"},
		{"vram-dram", on, on2, true, false, Name + "+staging"},
		{"dram-dram", on, on2, false, false, Name + "+table"}, // host memory of one region: the lease table, no lease
		{"off-active", off, on, true, true, Name + "+staging"},
		{"off-passive", on, off, true, true, Name + "+staging"},
		{"off-passive-dram", on, off, false, true, Name + "+staging"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 100 << 10
			src := randomBytes(n)
			loc := newGBuf(t, sim, tc.local, n, nil)
			rem := newGBuf(t, sim, tc.remote, n, src)
			exp, err := tc.pas.Expose(agent.AccessRead, []agent.Local{rem.local()})
			require.NoError(t, err)
			defer exp.Revoke()
			x, err := tc.act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: tc.pas.Info(), Key: exp.Key(),
				Segments: []agent.Segment{{Local: loc.local(), Remote: rem.local().Region}}})
			require.NoError(t, err)
			backendtest.DoneWithin(t, x, 30*time.Second, tc.name)
			require.NoError(t, x.Err())
			assert.Equal(t, tc.want, x.Path())
			loc.check(t, src, "the local buffer")
		})
	}
}

// Two exposures of one allocation (different ranges): the allocation is
// shared once on the connection and mapped once; revoking one exposure
// keeps the mapping for the other, whose transfers still work; revoking
// the other drops it.
func TestIPCTwoExposuresOneAllocation(t *testing.T) {
	for _, vmm := range []bool{false, true} {
		t.Run(fmt.Sprintf("vmm=%v", vmm), func(t *testing.T) {
			sim := devmem.NewSim(2)
			act, _ := ipcAgent(t, sim, 0)
			pas, _ := ipcAgent(t, sim, 0)
			const n = 1 << 20
			src := randomBytes(2 * n)
			var whole gbuf
			if vmm {
				whole = newVMMBuf(t, sim, 2*n, src)
			} else {
				whole = newGBuf(t, sim, true, 2*n, src)
			}
			base := whole.local().Addr
			first, err := pas.Expose(agent.AccessRead, []agent.Local{agent.Device(uintptr(base), n, agent.KindVRAM, 1)})
			require.NoError(t, err)
			second, err := pas.Expose(agent.AccessRead, []agent.Local{agent.Device(uintptr(base)+n, n, agent.KindVRAM, 1)})
			require.NoError(t, err)
			defer second.Revoke()
			read := func(exp *agent.Exposure, off uint64) error {
				dst := newGBuf(t, sim, true, n, nil)
				x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(),
					Segments: []agent.Segment{{Local: dst.local(), Remote: agent.Region{Addr: base + off, Len: n, Kind: agent.KindVRAM, Device: 1}}}})
				if err != nil {
					return err
				}
				backendtest.DoneWithin(t, x, 30*time.Second, "a READ of one exposure")
				if x.Err() == nil {
					assert.Equal(t, Name+"+ipc", x.Path())
					dst.check(t, src[off:off+n], "the READ")
				}
				return x.Err()
			}
			require.NoError(t, read(first, 0))
			require.NoError(t, read(second, n))
			assert.Equal(t, 1, sim.Mappings(), "one allocation, one mapping")
			// Outside the exposure, though inside the mapped allocation: refused.
			require.ErrorIs(t, read(first, n), agent.ErrAccessDenied)
			first.Revoke()
			require.ErrorIs(t, read(first, 0), agent.ErrAccessDenied)
			// The mapping served the other exposure too: it stays.
			time.Sleep(50 * time.Millisecond)
			assert.Equal(t, 1, sim.Mappings(), "the mapping of an allocation another exposure still uses")
			require.NoError(t, read(second, n))
			second.Revoke()
			mappingsDrop(t, sim, 0, "both exposures revoked")
		})
	}
}

// Revoke while the peer holds the mapping and copies through it: Revoke
// returns once the peer's leases ended, after which no byte of a WRITE
// lands in the device; the transfer ends either way, refused or complete;
// the peer drops its mapping; a READ with the old key is refused.
func TestIPCRevokeWhileMapped(t *testing.T) {
	backendtest.Watchdog(t, 2*time.Minute)
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		t.Run(op.String(), func(t *testing.T) {
			sim := devmem.NewSim(2)
			sim.SetRate(1 << 30) // 64 MiB of device copies take 60 ms or so
			act, _ := ipcAgent(t, sim, 0, WithDeviceWindow(4<<20))
			pas, _ := ipcAgent(t, sim, 0)
			const n = 64 << 20
			src := randomBytes(n)
			var rfill, lfill []byte
			if op == agent.OpRead {
				rfill = src
			} else {
				lfill = src
			}
			rem := newGBuf(t, sim, true, n, rfill)
			loc := newGBuf(t, sim, true, n, lfill)
			for round := range 3 {
				exp, err := pas.Expose(op.Access(), []agent.Local{rem.local()})
				require.NoError(t, err)
				x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(),
					Segments: []agent.Segment{{Local: loc.local(), Remote: rem.local().Region}}})
				require.NoError(t, err)
				deadline := time.Now().Add(10 * time.Second)
				for sim.Mappings() == 0 && !backendtest.Finished(x) && time.Now().Before(deadline) {
					time.Sleep(100 * time.Microsecond)
				}
				time.Sleep(time.Duration(round) * 10 * time.Millisecond)
				exp.Revoke()
				after := rem.all(t)
				backendtest.DoneWithin(t, x, 30*time.Second, "a transfer whose exposure was revoked")
				if err := x.Err(); err != nil {
					require.ErrorIs(t, err, agent.ErrAccessDenied, "round %d", round)
				}
				time.Sleep(20 * time.Millisecond)
				require.True(t, bytes.Equal(after, rem.all(t)), "round %d: the device changed after Revoke returned", round)
				mappingsDrop(t, sim, 0, "after Revoke")
				x, err = act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(),
					Segments: []agent.Segment{{Local: loc.local(), Remote: rem.local().Region}}})
				require.NoError(t, err)
				backendtest.DoneWithin(t, x, 30*time.Second, "a READ with a revoked key")
				require.ErrorIs(t, x.Err(), agent.ErrAccessDenied)
				assert.Zero(t, sim.Mappings(), "a refused lease maps nothing")
			}
		})
	}
}

// The peer departs (its agent closes) while this side holds its mapping:
// the connection ends and the mapping goes; and the copying side's own
// Close drops what it mapped.
func TestIPCDepartureUnmaps(t *testing.T) {
	sim := devmem.NewSim(2)
	act, _ := ipcAgent(t, sim, 0)
	for _, closing := range []string{"exposing", "copying"} {
		t.Run(closing, func(t *testing.T) {
			pas, err := agent.New(agent.WithBackends(New()), agent.WithDevice(sim))
			require.NoError(t, err)
			copier := act
			if closing == "copying" {
				copier, err = agent.New(agent.WithBackends(New()), agent.WithDevice(sim))
				require.NoError(t, err)
			}
			const n = 1 << 20
			src := randomBytes(n)
			rem := newGBuf(t, sim, true, n, src)
			exp, err := pas.Expose(agent.AccessRead, []agent.Local{rem.local()})
			require.NoError(t, err)
			dst := newGBuf(t, sim, true, n, nil)
			x, err := copier.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(),
				Segments: []agent.Segment{{Local: dst.local(), Remote: rem.local().Region}}})
			require.NoError(t, err)
			backendtest.DoneWithin(t, x, 30*time.Second, "a READ")
			require.NoError(t, x.Err())
			require.Equal(t, Name+"+ipc", x.Path())
			dst.check(t, src, "the READ")
			require.Equal(t, 1, sim.Mappings())
			if closing == "copying" {
				require.NoError(t, copier.Close())
				mappingsDrop(t, sim, 0, "the copying agent closed")
				require.NoError(t, pas.Close())
				return
			}
			require.NoError(t, pas.Close())
			mappingsDrop(t, sim, 0, "the exposing agent departed")
		})
	}
}

// GPU memory the exposing side cannot share (here a mapping it imported
// itself, which only its owner exports) is staged by its agent instead,
// within its staging pool: the copier's windows over it shrink to a
// staged lease's size after the first grant, so a transfer much larger
// than the pool still moves, and every byte arrives.
func TestIPCUnshareableStaged(t *testing.T) {
	sim := devmem.NewSim(2)
	act, _ := ipcAgent(t, sim, 0)
	pas, _ := ipcAgent(t, sim, 8<<20) // 4 MiB for peers' leases
	const n = 40<<20 + 3
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		t.Run(op.String(), func(t *testing.T) {
			src := randomBytes(n)
			var rfill, lfill []byte
			if op == agent.OpRead {
				rfill = src
			} else {
				lfill = src
			}
			owner := newGBuf(t, sim, true, n, rfill)
			sh, err := sim.Export(owner.base, 1)
			require.NoError(t, err)
			m, err := sim.Import(sh, -1)
			require.NoError(t, err)
			defer m.Close()
			remote := agent.Device(m.Ptr()+guardLen, n, agent.KindVRAM, uint32(m.Dev()))
			_, err = sim.Export(m.Ptr(), m.Dev())
			require.ErrorIs(t, err, devmem.ErrNotShareable, "the exposed memory cannot be shared")
			exp, err := pas.Expose(op.Access(), []agent.Local{remote})
			require.NoError(t, err)
			defer exp.Revoke()
			for _, localVRAM := range []bool{true, false} {
				loc := newGBuf(t, sim, localVRAM, n, lfill)
				x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(),
					Segments: []agent.Segment{{Local: loc.local(), Remote: remote.Region}}})
				require.NoError(t, err)
				backendtest.DoneWithin(t, x, time.Minute, "a transfer of unshareable GPU memory")
				require.NoError(t, x.Err(), "local GPU memory: %v", localVRAM)
				loc.check(t, src, "the local buffer")
				owner.check(t, src, "the peer's buffer")
				// A READ's last lease end goes to the peer unanswered, so
				// the peer may release its staging just after Done: wait.
				require.Eventually(t, func() bool { return pas.Stats().StagingBuffers == 0 }, 10*time.Second, time.Millisecond,
					"staging buffers of the exposing side still in use 10 s after the transfer")
			}
		})
	}
}

// exportFails is the simulator, whose exports fail as a driver call may.
type exportFails struct{ *devmem.Sim }

func (exportFails) Export(uintptr, int) (devmem.Share, error) {
	return devmem.Share{}, errors.New("injected: the driver could not export the allocation")
}

// An exposing side whose driver fails to export its GPU memory stages it
// instead: the transfer completes, and the connection stays up.
func TestIPCExportFailureStages(t *testing.T) {
	sim := devmem.NewSim(2)
	act, ab := ipcAgent(t, sim, 0)
	pas, _ := ipcAgent(t, exportFails{sim}, 0)
	const n = 9<<20 + 1
	src := randomBytes(n)
	rem := newGBuf(t, sim, true, n, src)
	exp, err := pas.Expose(agent.AccessRead, []agent.Local{rem.local()})
	require.NoError(t, err)
	defer exp.Revoke()
	for range 2 {
		loc := newGBuf(t, sim, true, n, nil)
		x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(),
			Segments: []agent.Segment{{Local: loc.local(), Remote: rem.local().Region}}})
		require.NoError(t, err)
		backendtest.DoneWithin(t, x, 30*time.Second, "a READ of GPU memory its driver cannot export")
		require.NoError(t, x.Err())
		loc.check(t, src, "the READ")
	}
	assert.Zero(t, sim.Mappings(), "nothing mapped")
	assert.Zero(t, ab.Stats().ProtocolErrors)
}
