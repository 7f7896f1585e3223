//go:build linux

package cma_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// TestLeaseCloseRace races transfers against the exposing side's Revoke
// and Close and the copying side's Close, many times with small leases:
// once Revoke or Close returns on the exposing side no byte of its memory
// may change, a READ that succeeded saw only what was there before, and
// nothing hangs or leaks. Run it with -race.
func TestLeaseCloseRace(t *testing.T) {
	rounds := 60
	if testing.Short() {
		rounds = 12
	}
	const size = 1<<20 + 123
	opts := []cma.Option{cma.WithLeaseSize(64 << 10), cma.WithChunkSize(16 << 10), cma.WithWorkers(2)}
	caught := map[string]int{}
	for i := range rounds {
		for _, race := range []string{"Revoke", "PassiveClose", "ActiveClose"} {
			for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
				t.Run(fmt.Sprintf("%d/%s/%v", i, race, op), func(t *testing.T) {
					if raceOnce(t, opts, race, op, size, i%3) {
						caught[fmt.Sprintf("%s/%v", race, op)]++
					}
				})
			}
		}
	}
	t.Logf("of %d rounds each, transfers interrupted: %v", rounds, caught)
}

// raceOnce runs one race and reports whether it interrupted the transfer.
func raceOnce(t *testing.T, opts []cma.Option, race string, op agent.Op, size, delay int) bool {
	a, p := backendtest.Pair(t, cma.New, opts...)
	old, local := make([]byte, size), make([]byte, size)
	for i := range old {
		old[i] = byte(i*13 + 1)
		local[i] = byte(i*7 + 2)
	}
	exposed := bytes.Clone(old)
	e, err := p.Expose(op.Access(), []agent.Local{agent.DRAM(exposed)})
	require.NoError(t, err)
	x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: e.Key(), Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: agent.DRAM(exposed).Region}}})
	require.NoError(t, err)
	switch delay { // vary the moment the race starts
	case 1:
		runtime.Gosched()
	case 2:
		for e.Peer() == uuid.Nil && !backendtest.Finished(x) {
			time.Sleep(time.Duration(rand.IntN(50)) * time.Microsecond)
		}
	}
	switch race {
	case "Revoke", "PassiveClose":
		if race == "Revoke" {
			e.Revoke()
		} else {
			require.NoError(t, p.Close())
		}
		snap := bytes.Clone(exposed)
		if op == agent.OpRead {
			clear(exposed) // reused at once: a READ in flight must not see it
		}
		<-x.Done()
		err := x.Err()
		if op == agent.OpWrite {
			require.True(t, bytes.Equal(snap, exposed), "exposed memory changed after %s returned (transfer: %v)", race, err)
		}
		if err == nil && op == agent.OpRead {
			require.True(t, bytes.Equal(old, local), "a READ that succeeded saw memory reused after %s", race)
		}
		if err != nil {
			if race == "Revoke" {
				require.ErrorIs(t, err, agent.ErrAccessDenied)
			} else {
				require.ErrorIs(t, err, agent.ErrRemoteLost)
			}
		}
		return err != nil
	case "ActiveClose":
		require.NoError(t, a.Close())
		require.True(t, backendtest.Finished(x), "Close returned before its transfer finished")
		if err := x.Err(); err != nil {
			require.ErrorIs(t, err, agent.ErrClosed)
		}
		e.Revoke() // must not wait for a lease of the closed agent
		snap := bytes.Clone(exposed)
		runtime.Gosched()
		require.True(t, bytes.Equal(snap, exposed))
		return x.Err() != nil
	}
	return false
}
