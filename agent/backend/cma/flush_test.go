//go:build linux

package cma

import (
	"bufio"
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// A transfer's notification goes out after its Wait is released
// (agent.Work.FinishNotify); when the connection's socket is busy it waits
// in the writer's queue. Close, called right after the Wait, sends it
// before it closes the connection: the exposing side hears the
// notification, not the loss of its peer.
func TestCloseFlushesQueuedNotification(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	p := newHeapPair(t, 8192, agent.AccessRead)
	base := agent.DRAM(p.heap).Addr
	p.connect(t, agent.OpRead, base)
	p.bc.mu.Lock()
	q := p.bc.peers[p.a.ID()][0]
	p.bc.mu.Unlock()
	q.qmu.Lock()
	q.writing = true // a write under way: the notification must be queued
	q.qmu.Unlock()

	x := p.post(t, agent.OpRead, make([]byte, 4096), base, []byte("done"))
	require.NoError(t, waitX(t, x))
	require.Equal(t, Name+"+table", x.Path())
	q.qmu.Lock()
	queued := q.qnote
	q.qmu.Unlock()
	require.NotZero(t, queued, "the notification was queued behind the write under way")

	closed := make(chan error, 1)
	go func() { closed <- p.c.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while the notification of a finished transfer was still queued", err)
	case <-time.After(50 * time.Millisecond):
	}
	q.qmu.Lock()
	q.writing = false // the write under way ends
	q.qmu.Unlock()
	select {
	case q.qwake <- struct{}{}:
	default:
	}
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return once the queue was written")
	}
	select {
	case ev := <-p.exp.Events():
		require.Equal(t, agent.EventNotify, ev.Kind, "the exposing side's first event: %+v", ev)
		require.Equal(t, "done", string(ev.Msg))
	case <-time.After(10 * time.Second):
		t.Fatal("no notification")
	}
}

// A peer that stopped reading holds Close up for at most closeFlush while
// notifications to it are still queued, even under a long WithTimeout.
func TestCloseFlushBounded(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	f := newFakeExposer(t, func(c *net.UnixConn, br *bufio.Reader) {}) // never reads again
	a, b := newAgent(t, WithTimeout(time.Minute))
	require.NoError(t, b.Reachable(context.Background(), f.info))
	msg := make([]byte, 64<<10)
	for range 32 { // 2 MiB: more than the socket takes, less than Notify queues
		require.NoError(t, b.Notify(context.Background(), f.info, agent.NewKey(), msg))
	}
	start := time.Now()
	require.NoError(t, a.Close())
	took := time.Since(start)
	require.Less(t, took, closeFlush+5*time.Second, "Close against a peer that reads nothing")
	t.Logf("Close took %v with notifications queued to a peer that reads nothing", took.Round(time.Millisecond))
}
