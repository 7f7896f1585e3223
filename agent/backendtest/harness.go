package backendtest

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/pattern"
)

// newAgent starts an agent on a fresh set of the backends under test and
// closes it when the test ends.
func newAgent(t *testing.T, cfg Config) *agent.Agent {
	t.Helper()
	bs, err := cfg.New()
	require.NoError(t, err, "factory")
	a, err := agent.New(agent.WithBackends(bs...))
	require.NoError(t, err, "agent.New")
	t.Cleanup(func() { assert.NoError(t, a.Close(), "agent.Close") })
	return a
}

// newPair starts an active and a passive agent.
func newPair(t *testing.T, cfg Config) (active, passive *agent.Agent) {
	t.Helper()
	return newAgent(t, cfg), newAgent(t, cfg)
}

// expose exposes b on a for acc and revokes the exposure when the test ends.
func expose(t *testing.T, a *agent.Agent, acc agent.Access, b *buffers) *agent.Exposure {
	t.Helper()
	return exposeLocals(t, a, acc, b.locals)
}

// exposeLocals exposes locals on a for acc and revokes the exposure when
// the test ends.
func exposeLocals(t *testing.T, a *agent.Agent, acc agent.Access, locals []agent.Local) *agent.Exposure {
	t.Helper()
	e, err := a.Expose(acc, locals)
	require.NoError(t, err, "Expose")
	t.Cleanup(e.Revoke)
	return e
}

// side is the memory of one agent in a transfer: its buffers, registered
// with the agent, filled with a pattern of their own.
func side(t *testing.T, a *agent.Agent, sizes []int) (*buffers, uint64) {
	t.Helper()
	b := newBuffers(sizes)
	t.Cleanup(b.free) // after the exposures' revocations, registered later
	seed := pattern.NextSeed()
	b.Fill(seed)
	b.register(t, a)
	return b, seed
}

// waitXfer waits for x to finish and returns its error.
func waitXfer(t *testing.T, x *agent.Xfer) error {
	t.Helper()
	select {
	case <-x.Done():
		return x.Err()
	case <-time.After(hangGuard):
		t.Fatalf("%v transfer of %d bytes over %s still running after %v", x.Op(), x.Bytes(), x.Backend(), hangGuard)
		return nil
	}
}

// waitEvent waits up to within for the next event on e.
func waitEvent(t *testing.T, e *agent.Exposure, within time.Duration) agent.Event {
	t.Helper()
	select {
	case ev := <-e.Events():
		return ev
	case <-time.After(within):
		t.Fatalf("no event on exposure %v within %v", e.Key(), within)
		return agent.Event{}
	}
}

// noEvent asserts that e has no event queued.
func noEvent(t *testing.T, e *agent.Exposure) {
	t.Helper()
	select {
	case ev := <-e.Events():
		t.Errorf("unexpected event on exposure %v: %+v", e.Key(), ev)
	default:
	}
}

// waitAccessed waits until a peer has accessed e (the backend opened a
// lease on it), which shows a transfer against e is under way. It returns
// false if x finished first. [agent.Exposure.Peer] is the only race-free
// view of a transfer's progress on the passive side, hence the polling.
func waitAccessed(t *testing.T, e *agent.Exposure, x *agent.Xfer) bool {
	t.Helper()
	deadline := time.Now().Add(hangGuard)
	for e.Peer() == uuid.Nil {
		if isDone(x) {
			return false
		}
		if time.Now().After(deadline) {
			t.Fatalf("transfer did not access the exposure within %v", hangGuard)
		}
		time.Sleep(100 * time.Microsecond)
	}
	return !isDone(x)
}

// postWait posts r from a and waits for the transfer: the error of Post
// or of the transfer.
func postWait(t *testing.T, a *agent.Agent, r agent.Request) error {
	t.Helper()
	x, err := a.Post(context.Background(), r)
	if err != nil {
		return err
	}
	return waitXfer(t, x)
}

// isDone reports whether x has finished.
func isDone(x *agent.Xfer) bool {
	select {
	case <-x.Done():
		return true
	default:
		return false
	}
}
