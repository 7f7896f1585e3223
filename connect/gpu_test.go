package connect

import (
	"bytes"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/devmem"
)

// noDriver is a device driver that is not there, as on a machine without
// the NVIDIA driver.
type noDriver struct{}

func (noDriver) Name() string                         { return "cuda" }
func (noDriver) Devices() (int, error)                { return 0, devmem.ErrUnavailable }
func (noDriver) Check(uintptr, uint64, int) error     { return devmem.ErrUnavailable }
func (noDriver) Alloc(int, int) (uintptr, error)      { return 0, devmem.ErrUnavailable }
func (noDriver) Free(uintptr) error                   { return devmem.ErrUnavailable }
func (noDriver) HostAlloc(int) ([]byte, error)        { return nil, devmem.ErrUnavailable }
func (noDriver) HostFree([]byte) error                { return devmem.ErrUnavailable }
func (noDriver) NewStream(int) (devmem.Stream, error) { return nil, devmem.ErrUnavailable }

func TestGPUWithoutDriverFailsAtCreateAndBegin(t *testing.T) {
	ctx := guarded(t)
	passive := newConnector(t, WithDevice(noDriver{}))
	activeConn := newConnector(t, WithDevice(noDriver{}), WithBackend("mem"))
	assert.False(t, passive.CUDAAvailable())
	gpu := NewDeviceDescriptor(0xdead0000, 4096, CUDA(1))
	for _, create := range []func() error{
		func() error { _, err := passive.CreateReadable(ctx, gpu); return err },
		func() error { _, err := passive.CreateWritable(ctx, gpu); return err },
	} {
		err := create()
		require.ErrorIs(t, err, ErrInvalidDescriptor)
		require.ErrorIs(t, err, devmem.ErrUnavailable)
	}
	pop := expose(t, passive, KindRead, buffers([]int{4096}, 1))
	_, err := activeConn.BeginRead(ctx, pop.Metadata(), gpu)
	require.ErrorIs(t, err, ErrInvalidDescriptor)
	require.ErrorIs(t, err, devmem.ErrUnavailable)
	requireUnregistered(t, activeConn)
}

func TestGPUDescriptorCheckedAtCreate(t *testing.T) {
	ctx := guarded(t)
	sim := devmem.NewSim(2)
	c := newConnector(t, WithDevice(sim))
	assert.True(t, c.CUDAAvailable())
	p, err := sim.Alloc(1, 8192)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sim.Free(p) })
	for _, d := range []Descriptor{
		NewDeviceDescriptor(p, 8192, CUDA(0)),      // the wrong GPU
		NewDeviceDescriptor(p+4096, 8192, CUDA(1)), // past the allocation's end
		NewDeviceDescriptor(0xdead0000, 16, CUDA(1)),
	} {
		_, err := c.CreateReadable(ctx, NewDescriptor(make([]byte, 8)), d)
		require.ErrorIs(t, err, ErrInvalidDescriptor)
		require.ErrorIs(t, err, devmem.ErrNotDevice)
		assert.Contains(t, err.Error(), "region 1")
	}
	op, err := c.CreateReadable(ctx, NewDeviceDescriptor(p, 8192, CUDA(1)))
	require.NoError(t, err)
	require.NoError(t, op.Close())
	requireUnregistered(t, c)
}

// TestGPUReadWriteThroughStaging moves simulated GPU memory on both sides
// over each host backend: the agent stages it through pinned buffers, or,
// over cma, the backend maps the peer's GPU memory and copies it on this
// side's GPU ("cma+ipc"), except local GPU memory facing the peer's host
// memory, which is staged.
func TestGPUReadWriteThroughStaging(t *testing.T) {
	sim := devmem.NewSim(2)
	const n = 3<<20 + 17
	alloc := func(t *testing.T, fill []byte) uintptr {
		p, err := sim.Alloc(1, n)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sim.Free(p) })
		if fill != nil {
			require.NoError(t, devmem.CopyToDevice(sim, 1, p, fill))
		}
		return p
	}
	read := func(t *testing.T, p uintptr) []byte {
		out := make([]byte, n)
		require.NoError(t, devmem.CopyToHost(sim, 1, out, p))
		return out
	}
	for _, backend := range []string{"mem", "tcp", "cma"} {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive := newConnector(t, WithDevice(sim), WithStaging(256<<10, 8<<20))
			act := newConnector(t, WithDevice(sim), WithStaging(256<<10, 8<<20), WithBackend(backend))
			src := make([]byte, n)
			for i := range src {
				src[i] = byte(rand.Uint32())
			}
			// READ: the peer's GPU into a local GPU.
			rp, lp := alloc(t, src), alloc(t, nil)
			rop, err := passive.CreateReadable(ctx, NewDeviceDescriptor(rp, n, CUDA(1)))
			require.NoError(t, err)
			rd, err := act.BeginRead(ctx, rop.Metadata(), NewDeviceDescriptor(lp, n, CUDA(1)))
			require.NoError(t, err)
			require.NoError(t, rd.Wait(ctx))
			require.NoError(t, rop.Wait(ctx))
			assert.Equal(t, gpuPath(backend), rd.Path())
			require.True(t, bytes.Equal(src, read(t, lp)), "READ moved the bytes")
			require.NoError(t, rop.Close())

			// WRITE: a local GPU into host memory of the peer, then host
			// memory into the peer's GPU.
			host := make([]byte, n)
			wop, err := passive.CreateWritable(ctx, NewDescriptor(host))
			require.NoError(t, err)
			wr, err := act.BeginWrite(ctx, wop.Metadata(), NewDeviceDescriptor(lp, n, CUDA(1)))
			require.NoError(t, err)
			require.NoError(t, wr.Wait(ctx))
			require.NoError(t, wop.Wait(ctx))
			require.NoError(t, wop.Close())
			require.True(t, bytes.Equal(src, host), "WRITE from the GPU moved the bytes")

			gp := alloc(t, nil)
			gop, err := passive.CreateWritable(ctx, NewDeviceDescriptor(gp, n, CUDA(1)))
			require.NoError(t, err)
			wr2, err := act.BeginWrite(ctx, gop.Metadata(), NewDescriptor(host))
			require.NoError(t, err)
			require.NoError(t, wr2.Wait(ctx))
			require.NoError(t, gop.Wait(ctx))
			require.NoError(t, gop.Close())
			assert.Equal(t, gpuPath(backend), wr2.Path())
			require.True(t, bytes.Equal(src, read(t, gp)), "WRITE into the GPU moved the bytes")
			for _, c := range []*Connector{passive, act} {
				st := c.a.Stats()
				assert.Zero(t, st.StagingBuffers, "staging buffers in use after every operation ended")
			}
		})
	}
}

// gpuPath is the path of a transfer with the peer's GPU memory over
// backend, between simulated devices: cma maps it (same-host device
// path), the others stage it.
func gpuPath(backend string) string {
	if backend == "cma" {
		return "cma+ipc"
	}
	return backend + "+staging"
}
