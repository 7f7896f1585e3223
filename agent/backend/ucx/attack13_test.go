//go:build ucx

package ucx

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// postTo posts op over n bytes of local to peer at remote address 4096 (a
// frozen peer never looks).
func postTo(t *testing.T, a *agent.Agent, peer agent.Info, op agent.Op, local []byte) *agent.Xfer {
	t.Helper()
	x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: peer, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: agent.Region{Addr: 4096, Len: uint64(len(local))}}}})
	require.NoError(t, err)
	return x
}

// Backend.Post: "It finishes a cancelled transfer promptly, with
// Work.CancelErr". A WRITE whose lease request a frozen peer never answers
// touches no local byte until a grant: Cancel ends it at once (the request
// is abandoned), not at the lease deadline, WithTimeout later (here a
// minute).
func TestAttack13CancelAgainstFrozenPeerIsPrompt(t *testing.T) {
	peer, _ := backendtest.StartStuck(t, New(WithTimeout(time.Minute)))
	a := backendtest.NewAgent(t, New(WithTimeout(time.Minute)))
	x := postTo(t, a, peer, agent.OpWrite, make([]byte, 1<<20))
	time.Sleep(200 * time.Millisecond) // the peer is frozen in Open
	x.Cancel(errors.New("caller gave up"))
	select {
	case <-x.Done():
		require.ErrorIs(t, x.Err(), agent.ErrCancelled)
	case <-time.After(2 * time.Second):
		t.Fatal("a cancelled transfer still waits for a frozen peer's grant")
	}
}

// Agent.Close "cancels every transfer in flight and waits until the
// backends have finished each one": with ucx and a frozen peer, that wait
// is prompt too, not WithTimeout.
func TestAttack13CloseWithFrozenPeerReturnsPromptly(t *testing.T) {
	peer, _ := backendtest.StartStuck(t, New(WithTimeout(time.Minute)))
	a, err := agent.New(agent.WithBackends(New(WithTimeout(time.Minute))))
	require.NoError(t, err)
	x := postTo(t, a, peer, agent.OpWrite, make([]byte, 1<<20))
	time.Sleep(200 * time.Millisecond)
	closed := make(chan error, 1)
	go func() { closed <- a.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
		require.ErrorIs(t, x.Err(), agent.ErrClosed)
	case <-time.After(3 * time.Second):
		t.Error("Agent.Close still waits for a transfer to a frozen peer")
		<-closed
	}
}

// Xfer.Done: "closed when the transfer has finished ... and its backend no
// longer touches its local memory". A departure fails a READ the exposing
// side is pushing into this agent's memory promptly (failOut force-closes
// the endpoint, and the pushed window ends once it is closed); over UCX's
// software RMA (tcp, posix) the pushes of the force-closed connection stop
// with it: no byte lands after Done.
// (With hardware RDMA, a NIC could still write: not testable here.)
func TestAttack13DepartedPushNoWriteAfterDone(t *testing.T) {
	const size = 64 << 20
	a, b := backendtest.Pair(t, New, WithLeaseSize(4<<20))
	src := make([]byte, size)
	for i := 0; i < size; i += 4096 {
		src[i] = 0xA5
	}
	exp, err := b.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	defer exp.Revoke()
	for round := range 3 {
		dst := make([]byte, size)
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: b.Info(), Key: exp.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}})
		require.NoError(t, err)
		deadline := time.Now().Add(5 * time.Second)
		for dst[size/4] == 0 && !isDone(x) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Microsecond)
		}
		a.PeerDeparted(b.ID(), errors.New("registry: gone"))
		<-x.Done()
		if x.Err() == nil {
			continue // finished first
		}
		require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
		snap := bytes.Clone(dst)
		time.Sleep(100 * time.Millisecond)
		require.True(t, bytes.Equal(snap, dst), "round %d: bytes landed in the destination after Done", round)
	}
}

// Backend: "Close is also called when the agent fails to start (... this
// or another backend's Start failing) ... and Close must cope". A ucx
// Start that fails on the progress thread (UCX refuses its configuration)
// leaves b.done closed by the thread (loop.run's defer), and Close, seeing
// a backend never started, closes it again: New panics ("close of closed
// channel") instead of returning the error. Reaches users through
// connect.WithUCX(ucx.WithTransports("nosuchtl")) or a bad WithConfig
// value.
func TestAttack13FailedStartThenClose(t *testing.T) {
	for _, o := range []Option{WithTransports("nosuchtl"), WithConfig("RNDV_THRESH", "banana")} {
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("agent.New panics: %v", r)
				}
			}()
			_, err := agent.New(agent.WithBackends(New(o)))
			require.Error(t, err)
		}()
	}
}

func isDone(x *agent.Xfer) bool {
	select {
	case <-x.Done():
		return true
	default:
		return false
	}
}

// A window refused while another is being pushed into local memory: the
// transfer fails with the refusal, once, and only after the push ended
// (no byte lands after Done).
func TestAttack13WindowRefusedWhileAnotherInFlight(t *testing.T) {
	const lease = 4 << 20
	a, b := backendtest.Pair(t, New, WithLeaseSize(lease))
	src := make([]byte, lease)
	for i := range src {
		src[i] = byte(i*7 + 1)
	}
	exp, err := b.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	defer exp.Revoke()
	for range 5 {
		dst := make([]byte, lease+4096)
		var calls atomic.Int32
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: b.Info(), Key: exp.Key(), Notify: []byte("n"),
			Segments: []agent.Segment{
				{Local: agent.DRAM(dst[:lease]), Remote: agent.DRAM(src).Region},
				{Local: agent.DRAM(dst[lease:]), Remote: agent.Region{Addr: 4096, Len: 4096}}, // not exposed
			},
			OnDone: func(*agent.Xfer, error) { calls.Add(1) }})
		require.NoError(t, err)
		<-x.Done()
		require.ErrorIs(t, x.Err(), agent.ErrAccessDenied)
		snap := bytes.Clone(dst)
		time.Sleep(50 * time.Millisecond)
		require.Equal(t, snap, dst, "bytes landed after Done")
		require.Equal(t, int32(1), calls.Load())
	}
	select {
	case ev := <-exp.Events():
		require.NotEqual(t, agent.EventNotify, ev.Kind, "a failed transfer notified")
	default:
	}
}

// Cancel racing the last window: every outcome is success with the
// notification delivered, or ErrCancelled without it; never both, never
// neither.
func TestAttack13CancelRacingLastWindow(t *testing.T) {
	a, b := backendtest.Pair(t, New, WithLeaseSize(64<<10))
	dst := make([]byte, 256<<10)
	exp, err := b.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(dst)})
	require.NoError(t, err)
	defer exp.Revoke()
	src := make([]byte, len(dst))
	const rounds = 60
	ok := 0
	for i := range rounds {
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: b.Info(), Key: exp.Key(), Notify: []byte{byte(i)},
			Segments: []agent.Segment{{Local: agent.DRAM(src), Remote: agent.DRAM(dst).Region}}})
		require.NoError(t, err)
		time.Sleep(time.Duration(rand.IntN(400)) * time.Microsecond)
		x.Cancel(nil)
		<-x.Done()
		if x.Err() == nil {
			ok++
			select {
			case ev := <-exp.Events():
				require.Equal(t, agent.EventNotify, ev.Kind)
				require.Equal(t, []byte{byte(i)}, ev.Msg)
			case <-time.After(5 * time.Second):
				t.Fatalf("round %d succeeded without its notification", i)
			}
			continue
		}
		require.ErrorIs(t, x.Err(), agent.ErrCancelled, "round %d", i)
	}
	// Notifications of cancelled transfers would be queued behind.
	time.Sleep(50 * time.Millisecond)
	select {
	case ev := <-exp.Events():
		t.Fatalf("a cancelled transfer notified: %v %q", ev.Kind, ev.Msg)
	default:
	}
	t.Logf("%d of %d succeeded before the cancel", ok, rounds)
	assert.Less(t, ok, rounds, "no cancel caught a transfer in flight")
}
