package nats

import (
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/faultproxy"
)

// Adversarial tests of the presence registry's rules for pauses, lag, a
// lost store, Err, Leave and Close (docs/nats.md, docs/reliability.md "NATS
// faults"), each once a defect found by attacking it, kept as regression
// tests. Each uses real components: an embedded server, faultproxy for the
// network, a stranger's connection for the bucket.

// A registry with a member whose puts the server rejects (here: the bucket's
// maximum message size, set by an administrator, admits the peers' entries
// but not the member's; permissions on its key, or a full account, do the
// same) still hears every peer through its watch. A peer that dies must
// still be declared departed within a bounded time, although no echo of
// the member's puts ever comes: the store check decides, and Err reports
// the member's failing heartbeats meanwhile.
func TestRegistryWhoseOwnPutsAreRefusedStillDeclaresADeadPeerDeparted(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv))
	self := newConnector(t)
	join(t, r, self)
	w := r.Watch(guarded(t))
	const peerHB = 100 * time.Millisecond // a shorter varint: a shorter entry
	peer := newMortal(t, dial(t, srv), WithHeartbeat(peerHB))
	for range 2 {
		require.False(t, next(t, w).Departed)
	}

	mine, err := encodeEntry(entry{hb: testHeartbeat, seq: nextSeq(), info: self.AgentInfo()})
	require.NoError(t, err)
	theirs, err := encodeEntry(entry{hb: peerHB, seq: nextSeq(), info: peer.c.AgentInfo()})
	require.NoError(t, err)
	require.Greater(t, len(mine), len(theirs), "setup: the member's entry must be the longer")
	js, err := jetstream.New(dial(t, srv))
	require.NoError(t, err)
	st, err := js.Stream(guarded(t), "KV_"+defaultBucket)
	require.NoError(t, err)
	cfg := st.CachedInfo().Config
	cfg.MaxMsgSize = int32(len(theirs))
	_, err = js.UpdateStream(guarded(t), cfg)
	require.NoError(t, err)

	require.Eventually(t, func() bool { return r.Err() != nil }, hangGuard, time.Millisecond)
	t.Logf("Err: %v", r.Err())
	// The watch works: the peer's heartbeats keep it present.
	quiet(t, w, 8*testHeartbeat, "the peer heartbeats")

	peer.nc.Close() // no goodbye
	start := time.Now()
	p := within(t, w, 20*testHeartbeat, "a peer that died while this registry's own puts fail is never declared departed")
	assert.Equal(t, peer.departure(), p)
	t.Logf("declared departed %v after it died (its heartbeat %v)", time.Since(start).Round(time.Millisecond), peerHB)
	// Its own member, whose puts fail, is not declared departed here.
	quiet(t, w, 4*testHeartbeat, "after the peer departed")
	assert.Equal(t, []uuid.UUID{self.AgentInfo().ID()}, r.Agents())
	assert.Error(t, r.Err(), "the member's heartbeats still fail")
}

// A lag that begins on the link from the server (a congested network, a
// starved server) makes heartbeats late, not missing, however long it is:
// a registry with a member must not declare a live peer departed. Its
// member's puts time out (their acks wait in the lag); each put is
// numbered, so that its echo, however late, names it and never looks
// younger than it is (once, echoes were matched to the oldest put not yet
// acknowledged, and a lag longer than ten heartbeats made the first late
// echo pass for a recent put).
func TestRegistryBehindALagOfSixteenHeartbeatsDeclaresNobodyDeparted(t *testing.T) {
	const lag = 16 * testHeartbeat
	srv := startServer(t)
	nc, p := proxied(t, srv)
	r := openRegistry(t, nc)
	self := newConnector(t)
	join(t, r, self)
	w := r.Watch(guarded(t))
	time.Sleep(testHeartbeat / 2) // the peer heartbeats half a beat after the member
	peerReg := openRegistry(t, dial(t, srv))
	peer := newConnector(t)
	join(t, peerReg, peer)
	for range 2 {
		require.False(t, next(t, w).Departed)
	}

	// Observe the peer's puts directly, to start the lag right after one:
	// the member's next put is then stored before the peer's.
	js, err := jetstream.New(dial(t, srv))
	require.NoError(t, err)
	kv, err := js.KeyValue(guarded(t), defaultBucket)
	require.NoError(t, err)
	seen, err := kv.Watch(guarded(t), peer.AgentInfo().ID().String(), jetstream.UpdatesOnly())
	require.NoError(t, err)
	t.Cleanup(func() { _ = seen.Stop() })
	for i := range 3 {
		// Right after one of the peer's puts.
		for range 2 {
			select {
			case <-seen.Updates():
			case <-time.After(hangGuard):
				t.Fatal("no put of the peer")
			}
		}
		// Let the registry read that put too before the lag begins.
		time.Sleep(testHeartbeat / 8)
		p.Latency(faultproxy.Downstream, lag, 0)
		start := time.Now()
		select {
		case ev := <-w:
			t.Fatalf("lag %d of %v (%d heartbeats), %v after it began: %v %s, which never stopped heartbeating",
				i+1, lag, lag/testHeartbeat, time.Since(start).Round(time.Millisecond), departedWord(ev), ev.ID)
		case <-time.After(lag + 4*testHeartbeat):
		}
		p.Latency(faultproxy.Downstream, 0, 0)
		quiet(t, w, 4*testHeartbeat, "lag lifted")
		for len(seen.Updates()) > 0 {
			<-seen.Updates()
		}
	}
}

// An echo names its put by the sequence number in the entry: a stranger's
// copy of an entry, or a put delivered again by a re-watch, matches no put
// waiting, and an echo never stands for a put sent after it.
func TestRegistryEchoNamesItsPut(t *testing.T) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv))
	m := join(t, r, newConnector(t), WithHeartbeat(time.Hour)) // no heartbeat during the test
	require.Eventually(t, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(m.sends) == 0
	}, hangGuard, time.Millisecond, "the Join's put never came back")
	r.mu.Lock()
	r.echoAt = time.Time{}
	r.mu.Unlock()
	older, younger := r.sending(m), r.sending(m) // in flight, neither stored yet
	state := func() (time.Time, int) {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.echoAt, len(m.sends)
	}

	r.echo(m.ID(), nextSeq()) // a stranger's copy, numbered by nobody waiting
	at, waiting := state()
	assert.True(t, at.IsZero(), "a stranger's entry counted as an echo")
	assert.Equal(t, 2, waiting)

	r.echo(m.ID(), older.seq)
	at, waiting = state()
	assert.Equal(t, older.at, at, "the echo of the older put must stand for it, not for the younger")
	assert.Equal(t, 1, waiting)

	r.echo(m.ID(), older.seq) // delivered again
	at, waiting = state()
	assert.Equal(t, older.at, at)
	assert.Equal(t, 1, waiting)

	r.echo(m.ID(), younger.seq)
	at, waiting = state()
	assert.Equal(t, younger.at, at)
	assert.Zero(t, waiting)
}

// A peer declared departed (it died without a goodbye) keeps its last entry
// in the bucket until the bucket's max age. A re-watch (after any
// reconnection) delivers that old entry again; it is not a heartbeat, and
// must not bring the dead peer back, nor make it depart a second time.
// Agents may heartbeat faster than the bucket's creator (its TTL is three
// of the creator's heartbeats), which widens the window.
func TestRegistryRewatchDoesNotBringBackADepartedPeer(t *testing.T) {
	srv := startServer(t)
	openRegistry(t, dial(t, srv), WithHeartbeat(time.Second)) // creates the bucket: TTL 3 s
	nc, p := proxied(t, srv)
	r := openRegistry(t, nc)
	w := r.Watch(guarded(t))
	peer := newMortal(t, dial(t, srv))
	require.Equal(t, peer.arrival(), next(t, w))

	peer.nc.Close() // dies, no goodbye
	require.Equal(t, peer.departure(), next(t, w))

	require.Positive(t, p.Reset()) // a reconnection: the registry re-watches
	quiet(t, w, 8*testHeartbeat, "after a re-watch, a peer that died and was declared departed")
	_, err := r.Resolve(guarded(t), peer.id())
	assert.ErrorIs(t, err, connect.ErrRemoteLost)
	assert.Empty(t, r.Agents())
}

// Close "always returns ... within about 2 s plus up to 5 s while the server
// is unreachable" (docs/nats.md), also while a Join is failing: it cuts the
// Join's first put short rather than wait for the Join's context, and the
// Join fails with ErrClosed.
func TestRegistryCloseDoesNotWaitForAJoinsContext(t *testing.T) {
	const joinCtx = 15 * time.Second
	start, joined, closed := closeDuringFailingJoin(t, joinCtx)
	select {
	case <-closed:
		t.Logf("Close returned after %v", time.Since(start).Round(time.Millisecond))
	case <-time.After(9 * time.Second):
		t.Errorf("Close has not returned after 9 s: it waits for the Join's put, bounded only by the caller's context (%v)", joinCtx)
		<-closed
		t.Logf("Close returned after %v", time.Since(start).Round(time.Millisecond))
	}
	assert.ErrorIs(t, await(t, joined, "the Join"), ErrClosed)
}

// A stranger (an administrator's tool, a cleanup script) deletes the bucket
// under a registry that has no members of its own: it only resolves and
// watches. The peers' registries re-create the bucket when their
// heartbeats find no stream ("or a heartbeat finds nothing storing the
// bucket's subjects", docs/nats.md). The watching registry must hear them
// again, or say in Err that it cannot: never declare the live peer departed
// while Err is nil.
func TestWatchOnlyRegistryHearsPeersAfterTheBucketIsDeleted(t *testing.T) {
	bucketDeleted(t, time.Second)
}

// The same at a heartbeat of 250 ms: the client retries a publish that
// finds no stream for 2 x 250 ms, longer than the put's timeout (one
// heartbeat), so the heartbeat fails with context.DeadlineExceeded instead
// of ErrNoStreamResponse; any failing heartbeat must have the bucket
// checked.
func TestRegistryHearsPeersAfterTheBucketIsDeletedAtAShortHeartbeat(t *testing.T) {
	bucketDeleted(t, testHeartbeat)
}

func bucketDeleted(t *testing.T, hb time.Duration) {
	srv := startServer(t)
	r := openRegistry(t, dial(t, srv, resilient...), WithHeartbeat(hb))
	w := r.Watch(guarded(t))
	peerReg := openRegistry(t, dial(t, srv, resilient...), WithHeartbeat(hb))
	peer := newConnector(t)
	join(t, peerReg, peer)
	require.False(t, next(t, w).Departed)

	js, err := jetstream.New(dial(t, srv))
	require.NoError(t, err)
	require.NoError(t, js.DeleteKeyValue(guarded(t), defaultBucket))
	start := time.Now()
	select {
	case ev := <-w:
		t.Errorf("%v after the bucket was deleted: %s %s, which never stopped heartbeating; Err: %v",
			time.Since(start).Round(time.Millisecond), departedWord(ev), ev.ID, r.Err())
	case <-time.After(10 * hb):
	}
	t.Logf("watching registry's Err: %v; member's registry's Err: %v", r.Err(), peerReg.Err())
	_, err = js.KeyValue(guarded(t), defaultBucket)
	require.NoError(t, err, "the bucket was not re-created")

	// Still hears a peer that arrives, and dies, afterwards.
	doomed := newMortal(t, dial(t, srv), WithHeartbeat(hb))
	for {
		ev := within(t, w, 10*hb, "a peer joining after the bucket came back")
		if ev.ID == doomed.id() {
			require.False(t, ev.Departed)
			break
		}
		t.Errorf("event about another agent: %s %s", departedWord(ev), ev.ID)
	}
	doomed.nc.Close()
	ev := within(t, w, 10*hb, "a peer dying after the bucket came back")
	assert.Equal(t, doomed.departure(), ev)
	assert.NoError(t, r.Err(), "the watching registry hears its bucket again")
	assert.NoError(t, peerReg.Err(), "the member's registry hears its bucket again")
	assert.Equal(t, []uuid.UUID{peer.AgentInfo().ID()}, r.Agents())
}

// Close racing Joins, twice at once, returns promptly every time, every
// Join returns, and no entry is left behind: a Member that joined while
// Close ran is left by it.
func TestRegistryCloseRacingJoinsLeavesNothing(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	conns := make([]*connect.Connector, 4)
	for i := range conns {
		conns[i] = newConnector(t)
	}
	joins := 0
	for round := range 15 {
		r, err := OpenRegistry(guarded(t), nc, WithHeartbeat(testHeartbeat), WithLogger(quietLog))
		require.NoError(t, err)
		joined := make(chan error, len(conns))
		for _, c := range conns {
			go func() {
				_, err := r.Join(guarded(t), c)
				joined <- err
			}()
		}
		time.Sleep(time.Duration(round) * 200 * time.Microsecond)
		closed := make(chan error, 2)
		ok := 0
		for range 2 {
			go func() { closed <- r.Close() }()
		}
		for range 2 {
			select {
			case err := <-closed:
				require.NoError(t, err)
			case <-time.After(5 * time.Second):
				t.Fatalf("round %d: Close hangs", round)
			}
		}
		for range conns {
			select {
			case err := <-joined:
				if err != nil {
					require.ErrorIs(t, err, ErrClosed)
				} else {
					ok++
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("round %d: Join hangs", round)
			}
		}
		kv, err := js.KeyValue(guarded(t), defaultBucket)
		require.NoError(t, err)
		keys, err := kv.Keys(guarded(t))
		if !errors.Is(err, jetstream.ErrNoKeysFound) {
			require.NoError(t, err)
		}
		require.Empty(t, keys, "round %d: entries left behind by a closed registry", round)
		joins += ok
	}
	t.Logf("%d of %d Joins succeeded before Close", joins, 15*len(conns))
}
