package agent

import (
	"bytes"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/devmem"
)

// simAgent is an agent over a stub backend whose device memory is
// simulated, with a VRAM exposure of n bytes for acc.
func simAgent(t *testing.T, acc Access, n int, fill []byte) (*Agent, *devmem.Sim, *Exposure, uintptr) {
	t.Helper()
	sim := devmem.NewSim(1)
	a, err := New(WithBackends(&stubBackend{name: "stub"}), WithDevice(sim), WithStaging(64<<10, 1<<20))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, a.Close()) })
	p, err := sim.Alloc(0, n)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sim.Free(p) })
	if fill != nil {
		require.NoError(t, devmem.CopyToDevice(sim, 0, p, fill))
	}
	e, err := a.Expose(acc, []Local{Device(p, n, KindVRAM, 0)})
	require.NoError(t, err)
	return a, sim, e, p
}

// TestLeaseRenewKeepsStaging fills a WRITE lease's staging buffer across a
// renewal, as tcp does for a frame trickling in: the bytes written after
// the renewal must reach the device.
func TestLeaseRenewKeepsStaging(t *testing.T) {
	const n = 8192
	a, sim, e, p := simAgent(t, AccessWrite, n, nil)
	l, err := a.open(NewLink(uuid.New()), e.Key(), AccessWrite, true)
	require.NoError(t, err)
	buf, err := l.Slice(uint64(p), n)
	require.NoError(t, err)
	require.Len(t, buf, n)
	copy(buf[:n/2], bytes.Repeat([]byte{1}, n/2))
	require.NoError(t, l.Renew())
	copy(buf[n/2:], bytes.Repeat([]byte{2}, n/2))
	require.NoError(t, l.Flush())
	l.Release()
	got := make([]byte, n)
	require.NoError(t, devmem.CopyToHost(sim, 0, got, p))
	require.Equal(t, append(bytes.Repeat([]byte{1}, n/2), bytes.Repeat([]byte{2}, n/2)...), got)
	require.Zero(t, a.Stats().StagingBuffers)

	// Once revoked, Renew releases the lease and says so; Revoke returns.
	l, err = a.open(NewLink(uuid.New()), e.Key(), AccessWrite, true)
	require.NoError(t, err)
	_, err = l.Slice(uint64(p), 100)
	require.NoError(t, err)
	done := make(chan struct{})
	go func() { e.Revoke(); close(done) }()
	for {
		if err = l.Renew(); err != nil {
			break
		}
	}
	require.ErrorIs(t, err, ErrAccessDenied)
	<-done
	require.Zero(t, a.Stats().StagingBuffers)
}

// TestLeaseStagesReadAndRefusesOversize checks a READ lease's staged copy
// and the refusal of a lease that would need more than its pool half.
func TestLeaseStagesReadAndRefusesOversize(t *testing.T) {
	const n = 1 << 20
	src := make([]byte, n)
	for i := range src {
		src[i] = byte(i * 7)
	}
	a, _, e, p := simAgent(t, AccessRead, n, src)
	l, err := a.open(NewLink(uuid.New()), e.Key(), AccessRead, true)
	require.NoError(t, err)
	b, err := l.Slice(uint64(p)+100, 4000)
	require.NoError(t, err)
	require.Equal(t, src[100:4100], b)
	_, err = l.Slice(uint64(p), n) // the lease pool is half of 1 MiB
	require.ErrorIs(t, err, ErrStaging)
	l.Release()

	// A backend that does not stage gets nil for device memory, as before.
	l, err = a.open(NewLink(uuid.New()), e.Key(), AccessRead, false)
	require.NoError(t, err)
	b, err = l.Slice(uint64(p), 16)
	require.NoError(t, err)
	require.Nil(t, b)
	l.Release()
	require.Zero(t, a.Stats().StagingBuffers)
}

// failingDevice fails every copy into device memory.
type failingDevice struct{ *devmem.Sim }

func (d failingDevice) NewStream(dev int) (devmem.Stream, error) {
	s, err := d.Sim.NewStream(dev)
	return failingStream{s}, err
}

type failingStream struct{ devmem.Stream }

func (failingStream) ToDevice(uintptr, []byte) error { return errors.New("injected H2D failure") }

// TestLeaseFlushFailureReachesNotification checks that a WRITE that did not
// reach device memory is carried by the exposure's next notification.
func TestLeaseFlushFailureReachesNotification(t *testing.T) {
	sim := devmem.NewSim(1)
	a, err := New(WithBackends(&stubBackend{name: "stub"}), WithDevice(failingDevice{sim}))
	require.NoError(t, err)
	defer func() { require.NoError(t, a.Close()) }()
	p, err := sim.Alloc(0, 4096)
	require.NoError(t, err)
	defer func() { _ = sim.Free(p) }()
	e, err := a.Expose(AccessWrite, []Local{Device(p, 4096, KindVRAM, 0)})
	require.NoError(t, err)
	link := NewLink(uuid.New())
	l, err := a.open(link, e.Key(), AccessWrite, true)
	require.NoError(t, err)
	_, err = l.Slice(uint64(p), 4096)
	require.NoError(t, err)
	err = l.Flush()
	require.ErrorIs(t, err, ErrStaging)
	require.ErrorContains(t, err, "injected H2D failure")
	l.Release()
	require.True(t, a.deliver(link, e.Key(), []byte("done")))
	ev := <-e.Events()
	require.Equal(t, EventNotify, ev.Kind)
	require.ErrorIs(t, ev.Err, ErrStaging)
	e.Revoke()
}
