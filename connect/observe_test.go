package connect

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backend/tcp"
)

// reports records what a Connector's observer is told.
type reports struct {
	mu   sync.Mutex
	list []OpReport
}

func (r *reports) observe(rep OpReport) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.list = append(r.list, rep)
}

func (r *reports) all() []OpReport {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]OpReport(nil), r.list...)
}

// Every completed operation is reported once on each side, before its Wait
// returns: kind, role, the active side's backend and path, bytes, a
// duration, no error. Closing a passive operation that already has its
// outcome reports nothing more.
func TestObserverReportsCompletions(t *testing.T) {
	for _, backend := range transferBackends {
		for _, kind := range []OperationKind{KindRead, KindWrite} {
			t.Run(backend+"/"+kind.String(), func(t *testing.T) {
				ctx := guarded(t)
				var pr, ar reports
				passive := newConnector(t, WithObserver(pr.observe))
				act := newConnector(t, WithBackend(backend), WithObserver(ar.observe))
				sizes := []int{4096, 512}
				pop := create(t, passive, kind, buffers(sizes, 1))
				aop := moved(t, ctx, act, pop.Metadata(), buffers(sizes, 2))

				got := ar.all()
				require.Len(t, got, 1, "reported before Wait returned")
				a := got[0]
				assert.Equal(t, kind, a.Kind)
				assert.Equal(t, RoleActive, a.Role)
				assert.Equal(t, backend, a.Backend)
				assert.Equal(t, aop.Backend(), a.Backend)
				assert.Equal(t, backend, a.Path)
				assert.Equal(t, uint64(4096+512), a.Bytes)
				assert.Positive(t, a.Duration)
				assert.Equal(t, StatusComplete, a.Status)
				assert.NoError(t, a.Err)

				require.NoError(t, pop.Wait(ctx))
				got = pr.all()
				require.Len(t, got, 1, "reported before Wait returned")
				p := got[0]
				assert.Equal(t, OpReport{Kind: kind, Role: RolePassive, Bytes: 4096 + 512, Duration: p.Duration, Status: StatusComplete}, p)
				assert.Positive(t, p.Duration)
				require.NoError(t, pop.Close())
				assert.Len(t, pr.all(), 1, "Close after the outcome reports nothing")
			})
		}
	}
}

// Failures are reported with their status and error: a cancelled transfer
// (and the passive side hearing of it), a passive operation closed unused,
// and a transfer no backend could start, with an empty Backend.
func TestObserverReportsFailures(t *testing.T) {
	t.Run("cancelled", func(t *testing.T) {
		ctx := guarded(t)
		var pr, ar reports
		// As stallPair, with observers.
		s := newStall()
		passive := newConnector(t, WithBackends(mem.New(), newStall()), WithObserver(pr.observe))
		act := newConnector(t, WithBackends(mem.New(), s), WithBackend(s.Name()), WithObserver(ar.observe))
		pop := expose(t, passive, KindRead, buffers([]int{1024}, 1))
		aop, err := begin(ctx, act, pop.Metadata(), buffers([]int{1024}, 2))
		require.NoError(t, err)
		<-s.posted
		aop.Cancel()
		werr := aop.Wait(ctx)
		require.ErrorIs(t, werr, ErrCancelled)
		got := ar.all()
		require.Len(t, got, 1)
		assert.Equal(t, StatusCancelled, got[0].Status)
		assert.Equal(t, "stall", got[0].Backend)
		assert.Equal(t, werr, got[0].Err, "the error Wait returns")

		perr := pop.Wait(ctx)
		require.ErrorIs(t, perr, ErrCancelled)
		got = pr.all()
		require.Len(t, got, 1)
		assert.Equal(t, RolePassive, got[0].Role)
		assert.Equal(t, StatusCancelled, got[0].Status)
		assert.Equal(t, perr, got[0].Err)
	})
	t.Run("closed unused", func(t *testing.T) {
		var pr reports
		passive := newConnector(t, WithObserver(pr.observe))
		pop := create(t, passive, KindWrite, buffers([]int{64}, 1))
		assert.Empty(t, pr.all(), "nothing is reported before the outcome")
		require.NoError(t, pop.Close())
		got := pr.all()
		require.Len(t, got, 1)
		assert.Equal(t, KindWrite, got[0].Kind)
		assert.Equal(t, StatusCancelled, got[0].Status)
		assert.ErrorIs(t, got[0].Err, ErrClosed)
	})
	t.Run("no backend", func(t *testing.T) {
		var ar reports
		passive := newConnector(t, WithBackends(tcp.New()))
		pop := expose(t, passive, KindRead, buffers([]int{4096}, 1))
		act := newConnector(t, WithBackends(mem.New(), cma.New()), WithObserver(ar.observe))
		_, err := act.BeginRead(t.Context(), pop.Metadata(), descriptors(buffers([]int{4096}, 0))...)
		require.ErrorIs(t, err, ErrNoBackend)
		got := ar.all()
		require.Len(t, got, 1)
		assert.Equal(t, RoleActive, got[0].Role)
		assert.Empty(t, got[0].Backend)
		assert.Equal(t, uint64(4096), got[0].Bytes)
		assert.Equal(t, StatusErrored, got[0].Status)
		assert.Equal(t, err, got[0].Err, "the error Begin returned")
	})
	t.Run("refused calls", func(t *testing.T) {
		var ar reports
		act := newConnector(t, WithObserver(ar.observe))
		_, err := act.BeginRead(t.Context(), Metadata{}, descriptors(buffers([]int{64}, 0))...)
		require.ErrorIs(t, err, ErrInvalidMetadata)
		assert.Empty(t, ar.all(), "a call refused outright is no operation")
	})
}

func TestWithObserverNil(t *testing.T) {
	_, err := NewConnector(quiet, WithObserver(nil))
	require.ErrorIs(t, err, ErrInvalidOption)
}

func TestRoleString(t *testing.T) {
	assert.Equal(t, "active", RoleActive.String())
	assert.Equal(t, "passive", RolePassive.String())
	assert.Equal(t, "Role(9)", Role(9).String())
}
