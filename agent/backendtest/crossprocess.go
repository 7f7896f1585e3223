package backendtest

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/internal/pattern"
)

var crossLayouts = []layout{layouts[0], layouts[2], layouts[3], layouts[5], layouts[6]}

// testCrossProcess moves bytes between this process and a child process in
// both directions, with the parent active and with the child active. For an
// in-process backend it checks that such transfers fail with ErrNoBackend.
func testCrossProcess(t *testing.T, cfg Config) {
	needMain(t)
	a := newAgent(t, cfg)
	c := startChild(t)
	c.must(request{Cmd: "add-peer", Info: ptr(a.Info())})
	if !cfg.CrossProcess {
		t.Run("NoBackend", func(t *testing.T) { noBackend(t, a, c) })
		return
	}
	for _, op := range ops {
		for _, l := range crossLayouts {
			t.Run(fmt.Sprintf("ParentActive/%v/%s", op, l.name), func(t *testing.T) {
				parentActive(t, a, c, op, l.sizes)
			})
			t.Run(fmt.Sprintf("ChildActive/%v/%s", op, l.name), func(t *testing.T) {
				childActive(t, a, c, op, l.sizes)
			})
		}
	}
	for _, op := range ops {
		t.Run(fmt.Sprintf("ParentActive/Abuse/%v", op), func(t *testing.T) { parentAbuse(t, a, c, op) })
		t.Run(fmt.Sprintf("ChildActive/Abuse/%v", op), func(t *testing.T) { childAbuse(t, a, c, op) })
	}
	t.Run("Device", func(t *testing.T) { crossDevice(t, cfg) })
	t.Run("Notify", func(t *testing.T) {
		r := c.must(request{Cmd: "expose", Access: agent.AccessRead, Sizes: []int{1}, Seed: pattern.NextSeed()})
		msg := []byte("standalone across processes")
		require.NoError(t, a.Notify(context.Background(), c.info, agent.Key(r.Key), msg))
		ev := c.must(request{Cmd: "wait-event", ID: r.ID}).Event
		require.Equal(t, agent.EventNotify, ev.Kind, "event %+v", ev)
		assert.Equal(t, a.ID(), ev.From)
		assert.Equal(t, msg, ev.Msg)
		c.must(request{Cmd: "revoke", ID: r.ID})
	})
}

// parentActive: the child exposes, this process transfers.
func parentActive(t *testing.T, a *agent.Agent, c *child, op agent.Op, sizes []int) {
	pSeed := pattern.NextSeed()
	r := c.must(request{Cmd: "expose", Access: op.Access(), Sizes: sizes, Seed: pSeed})
	defer c.must(request{Cmd: "revoke", ID: r.ID})
	ab, aSeed := side(t, a, sizes)
	notify := []byte(fmt.Sprintf("parent %v done", op))
	x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: c.info, Key: agent.Key(r.Key), Segments: segments(ab, r.Regions, pSeed), Notify: notify})
	require.NoError(t, err)
	require.NoError(t, waitXfer(t, x), "%v over %s", op, x.Backend())
	want := pSeed
	if op == agent.OpWrite {
		want = aSeed
	}
	ev := c.must(request{Cmd: "wait-event", ID: r.ID}).Event
	require.Equal(t, agent.EventNotify, ev.Kind, "event %+v", ev)
	assert.Equal(t, a.ID(), ev.From)
	assert.Equal(t, notify, ev.Msg)
	require.NoError(t, ab.Check(want), "parent memory")
	c.must(request{Cmd: "verify", ID: r.ID, Seed: want})
}

// childActive: this process exposes, the child transfers.
func childActive(t *testing.T, a *agent.Agent, c *child, op agent.Op, sizes []int) {
	pb, pSeed := side(t, a, sizes)
	e := expose(t, a, op.Access(), pb)
	want := pSeed
	if op == agent.OpWrite {
		want = pattern.NextSeed()
	}
	notify := []byte(fmt.Sprintf("child %v done", op))
	c.must(request{Cmd: "post", Op: op, Peer: a.ID(), Key: keyBytes(e.Key()), Regions: pb.regions(), Seed: want, Notify: notify})
	ev := waitEvent(t, e, hangGuard)
	require.Equal(t, agent.EventNotify, ev.Kind, "event %+v", ev)
	assert.Equal(t, c.info.ID, ev.From)
	assert.Equal(t, notify, ev.Msg)
	require.NoError(t, pb.Check(want), "parent memory")
	assert.Equal(t, c.info.ID, e.Peer())
}

func keyBytes(k agent.Key) []byte { return k[:] }

// parentAbuse: refused accesses from this process to the child.
func parentAbuse(t *testing.T, a *agent.Agent, c *child, op agent.Op) {
	for _, ab := range abuses() {
		if ab.op != op || ab.name == "AfterRevoke" { // AfterRevoke: below
			continue
		}
		t.Run(ab.name, func(t *testing.T) {
			pSeed := pattern.NextSeed()
			r := c.must(request{Cmd: "expose", Access: ab.expose, Sizes: []int{abuseRegionLen}, Seed: pSeed})
			defer c.must(request{Cmd: "revoke", ID: r.ID})
			lb, aSeed := side(t, a, []int{abuseSegLen})
			region := r.Regions[0]
			req := agent.Request{Op: op, Peer: c.info, Key: agent.Key(r.Key), Segments: []agent.Segment{{
				Local: lb.locals[0], Remote: agent.Region{Addr: region.Addr + 8<<10, Len: abuseSegLen},
			}}}
			ab.tamper(&req, nil, region)
			before := c.must(request{Cmd: "stats"}).Stats.Refused
			require.ErrorIs(t, postWait(t, a, req), agent.ErrAccessDenied)
			c.must(request{Cmd: "verify", ID: r.ID, Seed: pSeed})
			require.NoError(t, lb.Check(aSeed), "parent memory after a refused %v", op)
			assert.Greater(t, c.must(request{Cmd: "stats"}).Stats.Refused, before, "the child counts the refusal")
		})
	}
	t.Run("AfterRevoke", func(t *testing.T) {
		pSeed := pattern.NextSeed()
		r := c.must(request{Cmd: "expose", Access: op.Access(), Sizes: []int{abuseRegionLen}, Seed: pSeed})
		c.must(request{Cmd: "revoke", ID: r.ID})
		lb, aSeed := side(t, a, []int{abuseRegionLen})
		err := postWait(t, a, agent.Request{Op: op, Peer: c.info, Key: agent.Key(r.Key), Segments: segments(lb, r.Regions, 0)})
		require.ErrorIs(t, err, agent.ErrAccessDenied)
		c.must(request{Cmd: "verify", ID: r.ID, Seed: pSeed})
		require.NoError(t, lb.Check(aSeed))
	})
}

// childAbuse: refused accesses from the child to this process.
func childAbuse(t *testing.T, a *agent.Agent, c *child, op agent.Op) {
	for _, name := range []string{"ForgedKey", "PartlyAfter", "WrongAccess", "AfterRevoke"} {
		t.Run(name, func(t *testing.T) {
			acc := op.Access()
			if name == "WrongAccess" {
				acc = agent.AccessRead
				if op == agent.OpRead {
					acc = agent.AccessWrite
				}
			}
			pb, pSeed := side(t, a, []int{abuseRegionLen})
			e := expose(t, a, acc, pb)
			key, regions := e.Key(), pb.regions()
			switch name {
			case "ForgedKey":
				key = agent.NewKey()
			case "PartlyAfter":
				regions = slices.Clone(regions)
				regions[0].Addr += 100
			case "AfterRevoke":
				e.Revoke()
			}
			before := a.Stats().Refused
			resp := c.Do(request{Cmd: "post", Op: op, Peer: a.ID(), Key: keyBytes(key), Regions: regions, Seed: pattern.NextSeed()})
			require.Contains(t, resp.Is, "ErrAccessDenied", "child's transfer failed with %q", resp.Err)
			require.NoError(t, pb.Check(pSeed), "parent memory after a refused %v", op)
			assert.Greater(t, a.Stats().Refused, before, "the parent counts the refusal")
			noEvent(t, e)
		})
	}
}

// noBackend checks that an in-process backend refuses transfers and
// notifications to an agent in another process, in both directions.
func noBackend(t *testing.T, a *agent.Agent, c *child) {
	pSeed := pattern.NextSeed()
	r := c.must(request{Cmd: "expose", Access: agent.AccessRead, Sizes: []int{4 << 10}, Seed: pSeed})
	lb, aSeed := side(t, a, []int{4 << 10})
	for _, op := range ops {
		x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: c.info, Key: agent.Key(r.Key), Segments: segments(lb, r.Regions, 0)})
		require.ErrorIs(t, err, agent.ErrNoBackend, "%v from the parent to the child", op)
		require.Nil(t, x)
	}
	require.ErrorIs(t, a.Notify(context.Background(), c.info, agent.Key(r.Key), []byte("hello")), agent.ErrNoBackend, "Notify to the child")
	c.must(request{Cmd: "verify", ID: r.ID, Seed: pSeed})
	require.NoError(t, lb.Check(aSeed))

	pb, pSeed := side(t, a, []int{4 << 10})
	e := expose(t, a, agent.AccessWrite, pb)
	for _, op := range ops {
		resp := c.Do(request{Cmd: "post", Op: op, Peer: a.ID(), Key: keyBytes(e.Key()), Regions: pb.regions(), Seed: pattern.NextSeed(), Notify: []byte("x")})
		require.Contains(t, resp.Is, "ErrNoBackend", "%v from the child to the parent failed with %q", op, resp.Err)
	}
	require.NoError(t, pb.Check(pSeed))
	noEvent(t, e)
}

var crossDevLayouts = []layout{devLayouts[2], devLayouts[4], devLayouts[5]}

// crossDevice moves device memory between this process and a child
// process whose device memory is simulated too (GOXFER_DEVICE=sim), with
// device memory on either side or both, each side active in turn. Where
// the backends cannot reach a peer's device memory, the cases with device
// memory on the passive side must fail with ErrNoBackend.
func crossDevice(t *testing.T, cfg Config) {
	sim := devmem.NewSim(2)
	a, reach := newDevAgent(t, cfg, sim)
	reach.skipNative(t)
	c := startDevChild(t)
	c.must(request{Cmd: "add-peer", Info: ptr(a.Info())})
	for _, op := range ops {
		for _, pl := range placements {
			for _, l := range crossDevLayouts {
				t.Run(fmt.Sprintf("ParentActive/%v/%s/%s", op, pl.name, l.name), func(t *testing.T) {
					parentActiveDev(t, a, sim, reach, c, op, l.sizes, pl)
				})
				t.Run(fmt.Sprintf("ChildActive/%v/%s/%s", op, pl.name, l.name), func(t *testing.T) {
					childActiveDev(t, a, sim, reach, c, op, l.sizes, pl)
				})
			}
		}
	}
}

// parentActiveDev: the child exposes, this process transfers; pl.local is
// this process's memory.
func parentActiveDev(t *testing.T, a *agent.Agent, sim *devmem.Sim, reach devReach, c *child, op agent.Op, sizes []int, pl placement) {
	pSeed := pattern.NextSeed()
	r := c.must(request{Cmd: "expose", Access: op.Access(), Sizes: sizes, Seed: pSeed, Dev: devMask(len(sizes), pl.remote)})
	defer c.must(request{Cmd: "forget", ID: r.ID})
	ab, aSeed := filled(t, a, sim, activeGPU, sizes, pl.local)
	notify := []byte(fmt.Sprintf("parent %v %s done", op, pl.name))
	segs := segmentsOf(ab.locals, r.Regions, pSeed)
	x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: c.info, Key: agent.Key(r.Key), Segments: segs, Notify: notify})
	if anyOf(len(sizes), pl.remote) && !reach.remote {
		require.ErrorIs(t, err, agent.ErrNoBackend, "%v of the child's device memory over a backend that cannot reach it", op)
		require.Nil(t, x)
		require.NoError(t, ab.Check(aSeed))
		c.must(request{Cmd: "verify", ID: r.ID, Seed: pSeed})
		return
	}
	require.NoError(t, err)
	want := pSeed
	if op == agent.OpWrite {
		want = aSeed
	}
	ev := c.must(request{Cmd: "wait-event", ID: r.ID}).Event
	require.Equal(t, agent.EventNotify, ev.Kind, "event %+v", ev)
	require.Empty(t, ev.Err, "the notification vouches for bytes that did not all reach the child's device")
	assert.Equal(t, a.ID(), ev.From)
	assert.Equal(t, notify, ev.Msg)
	if op == agent.OpWrite {
		c.must(request{Cmd: "verify", ID: r.ID, Seed: want}) // in place when the notification arrived
	}
	require.NoError(t, waitXfer(t, x), "%v over %s", op, x.Path())
	assert.Equal(t, reach.path(x.Backend(), segs), x.Path())
	require.Zero(t, a.Stats().StagingBuffers, "staging buffers in use once the transfer is done")
	require.NoError(t, ab.Check(want), "parent memory")
	c.must(request{Cmd: "verify", ID: r.ID, Seed: want})
	c.must(request{Cmd: "revoke", ID: r.ID})
	require.Zero(t, c.must(request{Cmd: "stats"}).Stats.StagingBuffers, "staging buffers in use in the child once its exposure is revoked")
}

// childActiveDev: this process exposes, the child transfers; pl.local is
// the child's memory.
func childActiveDev(t *testing.T, a *agent.Agent, sim *devmem.Sim, reach devReach, c *child, op agent.Op, sizes []int, pl placement) {
	pb, pSeed := filled(t, a, sim, passiveGPU, sizes, pl.remote)
	e := exposeLocals(t, a, op.Access(), pb.locals)
	want := pSeed
	if op == agent.OpWrite {
		want = pattern.NextSeed()
	}
	notify := []byte(fmt.Sprintf("child %v %s done", op, pl.name))
	// A READ waits in the child, which checks what it read; a WRITE is
	// checked here when its notification arrives.
	req := request{Cmd: "post", Op: op, Peer: a.ID(), Key: keyBytes(e.Key()), Regions: pb.regions(), Seed: want, Notify: notify, Dev: devMask(len(sizes), pl.local), Async: op == agent.OpWrite}
	if anyOf(len(sizes), pl.remote) && !reach.remote {
		resp := c.Do(req)
		require.Contains(t, resp.Is, "ErrNoBackend", "%v of this process's device memory from the child failed with %q", op, resp.Err)
		require.NoError(t, pb.Check(pSeed))
		noEvent(t, e)
		return
	}
	c.must(req)
	ev := waitEvent(t, e, hangGuard)
	require.Equal(t, agent.EventNotify, ev.Kind, "event %+v", ev)
	require.NoError(t, ev.Err, "the notification vouches for bytes that did not all reach the device")
	assert.Equal(t, c.info.ID, ev.From)
	assert.Equal(t, notify, ev.Msg)
	require.NoError(t, pb.Check(want), "parent memory when the notification arrived")
	e.Revoke()
	require.Zero(t, a.Stats().StagingBuffers, "staging buffers in use once the exposure is revoked")
	eventually(t, func() bool {
		st := c.must(request{Cmd: "stats"}).Stats
		return st.InFlight == 0 && st.StagingBuffers == 0
	}, "the child's transfer ends and its staging buffers come back")
}
