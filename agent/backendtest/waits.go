package backendtest

import (
	"errors"
	"fmt"
	"os"
	"runtime/pprof"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// Finished reports whether x has finished, without waiting.
func Finished(x *agent.Xfer) bool { return isDone(x) }

// DoneWithin waits for x to finish and returns how long that took; it
// fails t, naming what, if x is still running after d.
func DoneWithin(t testing.TB, x *agent.Xfer, d time.Duration, what string) time.Duration {
	t.Helper()
	start := time.Now()
	select {
	case <-x.Done():
	case <-time.After(d):
		t.Fatalf("%s: the transfer did not finish within %v", what, d)
	}
	return time.Since(start)
}

// Watchdog ends the test binary, with exit status 3 and every goroutine's
// stack on stderr, if the test is still running after d: a hang is a
// finding, not a test timeout. Inside a synctest bubble, d is the
// bubble's time.
func Watchdog(t *testing.T, d time.Duration) {
	t.Helper()
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		select {
		case <-stop:
		case <-time.After(d):
			fmt.Fprintf(os.Stderr, "watchdog: %s still running after %v; goroutines:\n", t.Name(), d)
			_ = pprof.Lookup("goroutine").WriteTo(os.Stderr, 2)
			os.Exit(3)
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
}

// WaitCounters waits, for up to 10 s, until moved (how a backend's
// counters moved since the test's snapshot) returns want, and fails t if
// it does not. With settle > 0 it then waits settle more and checks that
// nothing else arrived late.
func WaitCounters(t testing.TB, moved func() agent.BackendStats, want agent.BackendStats, settle time.Duration) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for moved() != want {
		if time.Now().After(deadline) {
			t.Fatalf("want counters to move by %+v, got %+v", want, moved())
		}
		time.Sleep(time.Millisecond)
	}
	if settle > 0 {
		time.Sleep(settle)
		assert.Equal(t, want, moved(), "counters moved on after %v", settle)
	}
}

// CloseWithin closes a and returns Close's error; it fails t, naming what,
// if Close takes longer than d.
func CloseWithin(t testing.TB, a *agent.Agent, d time.Duration, what string) error {
	t.Helper()
	closed := make(chan error, 1)
	go func() { closed <- a.Close() }()
	select {
	case err := <-closed:
		return err
	case <-time.After(d):
		t.Fatalf("%s: Agent.Close did not return within %v", what, d)
		return nil
	}
}

// Depart declares peer departed from a ([agent.Agent.PeerDeparted]) with
// an error that reads cause, while x, a transfer to that peer, still runs
// (it fails t if x has ended). x must then end within d, with
// [agent.ErrRemoteLost] and cause in its error. Depart returns how long x
// took to end.
func Depart(t testing.TB, a *agent.Agent, peer uuid.UUID, x *agent.Xfer, cause string, d time.Duration) time.Duration {
	t.Helper()
	if isDone(x) {
		t.Fatalf("the transfer ended before the departure: %v", x.Err())
	}
	start := time.Now()
	a.PeerDeparted(peer, errors.New(cause))
	select {
	case <-x.Done():
	case <-time.After(d):
		t.Fatalf("the departed peer's transfer did not end within %v of the departure", d)
	}
	require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
	assert.Contains(t, x.Err().Error(), cause)
	return time.Since(start)
}
