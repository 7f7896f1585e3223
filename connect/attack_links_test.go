package connect

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/tcp"
)

// Adversarial tests of a passive operation's life (Wait, Status, Close and
// the turn they share) and of how a peer's loss reaches it.

// A storm of Waits with contexts of every length (already done, ending
// mid-wait, never ending), Status calls and Closes, racing a completion
// the peer reports at a random moment. Every round must end (no deadlock
// on the turn, Close returns), every Wait that ends for a reason other
// than its own context returns the one outcome, Status agrees with it, and
// a completion reported before the first Close began is never read as
// ErrClosed.
func TestAttackTurnStormDecidesOnce(t *testing.T) {
	ctx := guarded(t)
	passive, peer := pair(t, "mem")
	buf := make([]byte, 64)
	for i := range lifetimeRounds(1500) {
		op := create(t, passive, KindRead, [][]byte{buf})
		md := op.Metadata()

		const waiters = 12
		var (
			wg        sync.WaitGroup
			errs      [waiters]error
			reported  atomic.Bool // the completion was delivered
			doneFirst atomic.Bool // ... before the first Close began
			closeOnce sync.Once
		)
		closeOp := func() {
			closeOnce.Do(func() { doneFirst.Store(reported.Load()) })
			require.NoError(t, op.Close())
		}
		for k := range waiters {
			wg.Go(func() {
				var wctx context.Context
				var cancel context.CancelFunc
				switch k % 4 {
				case 0: // already done
					wctx, cancel = context.WithCancel(ctx)
					cancel()
				case 1: // ends while waiting
					wctx, cancel = context.WithTimeout(ctx, time.Duration(rand.IntN(200))*time.Microsecond)
				case 2: // cancelled by hand at a random moment
					wctx, cancel = context.WithCancel(ctx)
					go func() { time.Sleep(time.Duration(rand.IntN(100)) * time.Microsecond); cancel() }()
				default: // never ends before the outcome
					wctx, cancel = context.WithCancel(ctx)
				}
				defer cancel()
				for range 3 {
					errs[k] = op.Wait(wctx)
					if wctx.Err() != nil && errors.Is(errs[k], wctx.Err()) {
						continue // may call again
					}
					break
				}
			})
		}
		for range 4 {
			wg.Go(func() {
				for range 5 {
					_ = op.Status()
				}
			})
		}
		closers := 1 + rand.IntN(2)
		var cwg sync.WaitGroup
		notify := func() {
			reportDone(t, peer, md)
			reported.Store(true)
		}
		if i%2 == 0 {
			notify() // before any Close: it must win
		} else {
			cwg.Go(notify) // concurrent: either outcome, but one
		}
		for range closers {
			cwg.Go(closeOp)
		}
		cwg.Wait()

		fin := make(chan struct{})
		go func() { wg.Wait(); close(fin) }()
		select {
		case <-fin:
		case <-time.After(hangGuard):
			t.Fatalf("round %d: Waits and Status calls still blocked %v after Close returned", i, hangGuard)
		}

		final := op.Wait(ctx)
		if doneFirst.Load() {
			require.NoError(t, final, "round %d: a completion reported before Close read as %v", i, final)
		}
		if final == nil {
			require.Equal(t, StatusComplete, op.Status(), "round %d", i)
		} else {
			require.ErrorIs(t, final, ErrClosed, "round %d", i)
			require.Equal(t, StatusCancelled, op.Status(), "round %d", i)
		}
		for k, err := range errs {
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				continue // its own context ended first
			}
			require.Equal(t, final, err, "round %d, Wait %d disagrees with the outcome", i, k)
		}
	}
}

// Wait honours its context at every step, however contended the turn:
// while other Waits hold it, while Status and Close are taking it, and when
// it is handed over. No Wait may overrun its deadline by more than a
// scheduling slack, even with dozens of goroutines fighting over the turn
// and nothing ever arriving on the queue.
func TestAttackWaitHonoursDeadlineUnderContention(t *testing.T) {
	ctx := guarded(t)
	passive, _ := pair(t, "mem")
	op := expose(t, passive, KindWrite, [][]byte{make([]byte, 64)})

	const (
		goroutines = 48
		deadline   = 2 * time.Millisecond
		slack      = 2 * time.Second // -race on 2 shared cores
	)
	var (
		wg    sync.WaitGroup
		worst atomic.Int64
		stop  = make(chan struct{})
	)
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
					_ = op.Status()
				}
			}
		})
	}
	var waits sync.WaitGroup
	for range goroutines {
		waits.Go(func() {
			for range 40 {
				wctx, cancel := context.WithTimeout(ctx, deadline)
				start := time.Now()
				err := op.Wait(wctx)
				over := time.Since(start) - deadline
				cancel()
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("Wait returned %v with nothing reported", err)
					return
				}
				for {
					w := worst.Load()
					if int64(over) <= w || worst.CompareAndSwap(w, int64(over)) {
						break
					}
				}
			}
		})
	}
	waits.Wait()
	close(stop)
	wg.Wait()
	require.Less(t, time.Duration(worst.Load()), slack, "a Wait overran its deadline")
	require.Equal(t, StatusInitialized, op.Status(), "timed-out Waits changed the status")
}

// Close returns, and every blocked Wait (with a context that never ends)
// returns ErrClosed, whatever Wait or Status holds the turn when Close
// comes. Repeated on fresh operations so that Close lands at every point of
// the hand-over. (TestConnectorCloseWithOpsInFlight closes the Connector
// under blocked Waits.)
func TestAttackCloseNeverBlockedByWaits(t *testing.T) {
	passive, _ := pair(t, "mem")
	for i := range lifetimeRounds(2000) {
		op := create(t, passive, KindRead, [][]byte{make([]byte, 8)})
		var wg sync.WaitGroup
		errs := goWaits(&wg, context.Background(), op, 4)
		wg.Go(func() { _ = op.Status() })
		if i%3 == 0 {
			time.Sleep(time.Duration(rand.IntN(50)) * time.Microsecond)
		}
		closed := make(chan struct{})
		go func() { _ = op.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(hangGuard):
			t.Fatalf("round %d: Close blocked by Waits", i)
		}
		wg.Wait()
		for k, err := range errs {
			require.ErrorIs(t, err, ErrClosed, "round %d, Wait %d", i, k)
		}
	}
}

// Over tcp, a stranger that claims a live peer's agent ID (IDs are public:
// every token names its agent) joins the link the peer presented its keys
// on. When the real peer then goes away, the passive side never hears of
// it: the stranger's idle connection keeps the link alive, so the peer's
// passive operations wait until the stranger hangs up (or a registry says
// the peer departed). Without the stranger, the loss is reported at once
// (TestPeerLost/tcp).
func TestAttackTCPStrangerKeepsALostPeerAlive(t *testing.T) {
	ctx := guarded(t)
	passive := newConnector(t, WithBackends(tcp.New()))
	peer := newConnector(t, WithBackends(tcp.New()))

	pop := expose(t, passive, KindWrite, buffers([]int{64}, 1))
	md := pop.Metadata()
	bindPeer(t, peer, pop) // the peer presents the key

	// The stranger has no key. It connects claiming the peer's ID and sends
	// a notification to a key of its own invention (dropped).
	stranger := newConnector(t, WithBackends(tcp.New()), WithAgentID(peer.a.ID()))
	require.NoError(t, stranger.a.Notify(context.Background(), md.peer, agent.NewKey(), []byte{0xee, 'y'}))

	// The real peer goes away in an orderly way (it says goodbye).
	require.NoError(t, peer.Close())

	// The keepalive timeout is 4 s by default; give it well over that.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err := pop.Wait(wctx)
	require.ErrorIs(t, err, ErrRemoteLost,
		"the peer that presented the key left, but a stranger claiming its ID kept its link alive: Wait returned %v", err)
}
