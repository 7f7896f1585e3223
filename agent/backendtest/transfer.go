package backendtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/pattern"
)

var ops = []agent.Op{agent.OpRead, agent.OpWrite}

// layout is the descriptor sizes of one transfer.
type layout struct {
	name  string
	sizes []int
}

func repeat(n int, sizes ...int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = sizes[i%len(sizes)]
	}
	return out
}

var (
	oddSizes = []int{1, 3, 17, 511, 4095, 4097, 6007, 8191}
	layouts  = []layout{
		{"1B", []int{1}},
		{"4KiB", []int{4 << 10}},
		{"1MiB+3", []int{1<<20 + 3}},
		{"64MiB", []int{64 << 20}},
		{"4096x4KiB", repeat(4096, 4<<10)},
		{"4096xOdd", repeat(4096, oddSizes...)},
		{"Mixed", []int{1, 4 << 10, 1<<20 + 3, 3, 8<<20 - 1, 64<<10 + 1}},
	}
)

// testTransfer moves every layout in both directions between two agents of
// this process; they keep their connections from one subtest to the next.
func testTransfer(t *testing.T, cfg Config) {
	a, p := newPair(t, cfg)
	for _, op := range ops {
		for _, l := range layouts {
			t.Run(fmt.Sprintf("%v/%s", op, l.name), func(t *testing.T) {
				transfer(t, a, p, op, l.sizes, nil)
			})
		}
	}
}

// transfer moves sizes from p to a (READ) or from a to p (WRITE), checking
// every byte on both sides.
//
// With a bound notification the passive side acts on the notification
// alone, as a real one would: for a WRITE the data must be in place when it
// arrives; for a READ the passive side revokes and reuses its memory at once,
// which must not change what the active side reads. Without one, it revokes
// the exposure after the transfer, which also orders its checks after the
// backend's last access: the race detector cannot see the ordering a socket
// provides.
func transfer(t *testing.T, a, p *agent.Agent, op agent.Op, sizes []int, notify []byte) {
	t.Helper()
	pb, pSeed := side(t, p, sizes)
	ab, aSeed := side(t, a, sizes)
	e := expose(t, p, op.Access(), pb)
	x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: e.Key(), Segments: segments(ab, pb.regions(), pSeed), Notify: notify})
	require.NoError(t, err, "Post")
	want := pSeed
	if op == agent.OpWrite {
		want = aSeed
	}
	if notify != nil {
		ev := waitEvent(t, e, hangGuard)
		require.Equal(t, agent.EventNotify, ev.Kind, "event %+v", ev)
		assert.Equal(t, a.ID(), ev.From, "notification sender")
		assert.True(t, bytes.Equal(notify, ev.Msg), "notification %q, want %q", ev.Msg, notify)
		if op == agent.OpWrite {
			require.NoError(t, pb.Check(want), "passive memory when the bound notification arrived")
		}
		e.Revoke()
		if op == agent.OpRead {
			pb.Fill(pattern.NextSeed())
		}
	}
	require.NoError(t, waitXfer(t, x), "%v over %s", op, x.Backend())
	e.Revoke()
	require.NoError(t, ab.Check(want), "active memory")
	if notify == nil || op == agent.OpWrite {
		require.NoError(t, pb.Check(want), "passive memory")
	}
	assert.Equal(t, a.ID(), e.Peer(), "exposure's peer")
	assert.Equal(t, uint64(sum(sizes)), x.Bytes())
	if notify == nil {
		noEvent(t, e)
	}
}

func sum(sizes []int) int {
	n := 0
	for _, s := range sizes {
		n += s
	}
	return n
}

func testNotify(t *testing.T, cfg Config) {
	a, p := newPair(t, cfg)
	for _, op := range ops {
		for _, l := range []layout{layouts[1], layouts[3], layouts[5]} {
			t.Run(fmt.Sprintf("Bound/%v/%s", op, l.name), func(t *testing.T) {
				transfer(t, a, p, op, l.sizes, []byte(fmt.Sprintf("%v %s done", op, l.name)))
			})
		}
	}
	for _, op := range ops {
		t.Run(fmt.Sprintf("Bound/CloseAfterWait/%v", op), func(t *testing.T) { closeAfterWait(t, cfg, p, op) })
	}
	big := make([]byte, 64<<10)
	pattern.Fill(big, pattern.NextSeed(), 0, 0)
	for _, m := range []struct {
		name string
		msg  []byte
	}{{"Empty", []byte{}}, {"1B", []byte{42}}, {"64KiB", big}} {
		t.Run("Standalone/"+m.name, func(t *testing.T) {
			pb, _ := side(t, p, []int{4 << 10})
			e := expose(t, p, agent.AccessWrite, pb)
			require.NoError(t, a.Notify(context.Background(), p.Info(), e.Key(), m.msg))
			ev := waitEvent(t, e, hangGuard)
			require.Equal(t, agent.EventNotify, ev.Kind, "event %+v", ev)
			assert.Equal(t, a.ID(), ev.From)
			assert.True(t, bytes.Equal(m.msg, ev.Msg), "got %d bytes, want %d", len(ev.Msg), len(m.msg))
			assert.Equal(t, a.ID(), e.Peer(), "a notification binds the exposure to its sender")
		})
	}
	t.Run("Standalone/UnknownKey", func(t *testing.T) {
		before := p.Stats().DroppedNotifications
		require.NoError(t, a.Notify(context.Background(), p.Info(), agent.NewKey(), []byte("nobody listens")))
		eventually(t, func() bool { return p.Stats().DroppedNotifications > before }, "the passive agent counts a notification for an unknown key as dropped")
	})
	t.Run("Standalone/Revoked", func(t *testing.T) {
		pb, _ := side(t, p, []int{4 << 10})
		e := expose(t, p, agent.AccessRead, pb)
		e.Revoke()
		before := p.Stats().DroppedNotifications
		require.NoError(t, a.Notify(context.Background(), p.Info(), e.Key(), []byte("too late")))
		eventually(t, func() bool { return p.Stats().DroppedNotifications > before }, "the passive agent counts a notification for a revoked key as dropped")
		noEvent(t, e)
	})
}

// eventually waits for cond, polling; only counters need it.
func eventually(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(hangGuard)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", hangGuard, what)
		}
		time.Sleep(time.Millisecond)
	}
}

// testConcurrent runs many transfers at once against one exposure, each
// goroutine on its own window of the exposed region.
func testConcurrent(t *testing.T, cfg Config) {
	const (
		workers = 32
		window  = 256<<10 + 17
		rounds  = 3
	)
	a, p := newPair(t, cfg)
	for _, op := range ops {
		t.Run(op.String(), func(t *testing.T) {
			pb, pSeed := side(t, p, []int{workers * window})
			e := expose(t, p, op.Access(), pb)
			region := pb.locals[0].Region
			aSeed := pattern.NextSeed()
			var (
				wg   sync.WaitGroup
				mu   sync.Mutex
				errs []error
			)
			for w := range workers {
				wg.Go(func() {
					if err := worker(a, p, e, op, region, w*window, window, rounds, pSeed, aSeed); err != nil {
						mu.Lock()
						errs = append(errs, fmt.Errorf("worker %d: %w", w, err))
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			require.NoError(t, errors.Join(errs...))
			e.Revoke()
			want := pSeed
			if op == agent.OpWrite {
				want = aSeed
			}
			require.NoError(t, pb.Check(want), "passive memory")
		})
	}
}

// worker moves window bytes at off within region, in two segments listed
// back to front, rounds times, checking the data after each round.
func worker(a, p *agent.Agent, e *agent.Exposure, op agent.Op, region agent.Region, off, window, rounds int, pSeed, aSeed uint64) error {
	buf := make([]byte, window)
	if op == agent.OpWrite {
		pattern.Fill(buf, aSeed, 0, uint64(off))
	}
	reg, err := a.Register(agent.DRAM(buf))
	if err != nil {
		return err
	}
	defer func() { _ = reg.Release() }()
	half := window / 2
	segs := []agent.Segment{
		{Local: agent.DRAM(buf[half:]), Remote: agent.Region{Addr: region.Addr + uint64(off+half), Len: uint64(window - half)}},
		{Local: agent.DRAM(buf[:half]), Remote: agent.Region{Addr: region.Addr + uint64(off), Len: uint64(half)}},
	}
	for r := range rounds {
		if op == agent.OpRead {
			clear(buf)
		}
		x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: e.Key(), Segments: segs})
		if err != nil {
			return fmt.Errorf("round %d: Post: %w", r, err)
		}
		select {
		case <-x.Done():
		case <-time.After(hangGuard):
			return fmt.Errorf("round %d: transfer still running after %v", r, hangGuard)
		}
		if err := x.Err(); err != nil {
			return fmt.Errorf("round %d: %w", r, err)
		}
		if op == agent.OpRead {
			if err := pattern.Check(buf, pSeed, 0, uint64(off)); err != nil {
				return fmt.Errorf("round %d: %w", r, err)
			}
		}
	}
	return nil
}

// testRegistration checks that registrations are reference-counted per
// region, and that memory still registered keeps serving transfers.
func testRegistration(t *testing.T, cfg Config) {
	a, p := newPair(t, cfg)
	buf := make([]byte, 64<<10+5)
	seed := pattern.NextSeed()
	pattern.Fill(buf, seed, 0, 0)
	l := agent.DRAM(buf)

	regions, refs := p.Registered()
	require.Equal(t, [2]int{0, 0}, [2]int{regions, refs}, "a fresh agent has nothing registered")
	r0, err := p.Register(l)
	require.NoError(t, err)
	r1, err := p.Register(l)
	require.NoError(t, err)
	regions, refs = p.Registered()
	require.Equal(t, [2]int{1, 2}, [2]int{regions, refs}, "two registrations of one region")

	require.NoError(t, r0.Release())
	require.NoError(t, r0.Release(), "Release is idempotent")
	regions, refs = p.Registered()
	require.Equal(t, [2]int{1, 1}, [2]int{regions, refs}, "one of two registrations released")

	e, err := p.Expose(agent.AccessRead, []agent.Local{l})
	require.NoError(t, err)
	defer e.Revoke()
	lb, _ := side(t, a, []int{len(buf)})
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: p.Info(), Key: e.Key(), Segments: []agent.Segment{{Local: lb.locals[0], Remote: l.Region}}})
	require.NoError(t, err)
	require.NoError(t, waitXfer(t, x))
	require.NoError(t, lb.Check(seed), "memory still registered serves a READ")

	require.NoError(t, r1.Release())
	regions, refs = p.Registered()
	require.Equal(t, [2]int{0, 0}, [2]int{regions, refs}, "all registrations released")
}

// closeAfterWait: a bound notification goes out after the active side's
// transfer reports success (agent.Work.FinishNotify), and closing the
// active agent as soon as it has must not lose it: the passive side hears
// the notification, not the loss of its peer.
func closeAfterWait(t *testing.T, cfg Config, p *agent.Agent, op agent.Op) {
	const rounds = 10
	for i := range rounds {
		a := newAgent(t, cfg)
		pb, pSeed := side(t, p, []int{4 << 10})
		ab := newBuffers([]int{4 << 10}) // not registered: a is closed before the cleanups run
		t.Cleanup(ab.free)
		e := expose(t, p, op.Access(), pb)
		msg := []byte(fmt.Sprintf("%v round %d", op, i))
		x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: e.Key(), Segments: segments(ab, pb.regions(), pSeed), Notify: msg})
		require.NoError(t, err, "Post")
		require.NoError(t, waitXfer(t, x), "round %d: %v over %s", i, op, x.Backend())
		require.NoError(t, a.Close(), "Close right after the transfer")
		ev := waitEvent(t, e, hangGuard)
		require.Equal(t, agent.EventNotify, ev.Kind, "round %d: the passive side's first event after the active agent closed: %+v", i, ev)
		assert.Equal(t, msg, ev.Msg)
	}
}
