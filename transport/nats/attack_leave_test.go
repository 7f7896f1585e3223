package nats

import (
	"context"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/retry"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// Adversarial tests of the grace a Registry gives a peer that left before
// telling its joined Connectors (table.go: depart, departLater; docs/nats.md
// "It tells every member when a peer is gone"): a peer that left is
// forwarded one registry heartbeat after its entry was deleted, not at all
// if it is back by then, and never after the Registry closes.
//
// Every test watches what the joined Connector is told through a shared
// Exposure that the peer has read once: each PeerDeparted for that peer
// reports one event matching connect.ErrRemoteLost on its Events, in
// process, with no frozen child needed. The bounds are generous: a timer
// fires late on a loaded machine, never early, so only the lower bounds
// (the grace) are tight, and they are measured from before the deletion.

// leaveGrace is the observing registries' heartbeat, hence the grace.
const leaveGrace = time.Second

// probe is a Connector joined to an observing Registry, exposing memory
// that peers read once, so that each departure it is told of shows.
type probe struct {
	c   *connect.Connector
	exp *connect.Exposure
}

// newProbe joins a fresh Connector to r and exposes a small buffer on it,
// with room for events events.
func newProbe(t *testing.T, r *Registry, events int) probe {
	t.Helper()
	c := newConnector(t)
	join(t, r, c)
	exp, err := c.Expose(context.Background(), connect.KindRead, []connect.Descriptor{connect.NewDescriptor(make([]byte, 4096))}, connect.WithEventBuffer(events))
	require.NoError(t, err)
	t.Cleanup(func() { _ = exp.Close() })
	return probe{c: c, exp: exp}
}

// readBy has peer read the probe's exposure once: the exposure is then
// bound to peer, and a departure of peer shows on Events.
func (p probe) readBy(t *testing.T, peer *connect.Connector) {
	t.Helper()
	ctx := guarded(t)
	rop, err := peer.BeginRead(ctx, p.exp.Metadata(), connect.NewDescriptor(make([]byte, 4096)))
	require.NoError(t, err)
	require.NoError(t, rop.Wait(ctx))
	ev := await(t, p.exp.Events(), "the read's completion")
	require.NoError(t, ev.Err)
	require.Equal(t, peer.AgentInfo().ID(), ev.Peer)
}

// told waits up to d for the next event and returns when it came; it
// fails the test unless the event says that peer departed.
func (p probe) told(t *testing.T, peer uuid.UUID, d time.Duration, what string) time.Time {
	t.Helper()
	select {
	case ev := <-p.exp.Events():
		at := time.Now()
		require.ErrorIs(t, ev.Err, connect.ErrRemoteLost)
		require.Equal(t, peer, ev.Peer)
		return at
	case <-time.After(d):
		t.Fatalf("%s: not told within %v", what, d)
	}
	return time.Time{}
}

// untold fails the test if the probe reports anything within d.
func (p probe) untold(t *testing.T, d time.Duration, what string) {
	t.Helper()
	select {
	case ev := <-p.exp.Events():
		t.Fatalf("%s: told %+v", what, ev)
	case <-time.After(d):
	}
}

// stranger returns the bucket as another client with write access sees it.
func stranger(t *testing.T, srv *natsserver.Server) jetstream.KeyValue {
	t.Helper()
	js, err := jetstream.New(dial(t, srv))
	require.NoError(t, err)
	kv, err := js.KeyValue(guarded(t), defaultBucket)
	require.NoError(t, err)
	return kv
}

// longLivedBucket creates the default bucket with a TTL of minutes, so that
// entries a test puts by hand outlive the test.
func longLivedBucket(t *testing.T, srv *natsserver.Server) {
	t.Helper()
	r, err := OpenRegistry(guarded(t), dial(t, srv), WithHeartbeat(time.Minute), WithLogger(quietLog))
	require.NoError(t, err)
	require.NoError(t, r.Close())
}

// putAgent puts info's entry as its agent would, heartbeat hb.
func putAgent(t *testing.T, kv jetstream.KeyValue, info connect.AgentInfo, hb time.Duration) {
	t.Helper()
	b, err := encodeEntry(entry{hb: hb, seq: nextSeq(), info: info})
	require.NoError(t, err)
	_, err = kv.Put(guarded(t), info.ID().String(), b)
	require.NoError(t, err)
}

// present waits until r knows id present (or, with want false, departed).
func present(t *testing.T, r *Registry, id uuid.UUID, want bool) {
	t.Helper()
	require.Eventually(t, func() bool {
		_, err := r.Resolve(context.Background(), id)
		return (err == nil) == want
	}, hangGuard, time.Millisecond)
}

// pendingGraces counts the goroutines waiting out a departed peer's grace.
func pendingGraces() int {
	var b strings.Builder
	_ = pprof.Lookup("goroutine").WriteTo(&b, 2)
	return strings.Count(b.String(), "(*Registry).departLater.func")
}

// A real Leave: the Connectors are told one grace after the deletion, no
// sooner, and well within the documented two heartbeats plus slack.
func TestAttackLeaveToldAfterTheGraceNotBefore(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv), WithHeartbeat(leaveGrace))
	p := newProbe(t, r, 64)
	peer := newConnector(t)
	rp := openRegistry(t, dial(t, srv))
	m := join(t, rp, peer)
	present(t, r, peer.AgentInfo().ID(), true)
	p.readBy(t, peer)

	start := time.Now()
	require.NoError(t, m.Leave(guarded(t)))
	at := p.told(t, peer.AgentInfo().ID(), hangGuard, "a peer that left")
	t.Logf("told %v after the Leave began (grace %v)", at.Sub(start).Round(time.Millisecond), leaveGrace)
	assert.GreaterOrEqual(t, at.Sub(start), leaveGrace, "told before the grace ended")
	assert.Less(t, at.Sub(start), 15*leaveGrace, "told far later than one heartbeat")
	p.untold(t, 2*leaveGrace, "after the departure was told")
}

// An agent that leaves and is back (re-joined) before the grace ends is
// never told departed, as documented ("not at all if it is back by then").
func TestAttackLeaveAndRejoinInsideTheGraceIsNeverTold(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv), WithHeartbeat(4*leaveGrace))
	p := newProbe(t, r, 64)
	peer := newConnector(t)
	rp := openRegistry(t, dial(t, srv))
	m := join(t, rp, peer)
	id := peer.AgentInfo().ID()
	present(t, r, id, true)
	p.readBy(t, peer)

	require.NoError(t, m.Leave(guarded(t)))
	present(t, r, id, false)
	join(t, rp, peer)
	present(t, r, id, true)
	p.untold(t, 8*leaveGrace, "an agent back within the grace")
	assert.Zero(t, pendingGraces(), "the grace ended")
}

// An agent that leaves, re-joins and leaves again inside one grace must be
// told a grace after its second Leave: the first grace, ending while it is
// gone again, must not tell early, racing the completions its Connector
// sends as it closes after the second Leave.
func TestAttackLeaveRejoinLeaveToldAGraceAfterTheSecond(t *testing.T) {
	const grace = 3 * leaveGrace
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv), WithHeartbeat(grace))
	rp := openRegistry(t, dial(t, srv))

	retry.Until(t, 5, func(t *testing.T) bool {
		p := newProbe(t, r, 64)
		peer := newConnector(t)
		id := peer.AgentInfo().ID()
		m := join(t, rp, peer)
		present(t, r, id, true)
		p.readBy(t, peer)

		require.NoError(t, m.Leave(guarded(t)))
		present(t, r, id, false)
		heard := time.Now()
		m = join(t, rp, peer)
		present(t, r, id, true)
		// Leave again half way through the first grace: told when it
		// ends, the peer would be told half a grace early.
		time.Sleep(time.Until(heard.Add(grace / 2)))
		second := time.Now()
		if second.Sub(heard) > 2*grace/3 {
			return false // too slow here to leave again inside the grace
		}
		require.NoError(t, m.Leave(guarded(t)))
		at := p.told(t, id, hangGuard, "an agent that left twice")
		t.Logf("told %v after the second Leave began, %v after the first was heard (grace %v)",
			at.Sub(second).Round(time.Millisecond), at.Sub(heard).Round(time.Millisecond), grace)
		assert.GreaterOrEqual(t, at.Sub(second), grace, "told before the grace of the second Leave ended")
		return true
	})
}

// Purging the entry (as an administrator, or a stranger, would) is a
// departure like a deletion: told after the grace.
func TestAttackPurgedEntryToldAfterTheGrace(t *testing.T) {
	srv := startServer(t)
	longLivedBucket(t, srv)
	r := openRegistry(t, dial(t, srv), WithHeartbeat(leaveGrace))
	p := newProbe(t, r, 64)
	peer := newConnector(t)
	kv := stranger(t, srv)
	putAgent(t, kv, peer.AgentInfo(), time.Minute)
	present(t, r, peer.AgentInfo().ID(), true)
	p.readBy(t, peer)

	start := time.Now()
	require.NoError(t, kv.Purge(guarded(t), peer.AgentInfo().ID().String()))
	at := p.told(t, peer.AgentInfo().ID(), hangGuard, "a purged agent")
	t.Logf("told %v after the purge (grace %v)", at.Sub(start).Round(time.Millisecond), leaveGrace)
	assert.GreaterOrEqual(t, at.Sub(start), leaveGrace)
	assert.Less(t, at.Sub(start), 15*leaveGrace)
}

// A stranger with write access to the bucket deletes a live agent's entry
// to fail the operations in flight with it. Told at once, as before the
// grace, it would succeed; now the agent's next heartbeat, due within the
// grace (its heartbeat is shorter than the observer's), puts it back, and
// nobody is told. (A stranger deleting the entry again after every
// heartbeat would still get through: write access to the bucket is trust.)
func TestAttackStrangerDeletingALiveAgentFailsNothing(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv), WithHeartbeat(4*leaveGrace))
	p := newProbe(t, r, 64)
	peer := newConnector(t)
	rp := openRegistry(t, dial(t, srv)) // heartbeat 250 ms
	join(t, rp, peer)
	id := peer.AgentInfo().ID()
	present(t, r, id, true)
	p.readBy(t, peer)

	require.NoError(t, stranger(t, srv).Delete(guarded(t), id.String()))
	present(t, r, id, false)
	present(t, r, id, true) // its next heartbeat
	p.untold(t, 8*leaveGrace, "a live agent whose entry a stranger deleted")
}

// Close while a grace is pending: it returns at once, not after the grace
// (an hour here), ends the goroutine that waits it out, and tells nobody.
func TestAttackCloseDuringTheGraceLeaksNothing(t *testing.T) {
	srv := startServer(t)
	longLivedBucket(t, srv)
	r, err := OpenRegistry(guarded(t), dial(t, srv), WithHeartbeat(time.Hour), WithLogger(quietLog))
	require.NoError(t, err)
	c := newConnector(t)
	m, err := r.Join(guarded(t), c)
	require.NoError(t, err)
	exp, err := c.Expose(context.Background(), connect.KindRead, []connect.Descriptor{connect.NewDescriptor(make([]byte, 4096))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = exp.Close() })
	p := probe{c: c, exp: exp}
	peer := newConnector(t)
	kv := stranger(t, srv)
	putAgent(t, kv, peer.AgentInfo(), time.Minute)
	present(t, r, peer.AgentInfo().ID(), true)
	p.readBy(t, peer)

	before := pendingGraces()
	require.NoError(t, kv.Delete(guarded(t), peer.AgentInfo().ID().String()))
	present(t, r, peer.AgentInfo().ID(), false)
	require.Eventually(t, func() bool { return pendingGraces() == before+1 }, hangGuard, time.Millisecond, "no grace pending")

	start := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- r.Close() }()
	require.NoError(t, await(t, closed, "Close with a grace pending"))
	t.Logf("Close took %v with a grace of an hour pending", time.Since(start).Round(time.Millisecond))
	assert.Equal(t, before, pendingGraces(), "the grace's goroutine outlived Close")
	require.NoError(t, m.Leave(guarded(t)))
	p.untold(t, 2*leaveGrace, "after Close")
}

// The joined Member leaves, and its Connector closes, while a peer's grace
// is pending: nobody is told (the Member is no longer joined), nothing
// hangs or races, and the Registry closes cleanly.
func TestAttackConnectorClosedDuringTheGrace(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv), WithHeartbeat(4*leaveGrace))
	c, err := connect.NewConnector(connect.WithLogger(quietLog))
	require.NoError(t, err)
	m, err := r.Join(guarded(t), c)
	require.NoError(t, err)
	exp, err := c.Expose(context.Background(), connect.KindRead, []connect.Descriptor{connect.NewDescriptor(make([]byte, 4096))})
	require.NoError(t, err)
	p := probe{c: c, exp: exp}
	// A second Member, joined through another Connector, that stays: it
	// is told, although the first closed meanwhile.
	stay := newProbe(t, r, 64)
	peer := newConnector(t)
	rp := openRegistry(t, dial(t, srv))
	pm := join(t, rp, peer)
	id := peer.AgentInfo().ID()
	present(t, r, id, true)
	p.readBy(t, peer)
	stay.readBy(t, peer)

	start := time.Now()
	require.NoError(t, pm.Leave(guarded(t)))
	present(t, r, id, false)
	require.NoError(t, m.Leave(guarded(t)))
	require.NoError(t, exp.Close())
	require.NoError(t, c.Close())
	at := stay.told(t, id, hangGuard, "the Member that stayed")
	assert.GreaterOrEqual(t, at.Sub(start), 4*leaveGrace)
	for ev := range exp.Events() {
		assert.NotErrorIs(t, ev.Err, connect.ErrRemoteLost, "a Member that left was told")
	}
}

// A Connector closed during the grace while its Member is still joined
// (against Join's rule: Leave first) is told nothing it can act on, and
// neither the grace's end nor Close hangs on it.
func TestAttackJoinedConnectorClosedDuringTheGrace(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv), WithHeartbeat(leaveGrace))
	c, err := connect.NewConnector(connect.WithLogger(quietLog))
	require.NoError(t, err)
	join(t, r, c)
	peer := newConnector(t)
	rp := openRegistry(t, dial(t, srv))
	pm := join(t, rp, peer)
	id := peer.AgentInfo().ID()
	present(t, r, id, true)

	before := pendingGraces()
	require.NoError(t, pm.Leave(guarded(t)))
	present(t, r, id, false)
	require.NoError(t, c.Close())
	require.Eventually(t, func() bool { return pendingGraces() == before }, hangGuard, 10*time.Millisecond, "the grace never ended")
	closed := make(chan error, 1)
	go func() { closed <- r.Close() }()
	require.NoError(t, await(t, closed, "Close"))
}

// The deletion is heard, then the observer's connection is reset during
// the grace: the re-watch delivers the delete marker again. The peer must
// be told once, a grace after the deletion, neither at once nor never.
func TestAttackMarkerReplayedByARewatchDuringTheGrace(t *testing.T) {
	srv := startServer(t)
	nc, fp := proxied(t, srv)
	r := openRegistry(t, nc, WithHeartbeat(2*leaveGrace))
	p := newProbe(t, r, 64)
	peer := newConnector(t)
	rp := openRegistry(t, dial(t, srv))
	pm := join(t, rp, peer)
	id := peer.AgentInfo().ID()
	present(t, r, id, true)
	p.readBy(t, peer)

	start := time.Now()
	require.NoError(t, pm.Leave(guarded(t)))
	present(t, r, id, false)
	require.Positive(t, fp.Reset())
	require.Eventually(t, func() bool { return r.Err() == nil && nc.Reconnects > 0 }, hangGuard, time.Millisecond, "never watched again")
	at := p.told(t, id, hangGuard, "a peer whose marker a re-watch replayed")
	t.Logf("told %v after the Leave began (grace %v)", at.Sub(start).Round(time.Millisecond), 2*leaveGrace)
	assert.GreaterOrEqual(t, at.Sub(start), 2*leaveGrace)
	p.untold(t, 2*leaveGrace, "after the departure was told")
}

// The observer is cut off when the peer leaves: it first hears the
// deletion from the re-watch, as the marker of an agent it knew alive. It
// must tell, a grace after it heard it.
func TestAttackLeaveWhileTheObserverIsCutOff(t *testing.T) {
	srv := startServer(t)
	nc, fp := proxied(t, srv)
	r := openRegistry(t, nc, WithHeartbeat(leaveGrace))
	p := newProbe(t, r, 64)
	peer := newConnector(t)
	rp := openRegistry(t, dial(t, srv))
	pm := join(t, rp, peer)
	id := peer.AgentInfo().ID()
	present(t, r, id, true)
	p.readBy(t, peer)

	fp.Refuse(true)
	fp.Reset()
	require.Eventually(t, func() bool { return r.Err() != nil }, hangGuard, time.Millisecond, "the observer never noticed")
	require.NoError(t, pm.Leave(guarded(t)))
	fp.Refuse(false)
	present(t, r, id, false)
	heard := time.Now()
	at := p.told(t, id, hangGuard, "a peer that left while the observer was cut off")
	t.Logf("told %v after the re-watch delivered the deletion (grace %v)", at.Sub(heard).Round(time.Millisecond), leaveGrace)
	assert.Less(t, at.Sub(heard), 15*leaveGrace)
}

// Many agents leave at once: every one is told, after the grace; the
// graces cost a goroutine each while pending, and all end.
func TestAttackManyLeaveAtOnce(t *testing.T) {
	const n = 200
	srv := startServer(t)
	longLivedBucket(t, srv)
	r := openRegistry(t, dial(t, srv), WithHeartbeat(2*leaveGrace))
	p := newProbe(t, r, 4*n)
	kv := stranger(t, srv)
	ids := make(map[uuid.UUID]bool, n)
	for range n {
		peer := newConnector(t, connect.WithBackend("mem"))
		putAgent(t, kv, peer.AgentInfo(), time.Minute)
		present(t, r, peer.AgentInfo().ID(), true)
		p.readBy(t, peer)
		ids[peer.AgentInfo().ID()] = true
	}

	before := pendingGraces()
	start := time.Now()
	for id := range ids {
		require.NoError(t, kv.Delete(guarded(t), id.String()))
	}
	deleted := time.Since(start)
	require.Eventually(t, func() bool { return len(r.Agents()) == 1 }, hangGuard, time.Millisecond)
	peak := pendingGraces() - before
	for len(ids) > 0 {
		select {
		case ev := <-p.exp.Events():
			require.ErrorIs(t, ev.Err, connect.ErrRemoteLost)
			require.True(t, ids[ev.Peer], "told of an agent twice, or of a stranger: %s", ev.Peer)
			delete(ids, ev.Peer)
			require.GreaterOrEqual(t, time.Since(start), 2*leaveGrace, "told before the grace ended")
		case <-time.After(hangGuard):
			t.Fatalf("%d of %d agents that left were never told", len(ids), n)
		}
	}
	t.Logf("%d deletions in %v; all told %v after the first; %d graces pending at once",
		n, deleted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond), peak)
	require.Eventually(t, func() bool { return pendingGraces() == before }, hangGuard, 10*time.Millisecond)
	assert.Zero(t, p.exp.Dropped())
}
