package backendtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/pattern"
	"github.com/goxfer/goxfer/internal/retry"
)

const (
	// largeInProcess is the size of the transfers interrupted in this
	// process, largeCrossProcess that of those interrupted by killing a
	// child process.
	largeInProcess = 64 << 20
	// largeShared replaces largeInProcess with Config.SharedHost or
	// Fast: copies through mapped shared memory run at memory speed, and a
	// transfer of 64 MiB ends before a Close or a cancellation can catch
	// it.
	largeShared       = 512 << 20
	largeCrossProcess = 256 << 20
	// attempts bounds how often a fault case retries when the transfer it
	// meant to interrupt finished first.
	attempts = 5
)

func testFault(t *testing.T, cfg Config) {
	for _, op := range ops {
		t.Run(fmt.Sprintf("PassiveClosed/%v", op), func(t *testing.T) {
			retry.Until(t, attempts, func(t *testing.T) bool { return passiveClosed(t, cfg, op) })
		})
		t.Run(fmt.Sprintf("ActiveClosed/%v", op), func(t *testing.T) {
			retry.Until(t, attempts, func(t *testing.T) bool { return activeClosed(t, cfg, op) })
		})
		t.Run(fmt.Sprintf("Cancel/%v", op), func(t *testing.T) {
			retry.Until(t, attempts, func(t *testing.T) bool { return cancelInFlight(t, cfg, op) })
		})
	}
	t.Run("RevokeDuringWrite", func(t *testing.T) { revokeDuringWrite(t, cfg) })
	t.Run("CloseInFlight", func(t *testing.T) { retry.Until(t, attempts, func(t *testing.T) bool { return closeInFlight(t, cfg) }) })
	for _, op := range ops {
		t.Run(fmt.Sprintf("PassiveKilled/%v", op), func(t *testing.T) {
			needCrossProcess(t, cfg)
			retry.Until(t, attempts, func(t *testing.T) bool { return passiveKilled(t, cfg, op) })
		})
		t.Run(fmt.Sprintf("ActiveKilled/%v", op), func(t *testing.T) {
			needCrossProcess(t, cfg)
			activeKilled(t, cfg, op)
		})
	}
}

// largeSize is the size of the transfers interrupted in this process.
func largeSize(cfg Config) int {
	if cfg.SharedHost || cfg.Fast {
		return largeShared
	}
	return largeInProcess
}

func needCrossProcess(t *testing.T, cfg Config) {
	t.Helper()
	if !cfg.CrossProcess {
		t.Skip("in-process backend: PassiveClosed and ActiveClosed cover lost peers")
	}
	needMain(t)
}

// inflight is a large transfer posted from a to p.
type inflight struct {
	x            *agent.Xfer
	e            *agent.Exposure
	pb, ab       *buffers
	pSeed, aSeed uint64
}

// largeTransfer exposes size bytes on p and posts op of all of them from a.
func largeTransfer(t *testing.T, a, p *agent.Agent, op agent.Op, size int) inflight {
	t.Helper()
	var f inflight
	f.pb, f.pSeed = side(t, p, []int{size})
	f.ab, f.aSeed = side(t, a, []int{size})
	f.e = expose(t, p, op.Access(), f.pb)
	x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: f.e.Key(), Segments: segments(f.ab, f.pb.regions(), 0)})
	require.NoError(t, err)
	t.Cleanup(func() { waitXfer(t, x) }) // the buffers stay in use until then
	f.x = x
	return f
}

// underway starts a large transfer of op between two fresh agents and
// waits until it has accessed the passive side's exposure. It returns
// false if the transfer finished first: nothing is left to interrupt.
func underway(t *testing.T, cfg Config, op agent.Op) (a, p *agent.Agent, f inflight, ok bool) {
	t.Helper()
	a, p = newPair(t, cfg)
	f = largeTransfer(t, a, p, op, largeSize(cfg))
	return a, p, f, waitAccessed(t, f.e, f.x)
}

// requireLost checks the error of a transfer whose peer was lost lost ago.
func requireLost(t *testing.T, cfg Config, x *agent.Xfer, err error, lost time.Duration, how string) {
	t.Helper()
	t.Logf("%v over %s failed %v after the passive %s: %v", x.Op(), x.Backend(), lost, how, err)
	require.ErrorIs(t, err, agent.ErrRemoteLost)
	assert.LessOrEqual(t, lost, cfg.LostWithin, "time to report the lost peer")
}

// requirePeerLost waits for the event by which exposure e hears that its
// peer from was lost, since start.
func requirePeerLost(t *testing.T, cfg Config, e *agent.Exposure, from uuid.UUID, start time.Time, how string) {
	t.Helper()
	ev := waitEvent(t, e, hangGuard)
	lost := time.Since(start)
	t.Logf("passive exposure heard %v after the active %s: %v", lost, how, ev.Err)
	require.Equal(t, agent.EventPeerLost, ev.Kind, "event %+v", ev)
	assert.Equal(t, from, ev.From)
	assert.ErrorIs(t, ev.Err, agent.ErrRemoteLost)
	assert.LessOrEqual(t, lost, cfg.LostWithin, "time to report the lost peer")
}

// passiveClosed closes the passive agent in the middle of a transfer: the
// active side must see ErrRemoteLost within cfg.LostWithin.
func passiveClosed(t *testing.T, cfg Config, op agent.Op) bool {
	_, p, f, ok := underway(t, cfg, op)
	if !ok {
		return false
	}
	x := f.x
	start := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	err := waitXfer(t, x)
	lost := time.Since(start)
	select {
	case cerr := <-closed:
		require.NoError(t, cerr, "passive Close")
	case <-time.After(hangGuard):
		t.Fatalf("passive Close still running after %v", hangGuard)
	}
	if err == nil {
		return false
	}
	requireLost(t, cfg, x, err, lost, "agent began closing")
	return true
}

// activeClosed closes the active agent in the middle of a transfer: the
// passive exposure must hear of the lost peer within cfg.LostWithin.
func activeClosed(t *testing.T, cfg Config, op agent.Op) bool {
	a, _, f, ok := underway(t, cfg, op)
	if !ok {
		return false
	}
	start := time.Now()
	require.NoError(t, a.Close())
	require.True(t, isDone(f.x), "Close returned before its transfer finished")
	if err := f.x.Err(); err != nil {
		require.ErrorIs(t, err, agent.ErrClosed)
	}
	requirePeerLost(t, cfg, f.e, a.ID(), start, "agent began closing")
	return true
}

// cancelInFlight cancels a transfer in the middle.
func cancelInFlight(t *testing.T, cfg Config, op agent.Op) bool {
	a, p, f, ok := underway(t, cfg, op)
	if !ok {
		return false
	}
	x := f.x
	start := time.Now()
	x.Cancel(context.Canceled)
	err := waitXfer(t, x)
	t.Logf("%v over %s done %v after Cancel: %v", op, x.Backend(), time.Since(start), err)
	if err == nil {
		return false
	}
	require.ErrorIs(t, err, agent.ErrCancelled)
	require.ErrorIs(t, err, context.Canceled)
	x.Cancel(errors.New("again"))
	require.Equal(t, err, x.Err(), "cancelling a finished transfer changes nothing")
	if op == agent.OpRead {
		require.NoError(t, f.pb.Check(f.pSeed), "a cancelled READ leaves the passive memory alone")
	}
	// The agents are still usable.
	transfer(t, a, p, op, []int{4 << 10}, []byte("after cancel"))
	return true
}

// revokeDuringWrite revokes an exposure while a WRITE into it is in flight:
// once Revoke returns, no further byte may land.
func revokeDuringWrite(t *testing.T, cfg Config) {
	const rounds = 5
	a, p := newPair(t, cfg)
	hits := 0
	for i := 0; hits < rounds; i++ {
		require.Less(t, i, 4*rounds, "caught only %d of %d WRITEs in flight", hits, rounds)
		t.Run(fmt.Sprintf("round%d", i), func(t *testing.T) {
			f := largeTransfer(t, a, p, agent.OpWrite, largeSize(cfg))
			if !waitAccessed(t, f.e, f.x) {
				return
			}
			f.e.Revoke()
			snap := bytes.Clone(f.pb.Mem())
			err := waitXfer(t, f.x)
			if err != nil {
				require.ErrorIs(t, err, agent.ErrAccessDenied)
				hits++
			}
			if d := firstDiff(f.pb.Mem(), snap); d >= 0 {
				t.Fatalf("byte %d of the exposed memory changed after Revoke returned", d-pattern.GuardLen)
			}
			// Every byte is the old or the new pattern: no torn garbage.
			require.NoError(t, oldOrNew(f.pb.locals[0].Mem, f.pSeed, f.aSeed))
		})
	}
}

func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// oldOrNew checks that every 4 KiB block of b holds pattern old or new, or
// a mix of them byte by byte.
func oldOrNew(b []byte, old, new uint64) error {
	const blk = 4 << 10
	wo, wn := make([]byte, blk), make([]byte, blk)
	for off := 0; off < len(b); off += blk {
		got := b[off:min(off+blk, len(b))]
		o, n := wo[:len(got)], wn[:len(got)]
		pattern.Fill(o, old, 0, uint64(off))
		if bytes.Equal(got, o) {
			continue
		}
		pattern.Fill(n, new, 0, uint64(off))
		if bytes.Equal(got, n) {
			continue
		}
		for i := range got {
			if got[i] != o[i] && got[i] != n[i] {
				return fmt.Errorf("byte %d is 0x%02x: neither the old (0x%02x) nor the written (0x%02x) value", off+i, got[i], o[i], n[i])
			}
		}
	}
	return nil
}

// closeInFlight closes the active agent while transfers are in flight: all
// of them must be done when Close returns, failed with ErrClosed unless they
// had completed, and no goroutine may be left behind.
func closeInFlight(t *testing.T, cfg Config) bool {
	const n, size = 4, 32 << 20
	ignore := goleak.IgnoreCurrent()
	a := newAgent(t, cfg)
	p := newAgent(t, cfg)

	rb, _ := side(t, p, []int{size})
	re := expose(t, p, agent.AccessRead, rb)
	var xs []*agent.Xfer
	for i := range n {
		op, e, remote := agent.OpRead, re, rb
		if i%2 == 1 {
			op = agent.OpWrite
			remote, _ = side(t, p, []int{size})
			e = expose(t, p, agent.AccessWrite, remote)
		}
		local, _ := side(t, a, []int{size})
		x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: e.Key(), Segments: segments(local, remote.regions(), 0)})
		require.NoError(t, err)
		xs = append(xs, x)
	}
	waitAccessed(t, re, xs[0])
	require.NoError(t, a.Close())
	closed := 0
	for i, x := range xs {
		require.True(t, isDone(x), "transfer %d not done when Close returned", i)
		if err := x.Err(); err != nil {
			require.ErrorIs(t, err, agent.ErrClosed, "transfer %d", i)
			closed++
		}
	}
	t.Logf("%d of %d transfers failed with ErrClosed", closed, n)

	require.NoError(t, a.Close(), "Close is idempotent")
	_, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: p.Info(), Key: re.Key(), Segments: segments(rb, rb.regions(), 0)})
	require.ErrorIs(t, err, agent.ErrClosed, "Post after Close")
	require.ErrorIs(t, a.Notify(context.Background(), p.Info(), re.Key(), []byte("x")), agent.ErrClosed, "Notify after Close")
	_, err = a.Expose(agent.AccessRead, rb.locals)
	require.ErrorIs(t, err, agent.ErrClosed, "Expose after Close")
	_, err = a.Register(rb.locals[0])
	require.ErrorIs(t, err, agent.ErrClosed, "Register after Close")

	re.Revoke()
	require.NoError(t, p.Close())
	goleak.VerifyNone(t, ignore)
	return closed > 0
}

// passiveKilled kills a passive child process in the middle of a transfer:
// the active side must see ErrRemoteLost within cfg.LostWithin.
func passiveKilled(t *testing.T, cfg Config, op agent.Op) bool {
	a := newAgent(t, cfg)
	c := startChild(t)
	seed := pattern.NextSeed()
	r := c.must(request{Cmd: "expose", Access: op.Access(), Sizes: []int{largeCrossProcess}, Seed: seed})
	ab, _ := side(t, a, []int{largeCrossProcess})
	x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: c.info, Key: agent.Key(r.Key), Segments: segments(ab, r.Regions, 0)})
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
	if err == nil && cfg.SharedHost {
		// Copying through the child's shared memory mapped here needs
		// nothing of the child's process: a copy under way usually ends
		// before the kill is seen (the socket closes once the process's
		// memory is torn down). Then it is whole.
		t.Logf("%v over %s finished %v after the passive process was killed", op, x.Path(), lost)
		if op == agent.OpRead {
			require.NoError(t, ab.Check(seed), "a READ that finished after the kill")
		}
		return true
	}
	if err == nil {
		return false
	}
	requireLost(t, cfg, x, err, lost, "process was killed")
	return true
}

// activeKilled kills an active child process in the middle of a transfer:
// the passive exposure must hear of the lost peer within cfg.LostWithin.
func activeKilled(t *testing.T, cfg Config, op agent.Op) {
	p := newAgent(t, cfg)
	c := startChild(t)
	c.must(request{Cmd: "add-peer", Info: ptr(p.Info())})
	pb, _ := side(t, p, []int{largeCrossProcess})
	e := expose(t, p, op.Access(), pb)
	c.must(request{Cmd: "post", Op: op, Peer: p.ID(), Key: keyBytes(e.Key()), Regions: pb.regions(), Seed: pattern.NextSeed(), Async: true})
	deadline := time.Now().Add(hangGuard)
	for e.Peer() == uuid.Nil {
		require.True(t, time.Now().Before(deadline), "the child's transfer did not access the exposure within %v", hangGuard)
		time.Sleep(100 * time.Microsecond)
	}
	require.Equal(t, c.info.ID, e.Peer())
	start := time.Now()
	c.Kill()
	requirePeerLost(t, cfg, e, c.info.ID, start, "process was killed")
}

func ptr[T any](v T) *T { return &v }
