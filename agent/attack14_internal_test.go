package agent

// Attack tests on GPU memory staging (issue 14), at the level of the lease
// a backend holds for a peer's access. The external tests are in
// attack14_test.go; this file also lends them a hook on the lease wait.

import (
	"bytes"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/devmem"
)

// SetStageWaitForTest shortens how long a lease waits for a staging buffer
// (10 s) and returns the function that restores it. For tests only, in
// this package and in agent_test: call it before any lease can wait, and
// restore it once none can.
func SetStageWaitForTest(d time.Duration) (restore func()) {
	old := stageWait
	stageWait = d
	return func() { stageWait = old }
}

// stageAgent is an agent over a stub backend with simulated GPUs and the
// given staging pool, and a zero-filled VRAM exposure of n bytes on GPU 0
// for acc.
func stageAgent(t *testing.T, sim *devmem.Sim, pool int, acc Access, n int) (*Agent, *Exposure, uintptr) {
	t.Helper()
	a, err := New(WithBackends(&stubBackend{name: "stub"}), WithDevice(sim), WithStaging(64<<10, pool))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, a.Close()) })
	p := simAlloc(t, sim, 0, n, nil)
	e, err := a.Expose(acc, []Local{Device(p, n, KindVRAM, 0)})
	require.NoError(t, err)
	return a, e, p
}

func simAlloc(t *testing.T, sim *devmem.Sim, dev, n int, fill []byte) uintptr {
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

// nonZero counts the bytes of b that are not zero.
func nonZero(b []byte) int {
	n := 0
	for _, c := range b {
		if c != 0 {
			n++
		}
	}
	return n
}

func simRead(t *testing.T, sim *devmem.Sim, dev int, p uintptr, n int) []byte {
	t.Helper()
	out := make([]byte, n)
	require.NoError(t, devmem.CopyToHost(sim, dev, out, p))
	return out
}

// TestAttack14UnfilledWriteLeaseFlushesStaleBytes: a backend takes a WRITE
// lease, Slices the frame's pieces (tcp does so for every piece before it
// reads the payload), and then the payload never arrives: the peer hangs
// up, or the exposure is revoked and Renew ends the lease. Release then
// copies the whole staging buffer into the device: bytes the peer never
// sent, left in the pooled pinned buffer by an earlier access, here
// another exposure's (another peer's) data. With host memory the
// untouched bytes stay as they were.
func TestAttack14UnfilledWriteLeaseFlushesStaleBytes(t *testing.T) {
	const n = 64 << 10
	sim := devmem.NewSim(1)
	a, err := New(WithBackends(&stubBackend{name: "stub"}), WithDevice(sim), WithStaging(64<<10, 4<<20))
	require.NoError(t, err)
	defer func() { require.NoError(t, a.Close()) }()
	secretP := simAlloc(t, sim, 0, n, nil)
	victimP := simAlloc(t, sim, 0, n, nil)
	revokedP := simAlloc(t, sim, 0, n, nil)
	secret, err := a.Expose(AccessWrite, []Local{Device(secretP, n, KindVRAM, 0)})
	require.NoError(t, err)
	defer secret.Revoke()
	victim, err := a.Expose(AccessWrite, []Local{Device(victimP, n, KindVRAM, 0)})
	require.NoError(t, err)
	defer victim.Revoke()
	revoked, err := a.Expose(AccessWrite, []Local{Device(revokedP, n, KindVRAM, 0)})
	require.NoError(t, err)

	// Peer A writes its secret; the staging buffer goes back to the pool.
	writeSecret := func() {
		l, err := a.open(NewLink(uuid.New()), secret.Key(), AccessWrite, true)
		require.NoError(t, err)
		b, err := l.Slice(uint64(secretP), n)
		require.NoError(t, err)
		copy(b, bytes.Repeat([]byte{0xAA}, n))
		require.NoError(t, l.Flush())
		l.Release()
	}
	writeSecret()

	// Peer B's frame: the pieces are sliced, the payload never comes.
	l, err := a.open(NewLink(uuid.New()), victim.Key(), AccessWrite, true)
	require.NoError(t, err)
	_, err = l.Slice(uint64(victimP), n)
	require.NoError(t, err)
	l.Release() // the connection broke before the payload
	assert.Zero(t, nonZero(simRead(t, sim, 0, victimP, n)), "bytes of GPU memory a WRITE never reached were overwritten (with another access's data)")

	// The same through a revocation: Renew ends the lease mid-frame.
	writeSecret()
	l, err = a.open(NewLink(uuid.New()), revoked.Key(), AccessWrite, true)
	require.NoError(t, err)
	_, err = l.Slice(uint64(revokedP), n)
	require.NoError(t, err)
	done := make(chan struct{})
	go func() { revoked.Revoke(); close(done) }()
	for l.Renew() == nil {
	}
	<-done
	assert.Zero(t, nonZero(simRead(t, sim, 0, revokedP, n)), "bytes a WRITE cut by revocation never sent were written into GPU memory")
}

// TestAttack14LeasesHoldAndWait: two leases that each fit the lease pool
// on their own take its buffers piece by piece, as tcp and mem take them
// (one Slice per piece): each ends up holding half the pool and waiting
// for the other's half. Neither can go on; both fail after the lease
// wait, though either alone would have gone through.
func TestAttack14LeasesHoldAndWait(t *testing.T) {
	defer SetStageWaitForTest(time.Hour)()
	const piece = 256 << 10
	sim := devmem.NewSim(1)
	a, e, p := stageAgent(t, sim, 1<<20, AccessWrite, 4*piece) // lease pool: 512 KiB, two pieces

	// Alone, a lease of two pieces goes through.
	l, err := a.open(NewLink(uuid.New()), e.Key(), AccessWrite, true)
	require.NoError(t, err)
	for i := range 2 {
		_, err := l.Slice(uint64(p)+uint64(i*piece), piece)
		require.NoError(t, err)
	}
	l.Release()

	// Two at once: each has its first piece when the other asks for its
	// second.
	var leases [2]Lease
	for i := range leases {
		leases[i], err = a.open(NewLink(uuid.New()), e.Key(), AccessWrite, true)
		require.NoError(t, err)
		_, err = leases[i].Slice(uint64(p)+uint64(2*i*piece), piece)
		require.NoError(t, err)
	}
	results := make(chan error, 2)
	for i := range leases {
		go func() {
			_, err := leases[i].Slice(uint64(p)+uint64((2*i+1)*piece), piece)
			leases[i].Release()
			results <- err
		}()
	}
	select {
	case err := <-results: // one is done: it went through, or gave way
		err2 := <-results
		// A lease holding a buffer never waits for another: with the pool
		// taken by the two, each fails at once (a backend that knows its
		// frame's size reserves it whole with Prepare, and never meets this).
		for _, err := range []error{err, err2} {
			if err != nil {
				require.ErrorIs(t, err, ErrStaging)
			}
		}
	case <-time.After(2 * time.Second): // a hang guard: the slices take microseconds when they work
		go func() { _ = a.Close() }() // wakes the waits
		<-results
		<-results
		t.Fatal("two leases that each fit the lease pool wait for each other's buffers (until stageWait, 10 s by default)")
	}
	assert.Zero(t, a.Stats().StagingBuffers)
}

// TestAttack14OnePeerStarvesOthers: the lease half of the pool is shared
// by every peer with no share per peer or link. One peer whose frames
// stall (tcp lets a READ answer trickle at its 64 KiB per 4 s minimum, so
// a 16 MiB frame holds its buffer for about 17 minutes) holds all of it,
// and every other peer's access to this agent's GPU memory fails with
// ErrStaging after the lease wait.
func TestAttack14OnePeerStarvesOthers(t *testing.T) {
	defer SetStageWaitForTest(300 * time.Millisecond)()
	const n = 256 << 10
	sim := devmem.NewSim(1)
	a, e, p := stageAgent(t, sim, 1<<20, AccessRead, 4*n)
	otherP := simAlloc(t, sim, 0, n, nil)
	other, err := a.Expose(AccessRead, []Local{Device(otherP, n, KindVRAM, 0)})
	require.NoError(t, err)
	defer other.Revoke()

	hog := NewLink(uuid.New())
	var held []Lease
	for i := range 2 { // two stalled frames of the hog would fill the lease pool
		l, err := a.open(hog, e.Key(), AccessRead, true)
		require.NoError(t, err)
		held = append(held, l)
		if _, err = l.Slice(uint64(p)+uint64(i*n), n); i > 0 {
			// The second is over the hog's share: it waits for the hog's
			// own buffers, and gives up.
			require.ErrorIs(t, err, ErrStaging)
		} else {
			require.NoError(t, err)
		}
	}
	defer func() {
		for i := range held {
			held[i].Release()
		}
	}()
	l, err := a.open(NewLink(uuid.New()), other.Key(), AccessRead, true)
	require.NoError(t, err)
	defer l.Release()
	_, err = l.Slice(uint64(otherP), 4096)
	assert.NoError(t, err, "another peer's 4 KiB access failed because one peer holds the lease pool")
}

// TestAttack14CloseEndsALeaseWaitingForABuffer: a lease waiting for a
// staging buffer ends when the agent closes (not after the 10 s wait),
// and Close returns once the lease holding the pool is released.
func TestAttack14CloseEndsALeaseWaitingForABuffer(t *testing.T) {
	const n = 256 << 10
	sim := devmem.NewSim(1)
	a, err := New(WithBackends(&stubBackend{name: "stub"}), WithDevice(sim), WithStaging(64<<10, 1<<20))
	require.NoError(t, err)
	p := simAlloc(t, sim, 0, 4*n, nil)
	e, err := a.Expose(AccessRead, []Local{Device(p, 4*n, KindVRAM, 0)})
	require.NoError(t, err)
	var held []Lease
	for i := range 2 {
		l, err := a.open(NewLink(uuid.New()), e.Key(), AccessRead, true)
		require.NoError(t, err)
		_, err = l.Slice(uint64(p)+uint64(i*n), n)
		require.NoError(t, err)
		held = append(held, l)
	}
	waiter, err := a.open(NewLink(uuid.New()), e.Key(), AccessRead, true)
	require.NoError(t, err)
	waited := make(chan error, 1)
	go func() {
		_, err := waiter.Slice(uint64(p)+3*n, n)
		waiter.Release()
		waited <- err
	}()
	closed := make(chan error, 1)
	go func() { closed <- a.Close() }()
	err = <-waited // before any lease is released: Close woke it
	require.ErrorIs(t, err, ErrClosed)
	select {
	case <-closed:
		t.Fatal("Close returned while a peer's lease still held GPU memory")
	default:
	}
	for i := range held {
		held[i].Release()
	}
	require.NoError(t, <-closed)
	st := a.Stats()
	assert.Zero(t, st.StagingBuffers)
	assert.Zero(t, st.StagingBytes, "pinned memory still held after Close")
}

// TestAttack14RevokeWaitsOutAnotherExposuresHog: a peer's lease on
// exposure e waits for a staging buffer that leases on another exposure
// hold. Revoking e ("returns once every outstanding lease has been
// released ... bounded by the backends, which hold a lease for one frame")
// waits for that buffer or for the whole lease wait (10 s), though the
// waiting lease has not touched e's memory: the wait does not end on
// revocation. connect's passive Close inherits it.
func TestAttack14RevokeWaitsOutAnotherExposuresHog(t *testing.T) {
	defer SetStageWaitForTest(time.Hour)()
	const n = 256 << 10
	sim := devmem.NewSim(1)
	a, hogged, hp := stageAgent(t, sim, 1<<20, AccessRead, 2*n)
	defer hogged.Revoke()
	p := simAlloc(t, sim, 0, n, nil)
	e, err := a.Expose(AccessRead, []Local{Device(p, n, KindVRAM, 0)})
	require.NoError(t, err)
	var held []Lease
	for i := range 2 {
		l, err := a.open(NewLink(uuid.New()), hogged.Key(), AccessRead, true)
		require.NoError(t, err)
		_, err = l.Slice(uint64(hp)+uint64(i*n), n)
		require.NoError(t, err)
		held = append(held, l)
	}
	release := func() {
		for i := range held {
			held[i].Release()
		}
		held = nil
	}
	defer release()
	waiter, err := a.open(NewLink(uuid.New()), e.Key(), AccessRead, true)
	require.NoError(t, err)
	waited := make(chan error, 1)
	go func() {
		_, err := waiter.Slice(uint64(p), 4096)
		waiter.Release()
		waited <- err
	}()
	revoked := make(chan struct{})
	go func() { e.Revoke(); close(revoked) }()
	select {
	case <-revoked:
		require.Error(t, <-waited, "the waiting lease's Slice of a revoked exposure")
	case <-time.After(2 * time.Second): // a hang guard: Revoke takes microseconds when it works
		release()
		<-revoked
		<-waited
		t.Fatal("Revoke of an exposure waited for staging buffers held by another exposure's leases")
	}
}
