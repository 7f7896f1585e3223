package agent

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// refusingBackend is a stubBackend whose Reachable refuses with err.
type refusingBackend struct {
	stubBackend
	err error
}

func (b *refusingBackend) Reachable(context.Context, Info) error { return b.err }

// records is a slog.Handler that keeps every record.
type records struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (h *records) Enabled(context.Context, slog.Level) bool { return true }
func (h *records) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.recs = append(h.recs, r.Clone())
	return nil
}
func (h *records) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *records) WithGroup(string) slog.Handler      { return h }

// fallbacks returns the levels and reasons of the fallback records.
func (h *records) fallbacks() (levels []slog.Level, reasons []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range h.recs {
		if r.Message != "goxfer: preferred backends unavailable for peer" {
			continue
		}
		levels = append(levels, r.Level)
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "reasons" {
				reasons = append(reasons, a.Value.String())
			}
			return true
		})
	}
	return levels, reasons
}

// A fast path passed over on the normal path (out of reach, or not
// published by the peer) is logged at Debug level; one that should have
// worked, at Info level. Either is logged once per peer, on one line.
func TestFallbackLogLevel(t *testing.T) {
	elsewhere := OutOfReach("peer is in another process")
	denied := errors.New("peer 1234 denies process_vm_readv: operation not permitted")
	cases := []struct {
		name      string
		refusals  []error // of the backends before the one chosen
		published []bool  // whether the peer publishes each
		want      slog.Level
	}{
		{"out of reach", []error{elsewhere}, []bool{true}, slog.LevelDebug},
		{"two out of reach", []error{elsewhere, OutOfReach("peer runs on another host")}, []bool{true, true}, slog.LevelDebug},
		{"not published by the peer", []error{errors.New("peer has no fast backend")}, []bool{false}, slog.LevelDebug},
		{"denied on the same host", []error{denied}, []bool{true}, slog.LevelInfo},
		{"out of reach, then denied", []error{elsewhere, denied}, []bool{true, true}, slog.LevelInfo},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := &records{}
			var bs []Backend
			var conns []ConnInfo
			for i, err := range c.refusals {
				name := "fast" + string(rune('a'+i))
				bs = append(bs, &refusingBackend{stubBackend: stubBackend{name: name}, err: err})
				if c.published[i] {
					conns = append(conns, ConnInfo{Backend: name})
				}
			}
			bs = append(bs, &stubBackend{name: "slow"})
			conns = append(conns, ConnInfo{Backend: "slow"})
			a, err := New(WithBackends(bs...), WithLogger(slog.New(h)))
			require.NoError(t, err)
			t.Cleanup(func() { assert.NoError(t, a.Close()) })

			peer := Info{ID: uuid.New(), Conns: conns}
			for range 3 {
				b, err := a.choose(context.Background(), peer, NewKey(), AccessRead, "", false)
				require.NoError(t, err)
				assert.Equal(t, "slow", b.Name())
			}
			levels, reasons := h.fallbacks()
			assert.Equal(t, []slog.Level{c.want}, levels, "logged once, at %v", c.want)
			require.Len(t, reasons, 1)
			assert.NotContains(t, reasons[0], "\n")
			for _, err := range c.refusals {
				assert.Contains(t, reasons[0], err.Error())
			}
		})
	}
}

func TestOutOfReach(t *testing.T) {
	err := OutOfReach("peer is in another process")
	assert.Equal(t, "peer is in another process", err.Error())
	assert.ErrorIs(t, err, ErrOutOfReach)
	assert.NotErrorIs(t, errors.New("peer is in another process"), ErrOutOfReach)
}

// The error of a peer no backend reaches names every backend's reason on
// one line, and each still matches.
func TestNoBackendErrorIsOneLine(t *testing.T) {
	denied := errors.New("denied")
	a := newTestAgent(t, &refusingBackend{stubBackend: stubBackend{name: "one"}, err: OutOfReach("elsewhere")}, &refusingBackend{stubBackend: stubBackend{name: "two"}, err: denied})
	peer := Info{ID: uuid.New(), Conns: []ConnInfo{{Backend: "one"}, {Backend: "two"}}}
	_, err := a.choose(context.Background(), peer, NewKey(), AccessRead, "", false)
	require.ErrorIs(t, err, ErrNoBackend)
	require.ErrorIs(t, err, ErrOutOfReach)
	require.ErrorIs(t, err, denied)
	assert.Equal(t, "goxfer: no usable backend for peer "+peer.ID.String()+": one: elsewhere; two: denied", err.Error())
}
