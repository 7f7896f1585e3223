//go:build linux

package cma

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
	"github.com/goxfer/goxfer/internal/pattern"
)

// An exposing side that cannot make a lease table (memfd refused) does not
// agree shared memory in its handshake: transfers go to leases at once.
// It used to agree first and send no table, and the first transfer on
// each connection waited WithTimeout for it (and failed, with a shorter
// deadline, every time).
func TestNoLeaseTable(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	makeLeaseTable = func(int) ([]byte, int, error) { return nil, -1, errors.New("memfd_create refused (test)") }
	t.Cleanup(func() { makeLeaseTable = newTable })
	p := newHeapPair(t, 8192, agent.AccessRead, WithTimeout(time.Minute))
	base := agent.DRAM(p.heap).Addr
	pattern.Fill(p.heap, 3, 0, 0)
	for i := range 3 {
		dst := make([]byte, 4096)
		start := time.Now()
		x := p.post(t, agent.OpRead, dst, base+uint64(i), []byte("done"))
		require.NoError(t, waitX(t, x))
		took := time.Since(start)
		require.Less(t, took, 10*time.Second, "transfer %d waited for a lease table that never comes", i)
		require.Equal(t, Name, x.Path(), "transfer %d: leases serve it", i)
		require.Equal(t, p.heap[i:i+4096], dst)
		ev := <-p.exp.Events()
		require.Equal(t, agent.EventNotify, ev.Kind)
	}
}
