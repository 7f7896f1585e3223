package connect

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/mem"
)

// exposureBackends are the backends the long-lived exposure's transfers
// run over.
var exposureBackends = []string{"mem", "tcp", "cma"}

// exposeFor exposes bufs for kind on c, closed without error when the
// test ends.
func exposeFor(tb testing.TB, c *Connector, kind OperationKind, bufs [][]byte, opts ...ExposeOption) *Exposure {
	tb.Helper()
	e, err := c.Expose(tb.Context(), kind, descriptors(bufs), opts...)
	require.NoError(tb, err)
	tb.Cleanup(func() { assert.NoError(tb, e.Close()) })
	return e
}

// nextEvent returns e's next event, failing the test if none comes or
// Events is closed.
func nextEvent(t *testing.T, ctx context.Context, e *Exposure) ExposureEvent {
	t.Helper()
	select {
	case ev, ok := <-e.Events():
		require.True(t, ok, "Events closed")
		return ev
	case <-ctx.Done():
		require.FailNow(t, "no event")
	}
	return ExposureEvent{}
}

// requireEventsClosed waits for Events to be closed, draining it.
func requireEventsClosed(t *testing.T, ctx context.Context, e *Exposure) []ExposureEvent {
	t.Helper()
	var evs []ExposureEvent
	for {
		select {
		case ev, ok := <-e.Events():
			if !ok {
				return evs
			}
			evs = append(evs, ev)
		case <-ctx.Done():
			require.FailNow(t, "Events not closed")
		}
	}
}

// Many peers read sub-ranges of one exposure concurrently, each with a
// note: every byte arrives, and every read is one event naming its peer
// and note.
func TestExposureConcurrentReaders(t *testing.T) {
	const readers, parts = 3, 4
	for _, backend := range exposureBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive := newConnector(t)
			exposed := buffers(uniform(parts, 64<<10), 1)
			e := exposeFor(t, passive, KindRead, exposed)
			md := e.Metadata()

			var wg sync.WaitGroup
			want := make(map[string]uuid.UUID)
			for r := range readers {
				act := newConnector(t, WithBackend(backend))
				for p := range parts {
					s := Span{Index: p, Offset: 1000 * (r + 1), Length: 5000 + p}
					note := fmt.Sprintf("reader %d layer %d done", r, p)
					want[note] = act.a.ID()
					wg.Go(func() {
						part, err := md.Select(s)
						if !assert.NoError(t, err) {
							return
						}
						local := buffers(part.Sizes(), 0)
						op, err := act.BeginRead(ContextWithNote(ctx, []byte(note)), part, descriptors(local)...)
						if !assert.NoError(t, err) {
							return
						}
						if assert.NoError(t, op.Wait(ctx)) {
							assert.True(t, bytes.Equal(spanBytes(exposed, s), local[0]), "%s: bytes", note)
							assert.Equal(t, backend, op.Backend())
						}
					})
				}
			}
			wg.Wait()
			got := make(map[string]uuid.UUID)
			for range readers * parts {
				ev := nextEvent(t, ctx, e)
				require.NoError(t, ev.Err)
				got[string(ev.Note)] = ev.Peer
			}
			assert.Equal(t, want, got)
			assert.Zero(t, e.Dropped())
			assert.NoError(t, e.Err())
			requireSame(t, buffers(uniform(parts, 64<<10), 1), exposed)
		})
	}
}

// Peers write disjoint parts of a WRITE exposure, whole token and
// selections, and each is an event; the exposure stays open after all.
func TestExposureWriters(t *testing.T) {
	for _, backend := range exposureBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive, act := pair(t, backend)
			exposed := buffers(uniform(4, 8192), 0)
			e := exposeFor(t, passive, KindWrite, exposed)
			want := buffers(uniform(4, 8192), 0)
			for layer := range 4 {
				part, err := e.Metadata().Select(Span{Index: layer})
				require.NoError(t, err)
				src := buffers([]int{8192}, layer+3)
				moved(t, ctx, act, part, src)
				copy(want[layer], src[0])
				ev := nextEvent(t, ctx, e)
				require.NoError(t, ev.Err)
				assert.Equal(t, act.a.ID(), ev.Peer)
				assert.Nil(t, ev.Note)
			}
			src := buffers(uniform(4, 8192), 9)
			moved(t, ctx, act, e.Metadata(), src)
			require.NoError(t, nextEvent(t, ctx, e).Err)
			require.NoError(t, e.Close())
			requireSame(t, src, exposed)
			assert.ErrorIs(t, e.Err(), ErrClosed)
			assert.Empty(t, requireEventsClosed(t, ctx, e))
			requireUnregistered(t, passive)
		})
	}
}

// Events past the buffer are dropped and counted, never queued without
// bound; the buffered ones are the first.
func TestExposureEventOverflow(t *testing.T) {
	ctx := guarded(t)
	passive, act := pair(t, "mem")
	e := exposeFor(t, passive, KindRead, buffers([]int{64}, 1), WithEventBuffer(2))
	for i := range 7 {
		op, err := act.BeginRead(ContextWithNote(ctx, []byte{byte(i)}), e.Metadata(), descriptors(buffers([]int{64}, 0))...)
		require.NoError(t, err)
		require.NoError(t, op.Wait(ctx))
	}
	require.Eventually(t, func() bool { return e.Dropped() == 5 }, 2*time.Second, time.Millisecond, "dropped %d, queued %d", e.Dropped(), len(e.Events()))
	assert.Equal(t, []byte{0}, nextEvent(t, ctx, e).Note)
	assert.Equal(t, []byte{1}, nextEvent(t, ctx, e).Note)
	moved(t, ctx, act, e.Metadata(), buffers([]int{64}, 0))
	assert.NoError(t, nextEvent(t, ctx, e).Err, "room again")
	assert.Equal(t, uint64(5), e.Dropped())
}

// Failures, cancellations and releases are events with the peer's
// reason; malformed notices are none. The exposure serves on.
func TestExposureFailureEvents(t *testing.T) {
	ctx := guarded(t)
	passive, act, stalled := stallPair(t)
	e := exposeFor(t, passive, KindRead, buffers([]int{64}, 1))
	md := e.Metadata()

	op, err := begin(ctx, act, md, buffers([]int{64}, 0))
	require.NoError(t, err)
	<-stalled
	op.Cancel()
	require.ErrorIs(t, op.Wait(ctx), ErrCancelled)
	ev := nextEvent(t, ctx, e)
	require.ErrorIs(t, ev.Err, ErrCancelled)
	var te *TransferError
	require.ErrorAs(t, ev.Err, &te)
	assert.Equal(t, act.a.ID(), te.Peer)
	assert.Equal(t, "readable", te.Op)
	assert.Equal(t, act.a.ID(), ev.Peer)

	for _, msg := range [][]byte{{}, {0}, {0xee, 'x'}} {
		notice(t, act, md, msg)
	}
	notice(t, act, md, encodeNotice(noticeFailed, "disk on fire"))
	ev = nextEvent(t, ctx, e)
	require.ErrorIs(t, ev.Err, errPeerFailed)
	assert.Contains(t, ev.Err.Error(), `"disk on fire"`)

	require.NoError(t, act.Release(ctx, md))
	ev = nextEvent(t, ctx, e)
	require.ErrorIs(t, ev.Err, ErrReleased)
	assert.Equal(t, act.a.ID(), ev.Peer)
	assert.NoError(t, e.Err(), "a release closes nothing")
	assert.Empty(t, e.Events())
}

// Close while peers read and write, each over and over until refused, so
// that transfers are in flight when Close comes: when it returns no byte
// of the exposed memory is read or written any more. Bytes changed after
// Close never reach a reader, and writes never change the memory after
// Close. Every peer ends refused.
func TestExposureCloseWhileInFlight(t *testing.T) {
	const size, peers = 1 << 20, 4
	for _, backend := range exposureBackends {
		for _, kind := range []OperationKind{KindRead, KindWrite} {
			t.Run(backend+"/"+kind.String(), func(t *testing.T) {
				ctx := guarded(t)
				passive, act := pair(t, backend)
				exposed := buffers([]int{size}, 0)
				for i := range exposed[0] {
					exposed[0][i] = 0xaa
				}
				e, err := passive.Expose(ctx, kind, descriptors(exposed))
				require.NoError(t, err)
				var (
					wg     sync.WaitGroup
					moves  atomic.Int64
					errs   = make([]error, peers)
					stolen = make([]bool, peers)
				)
				for i := range peers {
					local := buffers([]int{size}, 0)
					if kind == KindWrite {
						for j := range local[0] {
							local[0][j] = 0xbb
						}
					}
					md := e.Metadata()
					if kind == KindWrite { // writers race unless their parts are disjoint
						md, err = md.Select(Span{Index: 0, Offset: i * size / peers, Length: size / peers})
						require.NoError(t, err)
						local = [][]byte{local[0][:size/peers]}
					}
					wg.Go(func() {
						for {
							err := beginWait(ctx, act, md, local)
							if kind == KindRead && bytes.IndexByte(local[0], 0xcc) >= 0 {
								stolen[i] = true
							}
							if err != nil {
								errs[i] = err
								return
							}
							moves.Add(1)
						}
					})
				}
				require.Eventually(t, func() bool { return moves.Load() >= 2*peers }, hangGuard, time.Millisecond)
				require.NoError(t, e.Close())
				// From here on the memory is the caller's: mark it, and
				// remember it, to catch any later access.
				var after []byte
				if kind == KindRead {
					for i := range exposed[0] {
						exposed[0][i] = 0xcc
					}
				} else {
					after = bytes.Clone(exposed[0])
				}
				wg.Wait()
				for i, err := range errs {
					assert.False(t, stolen[i], "peer %d read memory after Close", i)
					assert.ErrorIs(t, err, ErrAccessDenied, "peer %d", i)
				}
				if kind == KindWrite {
					assert.Equal(t, after, exposed[0], "memory written after Close")
				}
				requireEventsClosed(t, ctx, e)
				requireUnregistered(t, passive)
			})
		}
	}
}

// An exposure unused past its expiry closes: its last event and Err are
// ErrExpired, its memory is released, and its token is refused. (An
// exposure used, then unused, expires too: TestExpiryWaitsForUse.)
func TestExposureExpires(t *testing.T) {
	ctx := guarded(t)
	passive, act := pair(t, "mem")
	e, err := passive.Expose(ctx, KindRead, descriptors(buffers([]int{64}, 1)), WithExpiry(20*time.Millisecond))
	require.NoError(t, err)
	evs := requireEventsClosed(t, ctx, e)
	assert.Equal(t, []ExposureEvent{{Err: ErrExpired}}, evs)
	assert.ErrorIs(t, e.Err(), ErrExpired)
	requireUnregistered(t, passive)
	require.ErrorIs(t, beginWait(ctx, act, e.Metadata(), buffers([]int{64}, 0)), ErrAccessDenied)
	require.NoError(t, e.Close(), "Close after expiry")
	assert.ErrorIs(t, e.Err(), ErrExpired, "the first end stands")
}

// leaser is a backend that is never chosen: it keeps the agent's Host so
// that a test can hold a lease on an exposure, as a backend does while it
// copies.
type leaser struct{ host agent.Host }

func (l *leaser) Name() string                                { return "leaser" }
func (l *leaser) Start(h agent.Host) ([]byte, error)          { l.host = h; return []byte{1}, nil }
func (l *leaser) Supports(agent.MemKind) bool                 { return true }
func (l *leaser) Reachable(context.Context, agent.Info) error { return errors.New("leaser: never") }
func (l *leaser) Post(*agent.Work) error                      { return errors.New("leaser: never") }
func (l *leaser) Notify(context.Context, agent.Info, agent.Key, []byte) error {
	return errors.New("leaser: never")
}
func (l *leaser) Close() error { return nil }

// Expiry does not fire while a peer holds the memory, however long, nor
// while peers keep using it; it fires once they stop.
func TestExpiryWaitsForUse(t *testing.T) {
	// Long enough that a loaded machine does not leave a gap of d between
	// the uses of "repeated use", which would expire it in between.
	const d = time.Second
	ctx := guarded(t)
	l := &leaser{}
	passive := newConnector(t, WithBackends(mem.New(), l), WithExpiry(d))
	act := newConnector(t)

	t.Run("lease held", func(t *testing.T) {
		e := exposeFor(t, passive, KindRead, buffers([]int{64}, 1))
		pop := expose(t, passive, KindRead, buffers([]int{64}, 1))
		var leases []agent.Lease
		for _, key := range []agent.Key{e.Metadata().key.open(), pop.Metadata().key.open()} {
			lease, err := l.host.Open(agent.NewLink(act.a.ID()), key, agent.AccessRead)
			require.NoError(t, err)
			leases = append(leases, lease)
		}
		time.Sleep(3 * d)
		assert.NoError(t, e.Err(), "expired while in use")
		assert.Equal(t, StatusInProgress, pop.Status(), "expired while in use")
		for i := range leases {
			leases[i].Release()
		}
		assert.Equal(t, ExposureEvent{Err: ErrExpired}, nextEvent(t, ctx, e))
		require.ErrorIs(t, pop.Wait(ctx), ErrExpired)
		assert.Equal(t, StatusCancelled, pop.Status())
	})
	t.Run("repeated use", func(t *testing.T) {
		e := exposeFor(t, passive, KindRead, buffers([]int{64}, 1))
		for range 8 {
			time.Sleep(d / 10)
			moved(t, ctx, act, e.Metadata(), buffers([]int{64}, 0))
			require.NoError(t, nextEvent(t, ctx, e).Err)
			require.NoError(t, e.Err(), "expired while in use")
		}
		assert.Equal(t, ExposureEvent{Err: ErrExpired}, nextEvent(t, ctx, e))
	})
	requireUnregistered(t, passive)
}

// Expose's arguments and options are checked.
func TestExposeInvalid(t *testing.T) {
	ctx := guarded(t)
	c := newConnector(t)
	bufs := descriptors(buffers([]int{64}, 1))
	for name, tc := range map[string]struct {
		kind  OperationKind
		descs []Descriptor
		opts  []ExposeOption
		want  error
		text  string
	}{
		"kind":            {0, bufs, nil, ErrInvalidOption, "goxfer: invalid option: Expose: want KindRead or KindWrite, found OperationKind(0)"},
		"descriptor":      {KindRead, []Descriptor{{}}, nil, ErrInvalidDescriptor, ""},
		"buffer":          {KindRead, bufs, []ExposeOption{WithEventBuffer(0)}, ErrInvalidOption, "goxfer: invalid option: WithEventBuffer(0): want at least 1"},
		"expiry":          {KindRead, bufs, []ExposeOption{WithExpiry(0)}, ErrInvalidOption, "goxfer: invalid option: WithExpiry(0s): want a positive duration"},
		"negative expiry": {KindWrite, bufs, []ExposeOption{WithExpiry(-time.Second)}, ErrInvalidOption, ""},
	} {
		_, err := c.Expose(ctx, tc.kind, tc.descs, tc.opts...)
		require.ErrorIs(t, err, tc.want, name)
		if tc.text != "" {
			assert.EqualError(t, err, tc.text, name)
		}
	}
	_, err := NewConnector(quiet, WithExpiry(0))
	require.ErrorIs(t, err, ErrInvalidOption)
	requireUnregistered(t, c)

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, err = c.Expose(cancelled, KindRead, bufs)
	require.ErrorIs(t, err, context.Canceled)
	require.NoError(t, c.Close())
	_, err = c.Expose(ctx, KindRead, bufs)
	require.ErrorIs(t, err, ErrClosed)
}

// The Connector's Close closes its exposures: Events is closed, Err is
// ErrClosed, the memory is released.
func TestConnectorCloseClosesExposures(t *testing.T) {
	ctx := guarded(t)
	passive := startConnector(t)
	e, err := passive.Expose(ctx, KindWrite, descriptors(buffers([]int{64}, 1)), WithExpiry(time.Hour))
	require.NoError(t, err)
	require.NoError(t, passive.Close())
	requireEventsClosed(t, ctx, e)
	assert.ErrorIs(t, e.Err(), ErrClosed)
	require.NoError(t, e.Close())
}

// A note longer than MaxNote fails Begin before anything moves; one of
// MaxNote bytes arrives whole; a one-shot operation ignores notes.
func TestNotes(t *testing.T) {
	ctx := guarded(t)
	passive, act := pair(t, "tcp")
	e := exposeFor(t, passive, KindRead, buffers([]int{64}, 1))
	long := bytes.Repeat([]byte{0xfe}, MaxNote+1)
	_, err := act.BeginRead(ContextWithNote(ctx, long), e.Metadata(), descriptors(buffers([]int{64}, 0))...)
	require.ErrorIs(t, err, ErrInvalidOption)
	assert.EqualError(t, err, "goxfer: invalid option: ContextWithNote: want a note of at most 256 bytes, found 257")
	requireUnregistered(t, act)

	op, err := act.BeginRead(ContextWithNote(ctx, long[:MaxNote]), e.Metadata(), descriptors(buffers([]int{64}, 0))...)
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	assert.Equal(t, long[:MaxNote], nextEvent(t, ctx, e).Note)

	pop := expose(t, passive, KindRead, buffers([]int{64}, 1))
	op, err = act.BeginRead(ContextWithNote(ctx, []byte("hi")), pop.Metadata(), descriptors(buffers([]int{64}, 0))...)
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	require.NoError(t, pop.Wait(ctx))

	assert.Equal(t, []byte("x"), decodeNote([]byte{noticeDone, 'x'}))
	assert.Nil(t, decodeNote([]byte{noticeFailed, 'x'}))
	assert.Len(t, decodeNote(append([]byte{noticeDone}, bytes.Repeat([]byte{1}, 1000)...)), MaxNote)
}

// Two peers read one exposure, then go away one after the other (their
// Connectors close, which ends their connections): each one's loss is an
// event naming it, not only the first peer's.
func TestExposureEveryPeersLoss(t *testing.T) {
	for _, backend := range []string{"tcp", "cma"} {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive := newConnector(t)
			e := exposeFor(t, passive, KindRead, buffers([]int{4096}, 1))
			var peers []*Connector
			for range 2 {
				act := startConnector(t, WithBackend(backend))
				op, err := begin(ctx, act, e.Metadata(), buffers([]int{4096}, 0))
				require.NoError(t, err)
				require.NoError(t, op.Wait(ctx))
				ev := nextEvent(t, ctx, e)
				require.NoError(t, ev.Err)
				require.Equal(t, act.a.ID(), ev.Peer)
				peers = append(peers, act)
			}
			for i := len(peers) - 1; i >= 0; i-- {
				id := peers[i].a.ID()
				require.NoError(t, peers[i].Close())
				ev := nextEvent(t, ctx, e)
				require.ErrorIs(t, ev.Err, ErrRemoteLost, "peer %d", i)
				require.Equal(t, id, ev.Peer, "peer %d's loss names it", i)
			}
		})
	}
}
