package tcp

import (
	"bytes"
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/serve"
	"github.com/goxfer/goxfer/agent/backendtest"
)

func TestLimitOptions(t *testing.T) {
	for _, o := range [][]Option{
		{WithMaxFrameSize(1)}, {WithMaxFrameSize(1 << 30)},
		{WithMaxPieces(0)}, {WithMaxPieces(1 << 16)},
		{WithMaxConnsPerPeer(1)}, {WithMaxConnsPerIP(0)}, {WithMaxHandshakes(0)},
		{WithMaxFrameSize(1 << 20)}, // below the default 2 MiB chunk
		{WithChunkSize(8 << 20), WithMaxFrameSize(4 << 20)},
		{WithMaxConnsPerPeer(64), WithMaxConnsPerIP(32)},
		{WithStreams(16), WithMaxConnsPerPeer(16)}, // no room for the control connection
	} {
		_, err := agent.New(agent.WithBackends(New(o...)))
		require.ErrorIs(t, err, agent.ErrInvalidOption)
	}
	a, err := agent.New(agent.WithBackends(New(WithChunkSize(64<<10), WithMaxFrameSize(64<<10), WithMaxPieces(16),
		WithStreams(1), WithMaxConnsPerPeer(2), WithMaxConnsPerIP(2), WithMaxHandshakes(1))))
	require.NoError(t, err)
	require.NoError(t, a.Close())
}

// A peer that trickles any part of its traffic, or reads its answers too
// slowly, is cut within the keepalive timeout: it holds a goroutine, and a
// lease, for no longer. It is counted as a timeout. Each attack runs in
// fake time; the slow reader, whom the kernel's socket buffers serve
// first, over loopback too.
func TestSlowLoris(t *testing.T) {
	const timeout = 300 * time.Millisecond
	const gap = 20 * time.Millisecond
	type attack func(t *testing.T, tg *target) time.Duration
	run := func(t *testing.T, nw network, attack attack) {
		tg := newTarget(t, nw, WithKeepalive(50*time.Millisecond, timeout))
		before := tg.b.Stats()
		took := attack(t, tg)
		t.Logf("cut after %v (keepalive timeout %v)", took, timeout)
		waitStats(t, tg.b, before, Stats{Disconnected: 1, Timeouts: 1})
		tg.stillServes(t, nil)
	}
	readR := func(tg *target) []byte {
		return frameBytes(header{typ: tRead, count: 1, id: 1, key: tg.ex.r.Key()}, [][2]uint64{{agent.DRAM(tg.g.r).Addr, page}}, nil)
	}
	slowReader := func(t *testing.T, tg *target) time.Duration {
		big := bytes.Repeat([]byte{exposedB}, 16<<20)
		bigExp := expose(t, tg.a, agent.AccessRead, big)
		defer bigExp.Revoke()
		p, _ := dialHostile(t, tg.b, tg.a.ID())
		setReadBuffer(t, p.c, 4096)
		_, err := p.c.Write(frameBytes(header{typ: tRead, count: 1, id: 1, key: bigExp.Key()}, [][2]uint64{{agent.DRAM(big).Addr, 16 << 20}}, nil))
		require.NoError(t, err)
		start := time.Now()
		// Read a trickle of the answer, far too slowly for 16 MiB,
		// until the server counts the cut: what it sent before then
		// would take this reader minutes to drain.
		before := tg.b.Stats()
		stop := make(chan struct{})
		var wg sync.WaitGroup
		defer wg.Wait()
		defer close(stop)
		wg.Go(func() {
			var one [1]byte
			for {
				select {
				case <-stop:
					return
				case <-time.After(gap):
				}
				if _, err := p.c.Read(one[:]); err != nil {
					return
				}
			}
		})
		require.Eventually(t, func() bool { return tg.b.Stats().Timeouts > before.Timeouts }, 20*time.Second, time.Millisecond,
			"the server never cut a slow reader")
		took := time.Since(start)
		_ = p.c.Close()
		return took
	}
	for _, tc := range []struct {
		name   string
		attack attack
	}{
		{"handshake", func(t *testing.T, tg *target) time.Duration {
			var hs [hsSize]byte
			(&handshake{self: uuid.New(), expect: tg.a.ID(), timeout: time.Minute}).put(hs[:])
			c := dialBackend(t, tg.b)
			return backendtest.Trickle(t, c, c, hs[:], gap)
		}},
		{"silent after the handshake", func(t *testing.T, tg *target) time.Duration {
			p, _ := dialHostile(t, tg.b, tg.a.ID())
			start := time.Now()
			p.dropped(t)
			return time.Since(start)
		}},
		{"header", func(t *testing.T, tg *target) time.Duration {
			p, _ := dialHostile(t, tg.b, tg.a.ID())
			return backendtest.Trickle(t, p.c, p.c, readR(tg)[:hdrSize], gap)
		}},
		{"piece table", func(t *testing.T, tg *target) time.Duration {
			table := make([][2]uint64, 64)
			for i := range table {
				table[i] = [2]uint64{agent.DRAM(tg.g.r).Addr + uint64(i), 1}
			}
			f := frameBytes(header{typ: tRead, count: 64, id: 1, key: tg.ex.r.Key()}, table, nil)
			p, _ := dialHostile(t, tg.b, tg.a.ID())
			_, err := p.c.Write(f[:hdrSize+8])
			require.NoError(t, err)
			return backendtest.Trickle(t, p.c, p.c, f[hdrSize+8:], gap)
		}},
		{"WRITE payload", func(t *testing.T, tg *target) time.Duration {
			g := tg.g
			w := expose(t, tg.a, agent.AccessWrite, g.w)
			p, _ := dialHostile(t, tg.b, tg.a.ID())
			f := frameBytes(header{typ: tWrite, count: 1, id: 1, length: page, key: w.Key()}, [][2]uint64{{agent.DRAM(g.w).Addr, page}}, make([]byte, page))
			_, err := p.c.Write(f[:hdrSize+pieceSize+1])
			require.NoError(t, err)
			// The lease it holds meanwhile is released by the cut: Revoke
			// returns within the same bound.
			revoked := make(chan time.Duration)
			go func() {
				start := time.Now()
				time.Sleep(gap)
				w.Revoke()
				revoked <- time.Since(start)
			}()
			took := backendtest.Trickle(t, p.c, p.c, f[hdrSize+pieceSize+1:], gap)
			select {
			case d := <-revoked:
				t.Logf("Revoke waited %v for the trickling WRITE's lease", d)
			case <-time.After(20 * time.Second):
				t.Fatal("Revoke hung on a trickling WRITE")
			}
			return took
		}},
		{"slow reader", slowReader},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bubble(t, func(t *testing.T, nw *memNet) { run(t, nw, tc.attack) })
		})
	}
	t.Run("slow reader over loopback", func(t *testing.T) { run(t, loopback, slowReader) })
}

// A flood of connections that never handshake holds at most
// WithMaxHandshakes of them: the oldest are closed and counted, and an
// honest peer gets through while the flood goes on.
func TestHandshakeFlood(t *testing.T) {
	const limit = 16
	// Handshakes may take 30 s: none of the flood ends by itself.
	tg := newTarget(t, loopback, WithMaxHandshakes(limit), WithKeepalive(time.Second, 30*time.Second))
	b := tg.b
	before := b.Stats()

	f := backendtest.NewFlood(t, func() (net.Conn, error) { return net.Dial("tcp", b.Addr().String()) })
	const flood = 200
	f.Open(flood)
	require.Eventually(t, func() bool { return b.Stats().LimitRejected-before.LimitRejected == flood-limit }, 10*time.Second, time.Millisecond)
	assert.LessOrEqual(t, b.gate.Len(), limit)

	f.During(func() { // the flood goes on during the honest transfers
		for range 3 {
			tg.stillServes(t, nil)
		}
	})
	got := serve.Delta(b.Stats(), before)
	assert.Equal(t, got.LimitRejected, got.Disconnected)
	assert.Zero(t, got.HandshakeFailures+got.ProtocolErrors+got.Timeouts+got.Denied)
	t.Logf("%d connections in the flood, %d closed to make room", f.Len(), got.LimitRejected)

	// The flood's oldest connections were closed by the server.
	f.OldestDropped(t)
	tg.g.intact(t, nil)
}

// dialFrom dials b from a second loopback address, or skips the test.
func dialFrom(t *testing.T, b *Backend) func() net.Conn {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	c, err := d.Dial("tcp", b.Addr().String())
	if err != nil {
		t.Skipf("no second loopback address: %v", err)
	}
	first := c
	return func() net.Conn {
		if first != nil {
			c, first = first, nil
			return c
		}
		c, err := d.Dial("tcp", b.Addr().String())
		require.NoError(t, err)
		return c
	}
}

// handshakeOn sends a handshake on c as self and returns the answer's
// status, or an error if the connection was closed first.
func handshakeOn(t *testing.T, c net.Conn, self, expect uuid.UUID) (uint8, error) {
	t.Helper()
	in, err := greet(c, handshake{self: self, expect: expect, timeout: time.Minute})
	return in.status, err
}

// One address claiming many identities is held to WithMaxConnsPerIP, and
// one identity at one address to WithMaxConnsPerPeer; a stranger claiming an
// honest peer's identity from elsewhere does not use up the honest peer's
// share. Honest peers get through throughout.
func TestConnectionFloods(t *testing.T) {
	const perIP, perPeer = 24, 8
	tg := newTarget(t, loopback, WithMaxConnsPerIP(perIP), WithMaxConnsPerPeer(perPeer), WithStreams(2))
	a, b := tg.a, tg.b
	dial := dialFrom(t, b)

	t.Run("identities from one address", func(t *testing.T) {
		before := b.Stats()
		var ok, refused int
		for range perIP + 16 {
			c := dial()
			defer c.Close()
			status, err := handshakeOn(t, c, uuid.New(), a.ID())
			switch {
			case err == nil && status == stOK:
				ok++
			case err != nil:
				refused++ // closed at accept, before a byte was read
			default:
				t.Fatalf("handshake answered with status %d", status)
			}
		}
		assert.Equal(t, perIP, ok)
		assert.Equal(t, 16, refused)
		waitStats(t, b, before, Stats{Disconnected: 16, LimitRejected: 16})
		tg.stillServes(t, nil)
	})
	require.Eventually(t, func() bool { return b.byIP.Len() == 1 }, 10*time.Second, time.Millisecond,
		"the closed connections are uncounted")

	t.Run("one identity from one address", func(t *testing.T) {
		before := b.Stats()
		// The stranger claims the honest agent's identity.
		var statuses []uint8
		for range perPeer + 2 {
			c := dial()
			defer c.Close()
			status, err := handshakeOn(t, c, tg.honest.ID(), a.ID())
			require.NoError(t, err)
			statuses = append(statuses, status)
		}
		assert.Equal(t, append(bytes.Repeat([]byte{stOK}, perPeer), stLimit, stLimit), statuses)
		waitStats(t, b, before, Stats{Disconnected: 2, LimitRejected: 2})
		// The honest agent, from its own address, is unaffected.
		tg.stillServes(t, nil)
		tg.stillServes(t, nil)
	})
	tg.g.intact(t, nil)
}

// An honest agent over the passive side's per-peer limit hears why.
func TestOverPeerLimitSaysWhy(t *testing.T) {
	a, _ := newAgent(t, WithStreams(1), WithMaxConnsPerPeer(2))
	active, _ := newAgent(t, WithStreams(4))
	src := make([]byte, 64)
	exp := expose(t, a, agent.AccessRead, src)
	x, err := active.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: a.Info(), Key: exp.Key(),
		Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 64)), Remote: agent.DRAM(src).Region}}})
	require.NoError(t, err)
	<-x.Done()
	require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
	assert.Contains(t, x.Err().Error(), "WithMaxConnsPerPeer")
}
