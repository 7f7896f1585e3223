package connect

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A context cancelled with a cause cancels the transfer with an error that
// matches ErrCancelled, ctx.Err() and the cause, whether the context was
// Begin's or Wait's.
func TestCancelCauseReachesTheOperation(t *testing.T) {
	why := errors.New("decode worker preempted")
	for _, which := range []string{"begin", "wait"} {
		t.Run(which, func(t *testing.T) {
			passive, activeConn, stalled := stallPair(t)
			pop := expose(t, passive, KindRead, buffers([]int{1024}, 1))
			beginCtx, waitCtx := context.Background(), context.Background()
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			if which == "begin" {
				beginCtx = ctx
			} else {
				waitCtx = ctx
			}
			aop, err := begin(beginCtx, activeConn, pop.Metadata(), buffers([]int{1024}, 0))
			require.NoError(t, err)
			<-stalled
			done := make(chan error, 1)
			go func() { done <- aop.Wait(waitCtx) }()
			cancel(why)
			err = <-done
			require.ErrorIs(t, err, ErrCancelled)
			assert.ErrorIs(t, err, context.Canceled)
			assert.ErrorIs(t, err, why)
		})
	}
}

// refuser is a backend whose transfers never start and whose
// notifications wait until released.
type refuser struct {
	stall
	release chan struct{}
	told    chan struct{}
}

func (r *refuser) Name() string           { return "refuser" }
func (r *refuser) Post(*agent.Work) error { return errors.New("refuser: no") }
func (r *refuser) Close() error           { return nil }

func (r *refuser) Reachable(context.Context, agent.Info) error { return nil }
func (r *refuser) Notify(ctx context.Context, _ agent.Info, _ agent.Key, _ []byte) error {
	select {
	case <-r.release:
		close(r.told)
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// A transfer the agent cannot start fails Begin at once: telling the peer,
// which may take a slow connection, happens off the caller's time.
func TestBeginFailureDoesNotWaitToTellThePeer(t *testing.T) {
	r := &refuser{release: make(chan struct{}), told: make(chan struct{})}
	passive := newConnector(t, WithBackends(mem.New(), &refuser{release: make(chan struct{}), told: make(chan struct{})}))
	activeConn := newConnector(t, WithBackends(r, mem.New()))
	pop := expose(t, passive, KindRead, buffers([]int{64}, 1))
	_, err := begin(guarded(t), activeConn, pop.Metadata(), buffers([]int{64}, 0))
	var te *TransferError
	require.ErrorAs(t, err, &te)
	select {
	case <-r.told:
		t.Fatal("the peer was told before Begin returned")
	default:
	}
	close(r.release)
	select { // still told, from a goroutine the Connector waits for on Close
	case <-r.told:
	case <-time.After(5 * time.Second):
		t.Fatal("the peer was never told")
	}
}
