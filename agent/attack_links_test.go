package agent

import (
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Adversarial tests of how exposures bind to links and hear of losses.

// drainKinds empties e's queue and returns the kinds it held.
func drainKinds(e *Exposure) []EventKind {
	var ks []EventKind
	for {
		select {
		case ev := <-e.Events():
			ks = append(ks, ev.Kind)
		default:
			return ks
		}
	}
}

// An exposure is bound to one peer, the first to present its key. A second
// key holder, another agent, is not bound: neither its link's loss nor the
// registry's word that it departed reaches the exposure, nor does any loss
// once the exposure is revoked.
func TestAttackExposureBindsOnePeer(t *testing.T) {
	a := newTestAgent(t)
	e, err := a.Expose(AccessWrite, []Local{DRAM(make([]byte, 8))})
	require.NoError(t, err)
	p, q := NewLink(uuid.New()), NewLink(uuid.New())

	l, err := a.open(p, e.Key(), AccessWrite, false)
	require.NoError(t, err)
	l.Release()
	l, err = a.open(q, e.Key(), AccessWrite, false)
	require.NoError(t, err)
	l.Release()
	require.True(t, a.deliver(q, e.Key(), []byte("from q")))
	require.Equal(t, p.Peer, e.Peer())
	require.Equal(t, []EventKind{EventNotify}, drainKinds(e))

	a.linkLost(q, nil)
	a.PeerDeparted(q.Peer, nil)
	require.Empty(t, drainKinds(e), "the loss of a second key holder reached an exposure bound to another peer")
	require.Equal(t, []Link{p}, boundLinks(e), "only the bound peer's links are remembered")

	e.Revoke()
	a.linkLost(p, nil)
	a.PeerDeparted(p.Peer, nil)
	assert.False(t, a.deliver(p, e.Key(), []byte("late")) && len(e.Events()) > 0, "a revoked exposure got a notification")
	assert.Empty(t, drainKinds(e), "a revoked exposure heard a loss")
}

// Strangers claiming the peer's ID storm the agent from many channels at
// once: refused Opens (unknown key, the right key with the wrong access),
// notifications to keys they invented, hang-ups, while the peer uses its
// own link and other exposures come and go. No stranger's link is bound,
// none of their hang-ups reaches the exposure, its links do not grow, and
// the peer's own loss is heard exactly once.
func TestAttackStrangerStormNeverReachesExposure(t *testing.T) {
	a := newTestAgent(t)
	e, err := a.Expose(AccessRead, []Local{DRAM(make([]byte, 64))})
	require.NoError(t, err)
	peer := uuid.New()
	used := NewLink(peer)
	l, err := a.open(used, e.Key(), AccessRead, false)
	require.NoError(t, err)
	l.Release()
	require.Equal(t, peer, e.Peer())

	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { // strangers
			for range 500 {
				s := NewLink(peer)
				if _, err := a.open(s, NewKey(), AccessRead, false); !errors.Is(err, ErrAccessDenied) {
					t.Errorf("a stranger's Open: %v", err)
				}
				if _, err := a.open(s, e.Key(), AccessWrite, false); !errors.Is(err, ErrAccessDenied) {
					t.Errorf("a wrong-access Open: %v", err)
				}
				a.deliver(s, NewKey(), []byte("forged"))
				a.linkLost(s, errors.New("stranger hung up"))
			}
		})
	}
	wg.Go(func() { // the peer keeps using its link
		for range 500 {
			l, err := a.open(used, e.Key(), AccessRead, false)
			if err != nil {
				t.Errorf("the peer's Open: %v", err)
				return
			}
			if _, err := l.Slice(0, 0); err == nil {
				t.Error("an out-of-bounds slice was served")
			}
			l.Release()
		}
	})
	wg.Go(func() { // other exposures come and go
		for range 200 {
			o, err := a.Expose(AccessRead, []Local{DRAM(make([]byte, 8))})
			if err != nil {
				t.Errorf("Expose: %v", err)
				return
			}
			l, err := a.open(NewLink(peer), o.Key(), AccessRead, false)
			if err == nil {
				l.Release()
			}
			o.Revoke()
		}
	})
	wg.Wait()

	require.Empty(t, drainKinds(e), "a stranger reached the exposure")
	require.Equal(t, []Link{used}, boundLinks(e), "the exposure's links grew")

	a.linkLost(used, nil)
	a.linkLost(used, nil)
	require.Equal(t, []EventKind{EventPeerLost}, drainKinds(e), "the peer's own loss is heard, once")
	require.Empty(t, boundLinks(e), "a lost link stays bound")
}

// boundLinks returns a copy of e's bound links.
func boundLinks(e *Exposure) []Link {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.links)
}

// A shared exposure (ExposeShared) binds every peer that presents its key:
// the loss of each is heard, From that peer, once per link and once more on
// word of departure; a stranger that never presented the key still reaches
// nothing, whatever agent ID it claims.
func TestSharedExposureBindsEveryPeer(t *testing.T) {
	a := newTestAgent(t)
	e, err := a.ExposeShared(AccessRead, []Local{DRAM(make([]byte, 8))}, 16)
	require.NoError(t, err)
	p, q := NewLink(uuid.New()), NewLink(uuid.New())
	for _, l := range []Link{p, q} {
		ls, err := a.open(l, e.Key(), AccessRead, false)
		require.NoError(t, err)
		ls.Release()
	}
	require.Equal(t, p.Peer, e.Peer(), "Peer is the first")
	require.Equal(t, []Link{p, q}, boundLinks(e))

	stranger := NewLink(q.Peer) // claims q's ID, never presented the key
	a.linkLost(stranger, nil)
	require.Empty(t, drainKinds(e), "a stranger's hang-up reached the exposure")

	a.linkLost(q, nil)
	ev := <-e.Events()
	require.Equal(t, EventPeerLost, ev.Kind)
	require.Equal(t, q.Peer, ev.From)
	a.PeerDeparted(p.Peer, nil)
	ev = <-e.Events()
	require.Equal(t, EventPeerLost, ev.Kind)
	require.Equal(t, p.Peer, ev.From)
	a.PeerDeparted(uuid.New(), nil)
	require.Empty(t, drainKinds(e), "the departure of an agent that never used it")
	e.Revoke()
}
