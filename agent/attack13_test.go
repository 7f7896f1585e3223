package agent

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// lifeBackend records its lifetime as the agent drives it: whether Start
// ran, how often Close ran, whether its Host.Context was done (and why)
// when Close came, and any call that came after Close.
type lifeBackend struct {
	stubBackend
	startErr error
	// reach, when set, is where Reachable waits (the test closes it).
	reach   chan struct{}
	inReach chan struct{}

	mu        sync.Mutex
	host      Host
	started   bool
	closes    int
	ctxAtStop error // context.Cause(Host.Context()) when Close began
	late      []string
}

func (b *lifeBackend) Start(h Host) ([]byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.host, b.started = h, true
	return []byte(b.name), b.startErr
}

func (b *lifeBackend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closes++
	if b.host != nil {
		b.ctxAtStop = context.Cause(b.host.Context())
	}
	return nil
}

func (b *lifeBackend) after(what string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closes > 0 {
		b.late = append(b.late, what)
	}
}

func (b *lifeBackend) Reachable(context.Context, Info) error {
	if b.reach != nil {
		b.inReach <- struct{}{}
		<-b.reach
	}
	b.after("Reachable")
	return nil
}

func (b *lifeBackend) Notify(context.Context, Info, Key, []byte) error {
	b.after("Notify")
	return nil
}

func (b *lifeBackend) state() (started bool, closes int, ctxAtStop error, late []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.started, b.closes, b.ctxAtStop, append([]string(nil), b.late...)
}

// New failing half-way: a backend whose Start fails. Every backend is
// closed exactly once, those never started included; each started one's
// Host.Context is done, with cause ErrClosed, by the time its Close runs.
func TestAttack13NewFailingHalfwayClosesEveryBackendOnce(t *testing.T) {
	first := &lifeBackend{stubBackend: stubBackend{name: "first"}}
	broken := &lifeBackend{stubBackend: stubBackend{name: "broken"}, startErr: errors.New("no port")}
	never := &lifeBackend{stubBackend: stubBackend{name: "never"}}
	done := make(chan error, 1)
	go func() {
		_, err := New(WithBackends(first, broken, never))
		done <- err
	}()
	select {
	case err := <-done:
		require.ErrorContains(t, err, "no port")
	case <-time.After(10 * time.Second):
		t.Fatal("New hangs after a backend's Start failed")
	}
	for _, b := range []*lifeBackend{first, broken} {
		started, closes, cause, _ := b.state()
		assert.True(t, started, b.name)
		assert.Equal(t, 1, closes, "%s closed once", b.name)
		assert.ErrorIs(t, cause, ErrClosed, "%s: Host.Context cancelled with ErrClosed before Close", b.name)
	}
	started, closes, _, _ := never.state()
	assert.False(t, started, "a backend after the failing one is not started")
	assert.Equal(t, 1, closes, "a backend never started is still closed")
}

// "On error nothing is left running and the backends have been closed";
// WithBackends: "The agent owns them from New on and closes them". A
// backend handed to New in an option after an invalid one is never
// closed: New stops applying options at the first error and closes only
// the backends the options before it collected.
func TestAttack13NewInvalidOptionClosesBackendsGivenAfterIt(t *testing.T) {
	before := &lifeBackend{stubBackend: stubBackend{name: "before"}}
	after := &lifeBackend{stubBackend: stubBackend{name: "after"}}
	_, err := New(WithBackends(before), WithID(uuid.Nil), WithBackends(after))
	require.ErrorIs(t, err, ErrInvalid)
	for _, b := range []*lifeBackend{before, after} {
		_, closes, _, _ := b.state()
		assert.Equal(t, 1, closes, "%s: closed once by the failed New", b.name)
	}
}

// Backend: "Start is called once, before any other method, and Close
// once, last". The same backend value given twice fails New (a name
// given twice), which then closes it twice.
func TestAttack13NewDuplicateBackendClosedOnce(t *testing.T) {
	b := &lifeBackend{stubBackend: stubBackend{name: "dup"}}
	_, err := New(WithBackends(b, b))
	require.ErrorIs(t, err, ErrInvalid)
	_, closes, _, _ := b.state()
	assert.Equal(t, 1, closes, "Close is called once")
}

// Close: Host.Context is done with cause ErrClosed when each backend's
// Close runs, and Close is called once however often Agent.Close is.
func TestAttack13CloseCancelsHostContextBeforeClose(t *testing.T) {
	b1 := &lifeBackend{stubBackend: stubBackend{name: "one"}}
	b2 := &lifeBackend{stubBackend: stubBackend{name: "two"}}
	a, err := New(WithBackends(b1, b2))
	require.NoError(t, err)
	for _, b := range []*lifeBackend{b1, b2} {
		require.NoError(t, b.host.Context().Err(), "Host.Context alive before Close")
	}
	require.NoError(t, a.Close())
	require.NoError(t, a.Close())
	for _, b := range []*lifeBackend{b1, b2} {
		_, closes, cause, _ := b.state()
		assert.Equal(t, 1, closes, b.name)
		assert.ErrorIs(t, cause, ErrClosed, b.name)
	}
}

// Backend: "Close once, last". Agent.Notify that chose its backend (here:
// still asking Reachable) when Agent.Close ran calls Backend.Notify after
// Backend.Close returned: Agent.Close waits for transfers, not for
// notifications. For mem that delivers a message (and binds the peer's
// exposure to a link) after the closing agent told its peers it is gone.
func TestAttack13NotifyRacingCloseNeverReachesAClosedBackend(t *testing.T) {
	b := &lifeBackend{stubBackend: stubBackend{name: "late"}, reach: make(chan struct{}), inReach: make(chan struct{}, 1)}
	a, err := New(WithBackends(b))
	require.NoError(t, err)
	notified := make(chan error, 1)
	go func() {
		notified <- a.Notify(context.Background(), Info{ID: uuid.New(), Conns: []ConnInfo{{Backend: "late"}}}, NewKey(), []byte("hi"))
	}()
	<-b.inReach
	closed := make(chan error, 1)
	go func() { closed <- a.Close() }()
	time.Sleep(100 * time.Millisecond) // Close returns, or waits for the Notify in progress
	close(b.reach)
	err = <-notified
	require.NoError(t, <-closed)
	_, _, _, late := b.state()
	assert.Empty(t, late, "backend methods called after its Close (Notify returned %v)", err)
}

// Stats().InFlight never counts a finished transfer: not from OnDone, not
// after Done, not for a transfer whose backend refused it.
func TestAttack13InFlightNeverCountsFinished(t *testing.T) {
	b := &capturingBackend{stubBackend{name: "cap"}, make(chan *Work, 64)}
	a := newTestAgent(t, b)
	peer := Info{ID: uuid.New(), Conns: []ConnInfo{{Backend: "cap"}}}
	var seen atomic.Int64
	seen.Store(-1)
	buf := make([]byte, 64)
	const n = 32
	xs := make([]*Xfer, n)
	for i := range n {
		x, err := a.Post(context.Background(), Request{Op: OpRead, Peer: peer,
			Segments: []Segment{{Local: DRAM(buf), Remote: Region{Addr: 0x1000, Len: 64}}},
			OnDone: func(x *Xfer, err error) {
				if in := a.Stats().InFlight; in > int(seen.Load()) {
					seen.Store(int64(in))
				}
			}})
		require.NoError(t, err)
		xs[i] = x
	}
	require.Equal(t, n, a.Stats().InFlight)
	var wg sync.WaitGroup
	for range n {
		w := <-b.posted
		wg.Go(func() { w.Finish(nil) })
	}
	wg.Wait()
	for _, x := range xs {
		<-x.Done()
	}
	assert.Equal(t, 0, a.Stats().InFlight)
	assert.Less(t, seen.Load(), int64(n), "OnDone counted its own transfer in flight")
}

// PeerDeparted aborts only the departed peer's transfers, and Finish stays
// once even when the backend calls it again after the abort.
func TestAttack13PeerDepartedOnlyThatPeerFinishOnce(t *testing.T) {
	b := &capturingBackend{stubBackend{name: "cap"}, make(chan *Work, 8)}
	a := newTestAgent(t, b)
	gone := Info{ID: uuid.New(), Conns: []ConnInfo{{Backend: "cap"}}}
	stays := Info{ID: uuid.New(), Conns: []ConnInfo{{Backend: "cap"}}}
	buf := make([]byte, 64)
	var calls atomic.Int32
	post := func(p Info) (*Xfer, *Work) {
		x, err := a.Post(context.Background(), Request{Op: OpWrite, Peer: p,
			Segments: []Segment{{Local: DRAM(buf), Remote: Region{Addr: 0x1000, Len: 64}}},
			OnDone:   func(*Xfer, error) { calls.Add(1) }})
		require.NoError(t, err)
		return x, <-b.posted
	}
	xg, wg := post(gone)
	xs, ws := post(stays)
	a.PeerDeparted(gone.ID, nil)
	<-wg.Cancelled()
	select {
	case <-ws.Cancelled():
		t.Fatal("another peer's transfer was cancelled")
	default:
	}
	wg.Finish(wg.CancelErr())
	wg.Finish(nil) // ignored
	<-xg.Done()
	require.ErrorIs(t, xg.Err(), ErrRemoteLost)
	ws.Finish(nil)
	<-xs.Done()
	require.NoError(t, xs.Err())
	assert.Equal(t, int32(2), calls.Load(), "OnDone once per transfer")
}
