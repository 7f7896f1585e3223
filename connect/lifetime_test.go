package connect

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// Races between the calls that end an operation's life: Wait, Status,
// Close, Cancel, Connector.Close and the peer's own reports. Each test runs
// many rounds of one race, because which side wins depends on scheduling;
// each round checks that the outcome was decided once, by the first terminal
// event, and that every observer agrees on it.

// lifetimeRounds is how many times each race is run.
func lifetimeRounds(full int) int {
	if testing.Short() {
		return full / 10
	}
	return full
}

// reportDone sends the completion notice to the operation md names, as the
// active side does once every byte is in place. Over mem it is delivered
// before Notify returns: queued, or handed to a Wait blocked on the queue.
func reportDone(t *testing.T, from *Connector, md Metadata) {
	t.Helper()
	require.NoError(t, from.a.Notify(context.Background(), md.peer, md.key, doneNotice))
}

// A completion the peer reported before Close must survive a Close racing a
// Wait: Wait may have taken the notification off the queue without having
// recorded it yet when Close looks at the queue.
func TestCloseRacingWaitKeepsCompletion(t *testing.T) {
	ctx := guarded(t)
	passive, peer := pair(t, "mem")
	buf := make([]byte, 64)
	rounds, lost, first := lifetimeRounds(20000), 0, -1
	for i := range rounds {
		op, err := passive.CreateReadable(ctx, NewDescriptor(buf))
		require.NoError(t, err)

		var wg sync.WaitGroup
		var waitErr error
		wg.Go(func() { waitErr = op.Wait(ctx) })
		if i%2 == 0 {
			runtime.Gosched() // Wait is then most often blocked on the queue when the notice comes
		}
		reportDone(t, peer, op.Metadata())
		require.NoError(t, op.Close())
		wg.Wait()

		if waitErr != nil {
			require.ErrorIs(t, waitErr, ErrClosed, "round %d", i)
			if lost++; first < 0 {
				first = i
			}
			continue
		}
		require.NoError(t, op.Wait(ctx), "round %d: a later Wait", i)
		require.Equal(t, StatusComplete, op.Status(), "round %d", i)
	}
	require.Zero(t, lost, "%d of %d rounds (the first: round %d): Wait returned ErrClosed for a completion reported before Close", lost, rounds, first)
}

// The same race with the Connector's Close, which closes every passive
// operation.
func TestConnectorCloseRacingWaitKeepsCompletion(t *testing.T) {
	ctx := guarded(t)
	peer := newConnector(t)
	buf := make([]byte, 64)
	for i := range lifetimeRounds(2000) {
		passive, err := NewConnector(quiet)
		require.NoError(t, err)
		op, err := passive.CreateWritable(ctx, NewDescriptor(buf))
		require.NoError(t, err)

		var wg sync.WaitGroup
		var waitErr error
		wg.Go(func() { waitErr = op.Wait(ctx) })
		runtime.Gosched()
		reportDone(t, peer, op.Metadata())
		require.NoError(t, passive.Close())
		wg.Wait()

		require.NoError(t, waitErr, "round %d: a completion reported before Connector.Close was lost to it", i)
		require.NoError(t, op.Wait(ctx), "round %d: a later Wait", i)
		require.Equal(t, StatusComplete, op.Status(), "round %d", i)
	}
}

// Status takes queued events off the queue too: a Status racing Close must
// not let Close record ErrClosed over the completion Status is holding.
func TestCloseRacingStatusKeepsCompletion(t *testing.T) {
	ctx := guarded(t)
	passive, peer := pair(t, "mem")
	buf := make([]byte, 64)
	for i := range lifetimeRounds(20000) {
		op, err := passive.CreateReadable(ctx, NewDescriptor(buf))
		require.NoError(t, err)
		reportDone(t, peer, op.Metadata())

		var wg sync.WaitGroup
		var st Status
		wg.Go(func() { st = op.Status() })
		require.NoError(t, op.Close())
		wg.Wait()

		require.Equal(t, StatusComplete, st, "round %d: Status before the outcome was decided", i)
		require.NoError(t, op.Wait(ctx), "round %d: a completion reported before Close was lost to Status racing Close", i)
		require.Equal(t, StatusComplete, op.Status(), "round %d", i)
	}
}

// A Status called once the completion is queued reports it, even while a
// Wait is in the middle of taking it off the queue.
func TestStatusRacingWaitSeesCompletion(t *testing.T) {
	ctx := guarded(t)
	passive, peer := pair(t, "mem")
	buf := make([]byte, 64)
	for i := range lifetimeRounds(20000) {
		op, err := passive.CreateReadable(ctx, NewDescriptor(buf))
		require.NoError(t, err)

		var wg sync.WaitGroup
		var waitErr error
		wg.Go(func() { waitErr = op.Wait(ctx) })
		runtime.Gosched()
		reportDone(t, peer, op.Metadata())
		st := op.Status()
		wg.Wait()

		require.Equal(t, StatusComplete, st, "round %d: Status missed a completion reported before it was called", i)
		require.NoError(t, waitErr, "round %d", i)
		require.NoError(t, op.Close())
	}
}

// A peer lost after it reported success leaves the operation complete, with
// any number of Waits racing over the two events: the first terminal event
// decides, whoever takes it off the queue and whoever records first.
func TestLossAfterCompletionKeepsCompletion(t *testing.T) {
	ctx := guarded(t)
	passive := newConnector(t)
	buf := make([]byte, 64)
	for i := range lifetimeRounds(5000) {
		peer, err := NewConnector(quiet)
		require.NoError(t, err)
		op, err := passive.CreateReadable(ctx, NewDescriptor(buf))
		require.NoError(t, err)

		var wg sync.WaitGroup
		errs := make([]error, 3)
		for k := range errs {
			wg.Go(func() { errs[k] = op.Wait(ctx) })
		}
		runtime.Gosched()
		reportDone(t, peer, op.Metadata())
		passive.PeerDeparted(peer.a.ID()) // after the completion
		wg.Wait()

		for k, err := range errs {
			require.NoError(t, err, "round %d, Wait %d: the loss of a peer after its completion turned success into failure", i, k)
		}
		require.Equal(t, StatusComplete, op.Status(), "round %d", i)
		require.NoError(t, op.Close())
		require.NoError(t, op.Wait(ctx), "round %d: a Wait after Close", i)
		require.NoError(t, peer.Close())
	}
}

// A failure reported first is kept just as a completion is: every Wait,
// before and after Close, returns the same error, and Status agrees.
func TestRepeatedWaitsReturnFirstOutcome(t *testing.T) {
	ctx := guarded(t)
	passive, peer := pair(t, "mem")
	buf := make([]byte, 64)
	for i := range lifetimeRounds(5000) {
		op, err := passive.CreateWritable(ctx, NewDescriptor(buf))
		require.NoError(t, err)
		md := op.Metadata()

		var wg sync.WaitGroup
		errs := make([]error, 3)
		for k := range errs {
			wg.Go(func() { errs[k] = op.Wait(ctx) })
		}
		runtime.Gosched()
		require.NoError(t, peer.a.Notify(context.Background(), md.peer, md.key, encodeNotice(noticeCancelled, "changed its mind")))
		reportDone(t, peer, md) // too late: the cancellation came first
		require.NoError(t, op.Close())
		wg.Wait()

		for k, err := range errs {
			require.ErrorIs(t, err, ErrCancelled, "round %d, Wait %d", i, k)
			require.Same(t, errs[0], err, "round %d, Wait %d: Waits disagree", i, k)
		}
		require.Same(t, errs[0], op.Wait(ctx), "round %d: a Wait after Close", i)
		require.Equal(t, StatusCancelled, op.Status(), "round %d", i)
	}
}

// An active operation's outcome is decided once, by the transfer's end,
// however Wait, Cancel, Status and the Connector's Close race it: every Wait
// returns the same result, Status agrees with it, and the passive side
// hears the same story (success on both sides or failure on both).
func TestActiveOutcomeDecidedOnce(t *testing.T) {
	ctx := guarded(t)
	passive := newConnector(t)
	// Above the mem backend's inline size, so the copy runs on a goroutine
	// of its own and races the calls below.
	const size = 256 << 10
	src := make([]byte, size)
	for i := range lifetimeRounds(2000) {
		activeConn, err := NewConnector(quiet, WithBackend("mem"))
		require.NoError(t, err)
		pop, err := passive.CreateReadable(ctx, NewDescriptor(src))
		require.NoError(t, err)
		aop, err := activeConn.BeginRead(ctx, pop.Metadata(), NewDescriptor(make([]byte, size)))
		require.NoError(t, err)

		var wg sync.WaitGroup
		errs := make([]error, 2)
		for k := range errs {
			wg.Go(func() { errs[k] = aop.Wait(ctx) })
		}
		wg.Go(aop.Cancel)
		wg.Go(func() { _ = aop.Status() })
		require.NoError(t, activeConn.Close())
		wg.Wait()

		out := aop.Wait(ctx)
		for k, err := range errs {
			require.Equal(t, out, err, "round %d, Wait %d: Waits disagree", i, k)
		}
		if out == nil {
			require.Equal(t, StatusComplete, aop.Status(), "round %d", i)
			require.NoError(t, pop.Wait(ctx), "round %d: the active side succeeded, the passive side did not hear it", i)
		} else {
			require.ErrorIs(t, out, ErrCancelled, "round %d", i)
			require.Equal(t, StatusCancelled, aop.Status(), "round %d", i)
			// The peer was told, or is gone: either way the passive Wait
			// ends with an error, never nil after an active failure.
			perr := pop.Wait(ctx)
			require.Error(t, perr, "round %d: the active side failed (%v), the passive side reported success", i, out)
			require.True(t, errors.Is(perr, ErrCancelled) || errors.Is(perr, ErrRemoteLost), "round %d: %v", i, perr)
		}
		require.NoError(t, pop.Close())
	}
}
