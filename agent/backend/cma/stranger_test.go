//go:build linux

package cma

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// A local process without a key that connects claiming an honest peer's ID,
// asks for something and hangs up must not fail the exposure that peer
// used: the exposure hears of a loss only through the links that presented
// its key. The honest peer reads over tcp, so the stranger's connection is
// the only cma connection in that peer's name.
func TestStrangerHangupIsNoLoss(t *testing.T) {
	cb := New()
	exposing := backendtest.NewAgent(t, cb, tcp.New())
	honest := backendtest.NewAgent(t, tcp.New())

	src, exp := exposeRead(t, exposing, 64<<10)
	readAll(t, honest, exposing, exp, src)

	// The stranger: a real handshake in the honest peer's name, a lease
	// request with a guessed key, and a hang-up.
	p := dialRaw(t, cb)
	p.id = honest.ID()
	in, err := p.hello(exposing.ID(), os.Getpid())
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), in.status)
	p.send(header{typ: tBegin, status: uint8(agent.AccessRead), count: 1, id: 1, key: agent.NewKey()}, [][2]uint64{{agent.DRAM(src).Addr, 16}}, nil)
	h, _, err := p.grant()
	require.NoError(t, err)
	require.Equal(t, uint8(stDenied), h.status)
	require.NoError(t, p.c.Close())
	// Once the exposing side has let go of the connection, whatever it
	// reported is in the exposure's queue.
	require.Eventually(t, func() bool { return cb.conns.Len() == 0 }, 5*time.Second, time.Millisecond)
	select {
	case ev := <-exp.Events():
		t.Fatalf("the exposure heard %v from %s (%v) after a stranger in its peer's name hung up", ev.Kind, ev.From, ev.Err)
	default:
	}
}
