package connect

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backend/tcp"
)

// Lifetimes that cannot leak (issue 16, item 3): releases, expiry of
// one-shot passive operations, failures before posting told to the
// passive side, and a passive operation that survives an attempt that
// moved no byte.

// A reader that will not use a token releases it: the passive operation
// ends with ErrReleased, naming the reader, and frees nothing until Close.
func TestReleaseEndsPassive(t *testing.T) {
	for _, kind := range []OperationKind{KindRead, KindWrite} {
		t.Run(kind.String(), func(t *testing.T) {
			ctx := guarded(t)
			passive, act := pair(t, "tcp")
			pop := expose(t, passive, kind, buffers([]int{64}, 1))
			require.NoError(t, act.Release(ctx, pop.Metadata()))
			err := pop.Wait(ctx)
			require.ErrorIs(t, err, ErrReleased)
			assert.NotErrorIs(t, err, ErrCancelled)
			var te *TransferError
			require.ErrorAs(t, err, &te)
			assert.Equal(t, act.a.ID(), te.Peer)
			assert.Empty(t, te.Backend)
			assert.Equal(t, StatusCancelled, pop.Status())
		})
	}
}

// Release's errors: the zero token, a closed Connector, a compact token
// with no resolver.
func TestReleaseErrors(t *testing.T) {
	ctx := guarded(t)
	passive, act := pair(t, "mem")
	pop := expose(t, passive, KindRead, buffers([]int{64}, 1))
	require.ErrorIs(t, act.Release(ctx, Metadata{}), ErrInvalidMetadata)
	require.ErrorIs(t, act.Release(ctx, pop.Metadata().Compact()), ErrNoBackend)
	require.NoError(t, act.Close())
	require.ErrorIs(t, act.Release(ctx, pop.Metadata()), ErrClosed)
	assert.Equal(t, StatusInitialized, pop.Status())
}

// A passive operation nobody uses expires: Wait returns ErrExpired, the
// memory is released, the token refused; one that completed keeps its
// outcome when it expires.
func TestPassiveExpires(t *testing.T) {
	ctx := guarded(t)
	passive := newConnector(t, WithExpiry(20*time.Millisecond))
	act := newConnector(t)
	for _, kind := range []OperationKind{KindRead, KindWrite} {
		pop := create(t, passive, kind, buffers([]int{64}, 1))
		require.ErrorIs(t, pop.Wait(ctx), ErrExpired, kind)
		assert.Equal(t, StatusCancelled, pop.Status())
		require.ErrorIs(t, beginWait(ctx, act, pop.Metadata(), buffers([]int{64}, 0)), ErrAccessDenied)
		require.NoError(t, pop.Close())
		require.ErrorIs(t, pop.Wait(ctx), ErrExpired, "the first end stands")
	}
	// Long enough that the read comes first on a loaded machine.
	passive = newConnector(t, WithExpiry(time.Second))
	pop := create(t, passive, KindRead, buffers([]int{64}, 1))
	moved(t, ctx, act, pop.Metadata(), buffers([]int{64}, 0))
	require.Eventually(t, func() bool {
		passive.mu.Lock()
		defer passive.mu.Unlock()
		return len(passive.passive) == 0
	}, hangGuard, time.Millisecond, "expired after completing")
	require.NoError(t, pop.Wait(ctx), "the completion stands")
	requireUnregistered(t, passive)
	require.NoError(t, pop.Close())
}

// Local descriptors of the wrong size fail the passive operation, which
// learns why instead of waiting for its deadline.
func TestSizeMismatchReachesPassive(t *testing.T) {
	for _, backend := range transferBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive, act := pair(t, backend)
			for _, local := range [][]int{{32}, {64, 64}} {
				pop := expose(t, passive, KindRead, buffers([]int{64}, 1))
				_, err := begin(ctx, act, pop.Metadata(), buffers(local, 0))
				require.ErrorIs(t, err, ErrSizeMismatch)
				err = pop.Wait(ctx)
				require.ErrorIs(t, err, errPeerFailed)
				assert.Contains(t, err.Error(), "size mismatch")
				assert.Equal(t, StatusErrored, pop.Status())
			}
			requireUnregistered(t, act)
		})
	}
}

// A context already done at BeginRead gives the error a context ending
// in flight gives (a *TransferError matching ErrCancelled and the
// context's error, here with no backend), and the passive side hears of
// it.
func TestBeginDoneContextShape(t *testing.T) {
	for _, kind := range []OperationKind{KindRead, KindWrite} {
		t.Run(kind.String(), func(t *testing.T) {
			ctx := guarded(t)
			passive, act, stalled := stallPair(t)
			live, cancelLive := context.WithCancel(ctx)
			pop := expose(t, passive, kind, buffers([]int{64}, 1))
			op, err := begin(live, act, pop.Metadata(), buffers([]int{64}, 0))
			require.NoError(t, err)
			<-stalled
			cancelLive()
			inFlight := op.Wait(ctx)

			pop2 := expose(t, passive, kind, buffers([]int{64}, 1))
			_, atBegin := begin(live, act, pop2.Metadata(), buffers([]int{64}, 0))
			for _, err := range []error{inFlight, atBegin} {
				require.ErrorIs(t, err, ErrCancelled)
				require.ErrorIs(t, err, context.Canceled)
				var te *TransferError
				require.ErrorAs(t, err, &te)
				assert.Equal(t, kind.String() == "READ", te.Op == "read")
				assert.Equal(t, pop.Metadata().Agent(), te.Peer)
			}
			var te *TransferError
			require.ErrorAs(t, atBegin, &te)
			assert.Empty(t, te.Backend, "no backend moved a byte")
			require.ErrorIs(t, pop2.Wait(ctx), ErrCancelled)
			assert.Equal(t, StatusCancelled, pop2.Status())
			requireUnregistered(t, act)
		})
	}
}

// A transfer that could not start (no backend reaches the peer) reports
// no backend, and the passive side survives it: the retry over a backend
// that works completes it. An Exposure reports the failed attempt and
// the completion.
func TestPassiveSurvivesUnstartedAttempt(t *testing.T) {
	ctx := guarded(t)
	passive := newConnector(t, WithBackends(mem.New()))
	noWay := newConnector(t, WithBackends(mem.New(), tcp.New()), WithBackend("tcp"))
	act := newConnector(t)
	src := buffers([]int{4096}, 1)

	pop := expose(t, passive, KindRead, src)
	e := exposeFor(t, passive, KindRead, src)
	for _, md := range []Metadata{pop.Metadata(), e.Metadata()} {
		_, err := noWay.BeginRead(ctx, md, descriptors(buffers([]int{4096}, 0))...)
		require.ErrorIs(t, err, ErrNoBackend)
		var te *TransferError
		require.ErrorAs(t, err, &te)
		assert.Empty(t, te.Backend, "no backend moved a byte")
		assert.Equal(t, passive.a.ID(), te.Peer)
	}
	ev := nextEvent(t, ctx, e)
	require.ErrorIs(t, ev.Err, ErrNotStarted)
	assert.NotErrorIs(t, ev.Err, ErrCancelled)
	assert.Contains(t, ev.Err.Error(), "no byte moved")
	assert.Equal(t, noWay.a.ID(), ev.Peer)
	// The one-shot operation heard the same notice, and carries on.
	require.Eventually(t, func() bool { return pop.Status() == StatusInProgress }, hangGuard, time.Millisecond)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, pop.Wait(wctx), context.DeadlineExceeded, "no outcome yet")

	for _, md := range []Metadata{pop.Metadata(), e.Metadata()} {
		dst := buffers([]int{4096}, 0)
		moved(t, ctx, act, md, dst)
		requireSame(t, src, dst)
	}
	require.NoError(t, pop.Wait(ctx))
	assert.Equal(t, StatusComplete, pop.Status())
	require.NoError(t, nextEvent(t, ctx, e).Err)
	requireUnregistered(t, noWay)
}

// A failure of a transfer that was posted still fails the passive side:
// bytes may have moved.
func TestPostedFailureStillFails(t *testing.T) {
	ctx := guarded(t)
	passive, act, stalled := stallPair(t)
	pop := expose(t, passive, KindRead, buffers([]int{64}, 1))
	op, err := begin(ctx, act, pop.Metadata(), buffers([]int{64}, 0))
	require.NoError(t, err)
	w := <-stalled
	w.Finish(errors.New("wire cut"))
	require.Error(t, op.Wait(ctx))
	var te *TransferError
	require.ErrorAs(t, op.Wait(ctx), &te)
	assert.Equal(t, "stall", te.Backend, "a posted transfer names its backend")
	err = pop.Wait(ctx)
	require.ErrorIs(t, err, errPeerFailed)
	assert.Contains(t, err.Error(), "wire cut")
}

// Expiries firing while the Connector closes, and while their operations
// are closed by hand: nothing deadlocks, every outcome is one of the two,
// and nothing is left running (TestMain checks for goroutines).
func TestExpiryRacingClose(t *testing.T) {
	ctx := guarded(t)
	for round := range lifetimeRounds(50) {
		c := startConnector(t, WithExpiry(time.Duration(round%3)*time.Millisecond+time.Microsecond))
		var ops []waiter
		var exps []*Exposure
		for range 4 {
			ops = append(ops, create(t, c, KindRead, buffers([]int{64}, 1)))
			e, err := c.Expose(ctx, KindWrite, descriptors(buffers([]int{64}, 1)))
			require.NoError(t, err)
			exps = append(exps, e)
		}
		if round%2 == 0 {
			for i := range ops {
				require.NoError(t, ops[i].Close())
				require.NoError(t, exps[i].Close())
			}
		}
		require.NoError(t, c.Close())
		for i := range ops {
			err := ops[i].Wait(ctx)
			assert.True(t, errors.Is(err, ErrExpired) || errors.Is(err, ErrClosed), "%v", err)
			assert.Contains(t, []error{ErrExpired, ErrClosed}, exps[i].Err())
			requireEventsClosed(t, ctx, exps[i])
		}
		requireUnregistered(t, c)
	}
}
