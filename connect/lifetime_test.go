package connect

import (
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

// A completion the peer reported before Close must survive a Close racing a
// Wait: Wait may have taken the notification off the queue without having
// recorded it yet when Close looks at the queue.
func TestCloseRacingWaitKeepsCompletion(t *testing.T) {
	ctx := guarded(t)
	passive, peer := pair(t, "mem")
	buf := make([]byte, 64)
	rounds, lost, first := lifetimeRounds(20000), 0, -1
	for i := range rounds {
		op := create(t, passive, KindRead, [][]byte{buf})

		var wg sync.WaitGroup
		errs := goWaits(&wg, ctx, op, 1)
		if i%2 == 0 {
			runtime.Gosched() // Wait is then most often blocked on the queue when the notice comes
		}
		reportDone(t, peer, op.Metadata())
		require.NoError(t, op.Close())
		wg.Wait()

		if errs[0] != nil {
			require.ErrorIs(t, errs[0], ErrClosed, "round %d", i)
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
		passive := startConnector(t)
		op := create(t, passive, KindWrite, [][]byte{buf})

		var wg sync.WaitGroup
		errs := goWaits(&wg, ctx, op, 1)
		runtime.Gosched()
		reportDone(t, peer, op.Metadata())
		require.NoError(t, passive.Close())
		wg.Wait()

		require.NoError(t, errs[0], "round %d: a completion reported before Connector.Close was lost to it", i)
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
		op := create(t, passive, KindRead, [][]byte{buf})
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
		op := create(t, passive, KindRead, [][]byte{buf})

		var wg sync.WaitGroup
		errs := goWaits(&wg, ctx, op, 1)
		runtime.Gosched()
		reportDone(t, peer, op.Metadata())
		st := op.Status()
		wg.Wait()

		require.Equal(t, StatusComplete, st, "round %d: Status missed a completion reported before it was called", i)
		require.NoError(t, errs[0], "round %d", i)
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
		peer := startConnector(t)
		op := create(t, passive, KindRead, [][]byte{buf})

		var wg sync.WaitGroup
		errs := goWaits(&wg, ctx, op, 3)
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
		op := create(t, passive, KindWrite, [][]byte{buf})
		md := op.Metadata()

		var wg sync.WaitGroup
		errs := goWaits(&wg, ctx, op, 3)
		runtime.Gosched()
		notice(t, peer, md, encodeNotice(noticeCancelled, "changed its mind"))
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
		activeConn := startConnector(t, WithBackend("mem"))
		pop := create(t, passive, KindRead, [][]byte{src})
		aop, err := begin(ctx, activeConn, pop.Metadata(), [][]byte{make([]byte, size)})
		require.NoError(t, err)

		var wg sync.WaitGroup
		errs := goWaits(&wg, ctx, aop, 2)
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
