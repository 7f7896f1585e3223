package connect

// Attack tests on GPU memory through connect (issue 14): the path each
// operation reports, a peer's WRITE that cannot reach this side's GPU, and
// closing Connectors with staged operations in flight. Tests that expose a
// defect are skipped unless ATTACK14=1; the others are promises that hold.

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/devmem"
)

// gpuBuf allocates n bytes on GPU dev of sim, filled with fill (zeros if
// nil), freed when the test ends.
func gpuBuf(t *testing.T, sim *devmem.Sim, dev, n int, fill []byte) uintptr {
	t.Helper()
	p, err := sim.Alloc(dev, n)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sim.Free(p) })
	if fill == nil {
		fill = make([]byte, n)
	}
	require.NoError(t, devmem.CopyToDevice(sim, dev, p, fill))
	return p
}

func gpuRead(t *testing.T, sim *devmem.Sim, dev int, p uintptr, n int) []byte {
	t.Helper()
	out := make([]byte, n)
	require.NoError(t, devmem.CopyToHost(sim, dev, out, p))
	return out
}

func random(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return b
}

// TestAttack14PathNamesStaging: Path is the backend's name when no GPU
// memory is involved, and says "+staging" when GPU memory on either side
// goes through pinned buffers.
func TestAttack14PathNamesStaging(t *testing.T) {
	sim := devmem.NewSim(2)
	const n = 300 << 10
	for _, backend := range transferBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive := newConnector(t, WithDevice(sim))
			act := newConnector(t, WithDevice(sim), WithBackend(backend))
			for _, c := range []struct {
				local, remote bool // GPU memory
				path          string
			}{
				{false, false, backend},
				{true, false, backend + "+staging"},
				{false, true, backend + "+staging"},
				{true, true, backend + "+staging"},
			} {
				src := random(n)
				desc := func(gpu bool, fill []byte) (Descriptor, func() []byte) {
					if !gpu {
						b := make([]byte, n)
						copy(b, fill)
						return NewDescriptor(b), func() []byte { return b }
					}
					p := gpuBuf(t, sim, 1, n, fill)
					return NewDeviceDescriptor(p, n, CUDA(1)), func() []byte { return gpuRead(t, sim, 1, p, n) }
				}
				rd, _ := desc(c.remote, src)
				ld, lget := desc(c.local, nil)
				op, err := passive.CreateReadable(ctx, rd)
				require.NoError(t, err)
				r, err := act.BeginRead(ctx, op.Metadata(), ld)
				require.NoError(t, err)
				require.NoError(t, r.Wait(ctx))
				require.NoError(t, op.Wait(ctx))
				require.NoError(t, op.Close())
				assert.Equal(t, c.path, r.Path(), "READ, local GPU %v, remote GPU %v", c.local, c.remote)
				require.True(t, bytes.Equal(src, lget()))

				wd, wget := desc(c.remote, nil)
				ld, _ = desc(c.local, src)
				wop, err := passive.CreateWritable(ctx, wd)
				require.NoError(t, err)
				w, err := act.BeginWrite(ctx, wop.Metadata(), ld)
				require.NoError(t, err)
				require.NoError(t, w.Wait(ctx))
				require.NoError(t, wop.Wait(ctx))
				require.NoError(t, wop.Close())
				assert.Equal(t, c.path, w.Path(), "WRITE, local GPU %v, remote GPU %v", c.local, c.remote)
				require.True(t, bytes.Equal(src, wget()))
			}
			for _, c := range []*Connector{passive, act} {
				assert.Zero(t, c.a.Stats().StagingBuffers)
			}
		})
	}
}

// h2dFails is a simulated device whose copies into device memory fail.
type h2dFails struct{ *devmem.Sim }

func (d h2dFails) NewStream(dev int) (devmem.Stream, error) {
	s, err := d.Sim.NewStream(dev)
	return h2dFailStream{s}, err
}

type h2dFailStream struct{ devmem.Stream }

func (h2dFailStream) ToDevice(uintptr, []byte) error {
	return errors.New("injected: the copy into the GPU failed")
}

// missedWrite has a peer WRITE into this side's GPU memory over backend
// while every copy into the device fails, and returns both sides' errors.
// Over "cma" the GPU memory is staged (the device path off on this side),
// and the copies the passive agent makes into its device fail; over
// "cma+ipc" the active side maps it and its own copies into the mapped
// GPU memory fail.
func missedWrite(t *testing.T, backend string) (activeErr, passiveErr error) {
	t.Helper()
	sim := devmem.NewSim(2)
	const n = 256 << 10
	ctx := guarded(t)
	var passive, act *Connector
	switch backend {
	case "cma":
		passive = newConnector(t, WithDevice(h2dFails{sim}), WithCMAOptions(cma.WithDeviceIPC(false)))
		act = newConnector(t, WithDevice(sim), WithBackend(backend))
	case "cma+ipc":
		passive = newConnector(t, WithDevice(sim))
		act = newConnector(t, WithDevice(h2dFails{sim}), WithBackend("cma"))
	default:
		passive = newConnector(t, WithDevice(h2dFails{sim}))
		act = newConnector(t, WithDevice(sim), WithBackend(backend))
	}
	p := gpuBuf(t, sim, 1, n, nil)
	wop, err := passive.CreateWritable(ctx, NewDeviceDescriptor(p, n, CUDA(1)))
	require.NoError(t, err)
	defer wop.Close()
	w, err := act.BeginWrite(ctx, wop.Metadata(), NewDescriptor(random(n)))
	require.NoError(t, err)
	activeErr = w.Wait(ctx)
	passiveErr = wop.Wait(ctx)
	assert.Equal(t, StatusErrored, wop.Status())
	t.Logf("%s over %s: active: %v; passive: %v", backend, w.Path(), activeErr, passiveErr)
	return activeErr, passiveErr
}

// TestAttack14PeerWriteThatMissesTheGPU: a peer WRITEs into this side's GPU
// memory and every copy into the device fails. docs/gpu.md: "a chunk
// written into the peer's GPU memory is acknowledged only once it is in
// the device", and the passive operation "ends with an error ... instead
// of completing". Neither side may report success, staged (mem, tcp, cma
// with its device path off) or mapped (cma+ipc).
func TestAttack14PeerWriteThatMissesTheGPU(t *testing.T) {
	for _, backend := range []string{"mem", "tcp", "cma", "cma+ipc"} {
		t.Run(backend, func(t *testing.T) {
			aerr, perr := missedWrite(t, backend)
			require.Error(t, perr, "the passive side completed a WRITE that never reached its GPU")
			require.Error(t, aerr, "the active side reported success for a WRITE that never reached the peer's GPU")
		})
	}
}

// TestAttack14PassiveErrorWrapsErrStaging: docs/gpu.md says the passive
// operation then ends "with an error (wrapping agent.ErrStaging)" when its
// agent's staging failed.
func TestAttack14PassiveErrorWrapsErrStaging(t *testing.T) {
	for _, backend := range []string{"mem", "tcp", "cma"} {
		t.Run(backend, func(t *testing.T) {
			_, perr := missedWrite(t, backend)
			require.ErrorIs(t, perr, agent.ErrStaging)
		})
	}
}

// TestAttack14CloseWithStagedOperationsInFlight: Connectors closed while
// staged READs and WRITEs of GPU memory are in flight, on both sides: the
// operations end, every staging buffer comes back, and pinned memory is
// freed.
func TestAttack14CloseWithStagedOperationsInFlight(t *testing.T) {
	for _, backend := range transferBackends {
		for _, which := range []string{"active", "passive"} {
			t.Run(backend+"-"+which, func(t *testing.T) {
				ctx := guarded(t)
				sim := devmem.NewSim(2)
				sim.SetRate(256 << 20) // 1 MiB copies take ~4 ms: the close lands mid-pipeline
				passive := startConnector(t, WithDevice(sim), WithStaging(256<<10, 4<<20))
				act := startConnector(t, WithDevice(sim), WithStaging(256<<10, 4<<20), WithBackend(backend))
				const n = 4 << 20
				var waits []func() error
				for i := range 4 {
					rp := gpuBuf(t, sim, i%2, n, nil)
					lp := gpuBuf(t, sim, (i+1)%2, n, nil)
					if i%2 == 0 {
						op, err := passive.CreateReadable(ctx, NewDeviceDescriptor(rp, n, CUDA(i%2)))
						require.NoError(t, err)
						r, err := act.BeginRead(ctx, op.Metadata(), NewDeviceDescriptor(lp, n, CUDA((i+1)%2)))
						require.NoError(t, err)
						waits = append(waits, func() error { return r.Wait(ctx) })
					} else {
						op, err := passive.CreateWritable(ctx, NewDeviceDescriptor(rp, n, CUDA(i%2)))
						require.NoError(t, err)
						w, err := act.BeginWrite(ctx, op.Metadata(), NewDeviceDescriptor(lp, n, CUDA((i+1)%2)))
						require.NoError(t, err)
						waits = append(waits, func() error { return w.Wait(ctx) })
					}
				}
				first, second := act, passive
				if which == "passive" {
					first, second = passive, act
				}
				require.NoError(t, first.Close())
				for _, wait := range waits {
					_ = wait() // any outcome; it must end
				}
				require.NoError(t, second.Close())
				for _, c := range []*Connector{passive, act} {
					st := c.a.Stats()
					assert.Zero(t, st.StagingBuffers, "staging buffers in use after Close")
					assert.Zero(t, st.StagingBytes, "pinned memory held after Close")
				}
			})
		}
	}
}
