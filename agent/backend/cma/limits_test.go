//go:build linux

package cma

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/serve"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// delta returns what each counter moved by from before to after.
var delta = serve.Delta

// waitStats waits until b's counters moved by want since before, and fails
// if they moved by anything else.
func waitStats(t testing.TB, b *Backend, before, want Stats) {
	t.Helper()
	backendtest.WaitCounters(t, func() Stats { return delta(b.Stats(), before) }, want, 0)
}

// readAll has active READ all of src, exposed by passive as exp, checks
// the bytes and returns the transfer.
func readAll(t testing.TB, active, passive *agent.Agent, exp *agent.Exposure, src []byte) *agent.Xfer {
	t.Helper()
	dst := make([]byte, len(src))
	x, err := active.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: passive.Info(), Key: exp.Key(),
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}})
	require.NoError(t, err)
	backendtest.DoneWithin(t, x, 20*time.Second, "a READ")
	require.NoError(t, x.Err(), "a READ failed")
	require.Equal(t, src, dst)
	return x
}

// legitRead is readAll over cma: the agent still serves honest peers.
func legitRead(t testing.TB, active, passive *agent.Agent, exp *agent.Exposure, src []byte) {
	t.Helper()
	require.Equal(t, Name, readAll(t, active, passive, exp, src).Backend())
}

func TestLimitOptions(t *testing.T) {
	for _, o := range []Option{WithMaxConnsPerProcess(0), WithMaxHandshakes(0)} {
		_, err := agent.New(agent.WithBackends(New(o)))
		require.ErrorIs(t, err, agent.ErrInvalidOption)
	}
}

// Every invalid option is reported, on one line.
func TestInvalidOptionsOnOneLine(t *testing.T) {
	_, err := agent.New(agent.WithBackends(New(WithMaxConnsPerProcess(0), WithMaxHandshakes(0), nil)))
	require.ErrorIs(t, err, agent.ErrInvalidOption)
	assert.NotContains(t, err.Error(), "\n")
	assert.Contains(t, err.Error(), "; ")
	assert.Contains(t, err.Error(), "nil option")
}

// A peer that trickles a handshake or a frame is cut within the timeout and
// counted; one that is merely idle between frames keeps its connection (the
// copying side holds it open without keepalives).
func TestSlowLoris(t *testing.T) {
	const timeout = 300 * time.Millisecond
	a, b := newAgent(t, WithTimeout(timeout))
	honest, _ := newAgent(t)
	src := bytes.Repeat([]byte{0x5A}, 4096)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	begin := frameBytes(header{typ: tBegin, status: uint8(agent.AccessRead), count: 2, id: 1, key: exp.Key()},
		[][2]uint64{{agent.DRAM(src).Addr, 16}, {agent.DRAM(src).Addr + 16, 16}}, nil)
	const gap = 20 * time.Millisecond
	for _, tc := range []struct {
		name   string
		attack func(t *testing.T) time.Duration
	}{
		{"handshake", func(t *testing.T) time.Duration {
			p := dialRaw(t, b)
			var hs [hsSize]byte
			(&handshake{self: p.id, expect: a.ID(), pid: uint32(os.Getpid())}).put(hs[:])
			return backendtest.Trickle(t, p.c, p.br, hs[:], gap)
		}},
		{"header", func(t *testing.T) time.Duration {
			p := joinRaw(t, a, b)
			return backendtest.Trickle(t, p.c, p.br, begin[:hdrSize], gap)
		}},
		{"range table", func(t *testing.T) time.Duration {
			p := joinRaw(t, a, b)
			_, err = p.c.Write(begin[:hdrSize+3])
			require.NoError(t, err)
			return backendtest.Trickle(t, p.c, p.br, begin[hdrSize+3:], gap)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := b.Stats()
			took := tc.attack(t)
			t.Logf("cut after %v (timeout %v)", took, timeout)
			waitStats(t, b, before, Stats{Disconnected: 1, Timeouts: 1})
			legitRead(t, honest, a, exp, src)
		})
	}
	t.Run("idle between frames", func(t *testing.T) {
		before := b.Stats()
		p := joinRaw(t, a, b)
		time.Sleep(3 * timeout)
		p.send(header{typ: tBegin, status: uint8(agent.AccessRead), count: 1, id: 1, key: exp.Key()}, [][2]uint64{{agent.DRAM(src).Addr, 16}}, nil)
		h, _, err := p.grant()
		require.NoError(t, err)
		require.Equal(t, uint8(stOK), h.status)
		p.send(header{typ: tEnd, id: 1}, nil, nil)
		assert.Equal(t, Stats{}, delta(b.Stats(), before))
	})
	assert.Equal(t, bytes.Repeat([]byte{0x5A}, 4096), src)
}

// A flood of connections that never handshake holds at most
// WithMaxHandshakes of them, the oldest closed and counted; an honest peer
// gets through while the flood goes on. One process is held to
// WithMaxConnsPerProcess.
func TestConnectionFloods(t *testing.T) {
	t.Run("handshakes", func(t *testing.T) {
		const limit = 8
		a, b := newAgent(t, WithMaxHandshakes(limit), WithTimeout(30*time.Second))
		honest, _ := newAgent(t)
		src := bytes.Repeat([]byte{0x5A}, 4096)
		exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
		require.NoError(t, err)
		before := b.Stats()
		f := backendtest.NewFlood(t, func() (net.Conn, error) { return net.Dial("unix", "@"+b.self.sock) })
		const flood = 100
		f.Open(flood)
		require.Eventually(t, func() bool { return b.Stats().LimitRejected-before.LimitRejected == flood-limit }, 10*time.Second, time.Millisecond)
		f.During(func() {
			for range 3 {
				legitRead(t, honest, a, exp, src)
			}
		})
		got := delta(b.Stats(), before)
		assert.Equal(t, got.LimitRejected, got.Disconnected)
		f.OldestDropped(t)
	})
	t.Run("one process", func(t *testing.T) {
		const limit = 4
		a, b := newAgent(t, WithMaxConnsPerProcess(limit))
		before := b.Stats()
		var ok, refused int
		for range limit + 3 {
			p := dialRaw(t, b)
			var hs [hsSize]byte
			(&handshake{self: p.id, expect: a.ID(), pid: uint32(os.Getpid())}).put(hs[:])
			_, _ = p.c.Write(hs[:]) // a refused connection may be closed already
			_ = p.c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.ReadFull(p.br, hs[:]); err != nil {
				var ne net.Error
				require.False(t, errors.As(err, &ne) && ne.Timeout(), "a connection over the limit was kept")
				refused++
				continue
			}
			in, err := getHandshake(hs[:])
			require.NoError(t, err)
			require.Equal(t, uint8(stOK), in.status)
			ok++
		}
		assert.Equal(t, limit, ok)
		assert.Equal(t, 3, refused)
		waitStats(t, b, before, Stats{Disconnected: 3, LimitRejected: 3})
	})
}

// Lease requests after the agent closed get nothing: the connection is
// closed and no lease is granted.
func TestRequestsAfterAgentClosed(t *testing.T) {
	a, b := newAgent(t)
	src := make([]byte, 4096)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	p := joinRaw(t, a, b)
	require.NoError(t, a.Close())
	_, _ = p.c.Write(frameBytes(header{typ: tBegin, status: uint8(agent.AccessRead), count: 1, id: 1, key: exp.Key()}, [][2]uint64{{agent.DRAM(src).Addr, 16}}, nil))
	_ = p.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(p.br)
	var ne net.Error
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "a closed agent kept the connection")
	for len(got) >= hdrSize {
		var h header
		h.get(got)
		require.NotEqual(t, uint8(stOK), h.status, "a closed agent granted a lease")
		got = got[min(len(got), hdrSize+int(h.length)):]
	}
}
