//go:build linux

package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/serve"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// Adversarial tests of the reworked tcp backend's promises: cancelling
// never waits for the peer, Revoke within one timeout, busy pings, sessions,
// outgoing bounds, idle reaping.

// nonReader is a passive peer that answers the handshake and then never
// reads a byte: whatever is written to it stays in the socket buffers.
func nonReader(t *testing.T, nw network) agent.Info {
	stop := make(chan struct{})
	info := fakePassive(t, nw, uuid.New(), func(c net.Conn) { <-stop })
	t.Cleanup(func() { close(stop) }) // runs before fakePassive's cleanup
	return info
}

// Cancelling a transfer never waits for the peer, the docs say, "whatever
// the peer does": also not a transfer whose driving goroutine waits for a
// stream's write lock, held by ANOTHER transfer's frame that a peer takes
// slowly (or not at all). send waits for the lock with wlock.lockOr, which
// gives up when the transfer is cancelled; once it waited with a plain
// lock while holding a part of the transfer, which abandon did not
// release. Nor does the agent's Close, which cancels every transfer and
// waits for them.
func TestAttackCancelWaitsBehindAnotherTransfersWrite(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		backendtest.Watchdog(t, 60*time.Second)
		peer := nonReader(t, nw)
		const big = 64 << 20
		a, _ := newAgent(t, nw, WithStreams(1), WithChunkSize(16<<20), WithKeepalive(time.Second, 30*time.Second))
		y := postFake(t, a, agent.OpWrite, peer, make([]byte, big))
		time.Sleep(300 * time.Millisecond) // y's first frame fills the socket buffers and blocks, holding the write lock
		const n = 1 << 20                  // above inlineMax: driven from a goroutine
		x := postFake(t, a, agent.OpRead, peer, make([]byte, n))
		time.Sleep(100 * time.Millisecond)
		x.Cancel(nil)
		start := time.Now()
		select {
		case <-x.Done():
			t.Logf("cancelled after %v", time.Since(start))
		case <-time.After(2 * time.Second):
			t.Errorf("Cancel of a transfer queued behind another transfer's frame did not finish within 2s (the peer never reads; keepalive timeout 30s)")
		}
		// The agent's Close cancels every transfer and waits for them: it
		// waits for the peer too (y's cancelled frame is now padded with
		// zeros under the same lock, at the peer's pace).
		start = time.Now()
		closed := make(chan error, 1)
		go func() { closed <- a.Close() }()
		select {
		case <-closed:
			t.Logf("Close returned after %v", time.Since(start))
		case <-time.After(2 * time.Second):
			t.Errorf("Close did not return within 2s: it waits for a peer that never reads")
			<-closed
			t.Logf("Close returned after %v", time.Since(start))
		}
		_ = y
	})
}

// stuckReader connects to b as a fresh identity, announcing a keepalive
// timeout of 30 ms (so b pings it every 10 ms), keeps b's server side
// alive with its own pings, and never reads a byte, with the smallest
// receive buffer the kernel allows (or 1 KiB on a memNet): b's pings to it
// soon fill the socket buffers. If fill, it first asks for refusals (a
// forged key) to fill them faster. It needs no key.
func stuckReader(t *testing.T, b *Backend, expect uuid.UUID, fill int) net.Conn {
	t.Helper()
	var c net.Conn
	if b.cfg.testDial != nil {
		c = dialBackend(t, b)
		c.(*memConn).setReadBuffer(1 << 10)
	} else {
		d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
			return rc.Control(func(fd uintptr) {
				_ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 1)
				_ = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_MAXSEG, 536)
			})
		}}
		var err error
		c, err = d.Dial("tcp", b.Addr().String())
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
	}
	in, err := greet(c, handshake{self: uuid.New(), expect: expect, timeout: 30 * time.Millisecond, session: [16]byte{1}})
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), in.status)
	// Our send buffer may grow to megabytes before pings to a reader this
	// slow block (the kernel's autotuning), which would take minutes of
	// pings: start with the smallest, as memory pressure would.
	if b.cfg.testDial == nil {
		shrinkServerSide(t, b, c.LocalAddr())
	}
	for range fill {
		_, err := c.Write(frameBytes(header{typ: tRead, count: 1, id: 1, key: agent.NewKey()}, [][2]uint64{{4096, 64}}, nil))
		require.NoError(t, err)
	}
	pinger(t, c, 20*time.Millisecond)
	return c
}

// serverSide returns b's end of the connection from local.
func serverSide(t *testing.T, b *Backend, local net.Addr) *wconn {
	t.Helper()
	var found *wconn
	require.Eventually(t, func() bool {
		for _, w := range b.conns.Members() {
			if w.c.RemoteAddr().String() == local.String() {
				found = w
				return true
			}
		}
		return false
	}, 5*time.Second, time.Millisecond)
	return found
}

// shrinkServerSide gives b's end of the connection from local the smallest
// send buffer the kernel allows.
func shrinkServerSide(t *testing.T, b *Backend, local net.Addr) {
	t.Helper()
	require.NoError(t, serverSide(t, b, local).c.(*net.TCPConn).SetWriteBuffer(1))
}

// The keepalive loop pings every connection from one goroutine, each ping
// a blocking write under a deadline of the keepalive timeout. A stranger
// with no key that connects, keeps pinging, and never reads (its socket
// buffers fill with our pings, faster with refusals it asks for) makes
// every ping to it block for a whole timeout, over and over: no other
// connection of the agent is pinged meanwhile, so every honest peer hears
// silence longer than the timeout and drops the agent as lost, and the
// exposures it used report it departed. The failed ping does not even
// close the stranger's connection.
func TestAttackNonReaderStallsKeepalives(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		backendtest.Watchdog(t, 60*time.Second)
		const timeout = 500 * time.Millisecond
		victim, vb := newAgent(t, nw, WithKeepalive(50*time.Millisecond, timeout))
		honest, hb := newAgent(t, nw, WithKeepalive(50*time.Millisecond, timeout))
		src := bytes.Repeat([]byte{exposedB}, 4096)
		e := expose(t, honest, agent.AccessRead, src)
		legitRead(t, victim, honest, e, src)
		before := hb.Stats()

		_ = stuckReader(t, vb, victim.ID(), 0)
		select {
		case ev := <-e.Events():
			t.Errorf("a keyless stranger that never reads made the honest peer report the live victim lost: %+v", ev)
		case <-time.After(10 * time.Second):
		}
		d := serve.Delta(hb.Stats(), before)
		assert.Zero(t, d.Timeouts, "the honest peer cut the victim's connections for silence: %+v", d)
		assert.NotZero(t, vb.Stats().Timeouts, "the stranger that took no keepalive was not cut as a timeout")
	})
}

// A lease lasts one keepalive timeout, waiting for the connection's writer
// included: a READ that arrives while a keepalive is stuck in a socket its
// peer does not read (the peer holds a key, and reads nothing) holds its
// lease no longer than that, so Revoke returns within one timeout.
func TestRevokeBoundedBehindStuckKeepalive(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	const timeout = 500 * time.Millisecond
	victim, vb := newAgent(t, WithKeepalive(50*time.Millisecond, timeout))
	src := make([]byte, 4096)
	e := expose(t, victim, agent.AccessRead, src)
	c := stuckReader(t, vb, victim.ID(), 0)
	w := serverSide(t, vb, c.LocalAddr())
	// Our pings to it every 10 ms fill the socket; once the count of bytes
	// written stops, a ping is stuck.
	for last, still := w.tx.Load(), 0; still < 3; {
		time.Sleep(10 * time.Millisecond)
		if n := w.tx.Load(); n != last {
			last, still = n, 0
		} else {
			still++
		}
	}
	_, err := c.Write(frameBytes(header{typ: tRead, count: 1, id: 1, key: e.Key()}, [][2]uint64{{agent.DRAM(src).Addr, 4096}}, nil))
	require.NoError(t, err)
	time.Sleep(50 * time.Millisecond) // read, its lease taken, waiting for the writer
	start := time.Now()
	e.Revoke()
	took := time.Since(start)
	t.Logf("Revoke took %v (keepalive timeout %v)", took, timeout)
	assert.Less(t, took, timeout+200*time.Millisecond, "a READ waiting behind a stuck keepalive held its lease past one timeout")
}

// Post writes a small transfer's frame on the caller's goroutine when the
// stream is free, but never waits for the peer to take it: against a peer
// that reads nothing, with the socket full, Post returns at once (what the
// socket did not take goes from a goroutine), and so do Cancel and Close.
func TestInlinePostNeverWaitsForThePeer(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	peer := nonReader(t, loopback)
	a, _ := newAgent(t, WithStreams(1), WithInflight(64), WithKeepalive(time.Second, 30*time.Second))
	var xs []*agent.Xfer
	var slowest time.Duration
	for range 64 { // 4 MiB: more than the socket buffers hold
		start := time.Now()
		x := postFake(t, a, agent.OpWrite, peer, make([]byte, inlineMax))
		slowest = max(slowest, time.Since(start))
		xs = append(xs, x)
	}
	t.Logf("slowest Post: %v", slowest)
	assert.Less(t, slowest, time.Second, "Post waited for a peer that reads nothing")
	for _, x := range xs {
		x.Cancel(nil)
	}
	for _, x := range xs {
		backendtest.DoneWithin(t, x, 2*time.Second, "a cancelled inline WRITE")
	}
	start := time.Now()
	require.NoError(t, a.Close())
	assert.Less(t, time.Since(start), 2*time.Second, "Close waited for a peer that reads nothing")
}

// pat is the exposed READ source's byte at offset i: position-dependent,
// never 0, 0xCC or 0xFF, so a shifted, stale or late byte shows.
func pat(i int) byte { return byte(i%251) | 1 }

// Cancel racing a transfer's frames, hundreds of times over real sockets
// between two agents: a cancelled READ's buffer holds only untouched zeros
// or the right bytes at the right places, and nothing lands in it after
// Done (it is overwritten with 0xCC at Done and checked at the end); bytes
// put into a cancelled WRITE's buffer after Done never reach the exposure;
// zeros and data land only in the region a WRITE named; and transfers that
// run on the same connections afterwards get exactly their bytes.
func TestAttackCancelRacesNeverLandLate(t *testing.T) {
	backendtest.Watchdog(t, 5*time.Minute)
	ka := WithKeepalive(50*time.Millisecond, 2*time.Second)
	passive, _ := newAgent(t, ka)
	active, _ := newAgent(t, ka, WithStreams(2), WithChunkSize(128<<10), WithInflight(2))
	const size = 4 << 20
	src := make([]byte, size)
	for i := range src {
		src[i] = pat(i)
	}
	re := expose(t, passive, agent.AccessRead, src)
	// W: guard | slot 0 (verification only) | slots 1..7 (cancelled WRITEs) | guard
	const slot = 512 << 10
	wall := bytes.Repeat([]byte{0xEE}, page+8*slot+page)
	w := wall[page : page+8*slot]
	for i := range w {
		w[i] = 0x77
	}
	// Exposed memory is read here only after Revoke, which orders it after
	// the server's writes (the race detector sees no order through sockets).
	we := expose(t, passive, agent.AccessWrite, w[slot:])
	wbase := agent.DRAM(w).Addr

	rnd := func(n int) int { return int(uint64(time.Now().UnixNano()*2654435761) % uint64(n)) }
	cancelSoon := func(x *agent.Xfer, i int) {
		switch i % 4 {
		case 0:
			x.Cancel(nil)
		case 1:
			go x.Cancel(nil)
		default:
			time.AfterFunc(time.Duration(rnd(3000))*time.Microsecond, func() { x.Cancel(nil) })
		}
	}
	read := func(off, n int) (*agent.Xfer, []byte) {
		dst := make([]byte, n)
		x, err := active.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: passive.Info(), Key: re.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: agent.DRAM(src).Addr + uint64(off), Len: uint64(n)}}}})
		require.NoError(t, err)
		return x, dst
	}
	const iters = 150
	var kept [][]byte
	cancelled, completed := 0, 0
	for i := range iters {
		n := 1 + rnd(1<<20)
		if i%3 == 0 {
			n = 1 + rnd(inlineMax) // inline
		}
		off := rnd(size - n)
		x, dst := read(off, n)
		cancelSoon(x, i)
		<-x.Done()
		if x.Err() == nil {
			completed++
			for j := range dst {
				if dst[j] != pat(off+j) {
					t.Fatalf("iteration %d: completed READ has byte %d = %#x, want %#x", i, j, dst[j], pat(off+j))
				}
			}
		} else {
			require.ErrorIs(t, x.Err(), agent.ErrCancelled)
			cancelled++
			for j := range dst {
				if dst[j] != 0 && dst[j] != pat(off+j) {
					t.Fatalf("iteration %d: cancelled READ has byte %d = %#x, neither untouched nor %#x", i, j, dst[j], pat(off+j))
				}
			}
		}
		for j := range dst {
			dst[j] = 0xCC
		}
		kept = append(kept, dst)
		if i%10 == 9 { // the connections still deliver exactly
			m := 1 + rnd(2<<20)
			o := rnd(size - m)
			y, got := read(o, m)
			<-y.Done()
			require.NoError(t, y.Err(), "iteration %d: a READ after cancellations failed", i)
			for j, c := range got {
				if c != pat(o+j) {
					t.Fatalf("iteration %d: READ after cancellations has byte %d = %#x, want %#x", i, j, c, pat(o+j))
				}
			}
		}
	}
	t.Logf("READs: %d cancelled, %d completed before the cancel", cancelled, completed)

	cancelled, completed = 0, 0
	var srcs [][]byte
	for i := range iters {
		n := 1 + rnd(slot)
		if i%3 == 0 {
			n = 1 + rnd(inlineMax)
		}
		s := 1 + i%7
		off := s*slot + rnd(slot-n+1)
		buf := make([]byte, n)
		for j := range buf {
			buf[j] = pat(j)
		}
		x, err := active.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: passive.Info(), Key: we.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(buf), Remote: agent.Region{Addr: wbase + uint64(off), Len: uint64(n)}}}})
		require.NoError(t, err)
		cancelSoon(x, i)
		<-x.Done()
		if x.Err() == nil {
			completed++
		} else {
			require.ErrorIs(t, x.Err(), agent.ErrCancelled)
			cancelled++
		}
		for j := range buf { // the caller's again
			buf[j] = 0xFF
		}
		srcs = append(srcs, buf)
		if i%10 == 9 { // slot 0, written only here, gets exactly its bytes
			m := 1 + rnd(slot)
			v := make([]byte, m)
			seed := byte(i)
			for j := range v {
				v[j] = pat(j + int(seed))
			}
			ve := expose(t, passive, agent.AccessWrite, w[:slot])
			y, err := active.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: passive.Info(), Key: ve.Key(),
				Segments: []agent.Segment{{Local: agent.DRAM(v), Remote: agent.Region{Addr: wbase, Len: uint64(m)}}}})
			require.NoError(t, err)
			<-y.Done()
			require.NoError(t, y.Err(), "iteration %d: a WRITE after cancellations failed", i)
			ve.Revoke()
			require.True(t, bytes.Equal(v, w[:m]), "iteration %d: a WRITE after cancellations landed other bytes", i)
		}
	}
	t.Logf("WRITEs: %d cancelled, %d completed before the cancel", cancelled, completed)
	time.Sleep(500 * time.Millisecond) // anything late has had time to land
	we.Revoke()
	for k, dst := range kept {
		require.Equal(t, -1, bytes.IndexFunc(dst, func(r rune) bool { return r != utf8.RuneError }),
			"READ %d: a byte landed in its memory after Done", k)
	}
	require.Equal(t, -1, bytes.IndexByte(w, 0xFF), "a byte put into a WRITE's buffer after Done reached the peer")
	require.Equal(t, bytes.Repeat([]byte{0xEE}, page), wall[:page], "the guard before the exposure changed")
	require.Equal(t, bytes.Repeat([]byte{0xEE}, page), wall[len(wall)-page:], "the guard after the exposure changed")
	for j, c := range w[slot:] { // cancelled WRITEs: their bytes at their places, zeros, or untouched
		if c != 0x77 && c != 0 && c&1 != 1 {
			t.Fatalf("exposure byte %d = %#x: neither untouched, zero, nor a WRITE's", slot+j, c)
		}
	}
	_ = srcs
}

// Cancelling a transfer whose answer is a refusal still arriving (its
// header came, its error text not yet) fences the reader while it reads the
// text, not data: land returns errFenced as a connection error, the stream
// dies and the peer is failed, so every other transfer on that peer fails
// with ErrRemoteLost: cancelling one transfer breaks its neighbours.
func TestAttackCancelDuringRefusalTextFailsOthers(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		backendtest.Watchdog(t, 60*time.Second)
		peer := fakePassive(t, nw, uuid.New(), func(c net.Conn) {
			for first := true; ; first = false {
				req, table, err := readRequest(c)
				if err != nil || req.typ != tRead || len(table) < pieceSize {
					return
				}
				var hb [hdrSize]byte
				if first { // a refusal whose text comes late
					msg := []byte("access denied: no such key")
					(&header{typ: tReadResp, status: stDenied, id: req.id, length: uint64(len(msg))}).put(hb[:])
					if _, err := c.Write(hb[:]); err != nil {
						return
					}
					time.Sleep(300 * time.Millisecond)
					if _, err := c.Write(msg); err != nil {
						return
					}
					continue
				}
				n := binary.LittleEndian.Uint64(table[8:])
				(&header{typ: tReadResp, id: req.id, length: n}).put(hb[:])
				if _, err := c.Write(append(hb[:], bytes.Repeat([]byte{0xAB}, int(n))...)); err != nil {
					return
				}
			}
		})
		a, _ := newAgent(t, nw, WithStreams(1), WithKeepalive(time.Second, 30*time.Second))
		post := func() *agent.Xfer {
			x := postFake(t, a, agent.OpRead, peer, make([]byte, 4096))
			return x
		}
		x := post()
		time.Sleep(100 * time.Millisecond) // connected; x's refusal header has come, its text not
		z := post()                        // queued behind x on the one stream
		x.Cancel(nil)
		<-x.Done()
		require.ErrorIs(t, x.Err(), agent.ErrCancelled)
		backendtest.DoneWithin(t, z, 5*time.Second, "the neighbour")
		assert.NoError(t, z.Err(), "cancelling one transfer failed another on the same peer")
	})
}

// Idle reaping racing new transfers and notifications on the same peer:
// transfers posted around the moment the peer's connections are retired
// never fail, every completion notification arrives, and the exposure
// never hears that the live peer was lost.
func TestAttackIdleReapRacesTransfers(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		backendtest.Watchdog(t, 2*time.Minute)
		const idle = 30 * time.Millisecond
		passive, _ := newAgent(t, nw, WithKeepalive(10*time.Millisecond, time.Second))
		active, ab := newAgent(t, nw, WithKeepalive(10*time.Millisecond, time.Second), WithIdleTimeout(idle))
		src := make([]byte, 1<<20)
		for i := range src {
			src[i] = pat(i)
		}
		e := expose(t, passive, agent.AccessRead, src)
		before := ab.Stats()
		const rounds = 150
		for i := range rounds {
			n := 4096
			if i%2 == 1 {
				n = len(src) // driven, not inline
			}
			dst := make([]byte, n)
			x, err := active.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: passive.Info(), Key: e.Key(),
				Notify:   []byte(fmt.Sprint(i)),
				Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: agent.DRAM(src).Addr, Len: uint64(n)}}}})
			require.NoError(t, err)
			<-x.Done()
			require.NoError(t, x.Err(), "round %d: a transfer racing the idle reaper failed", i)
			for j := range dst {
				if dst[j] != pat(j) {
					t.Fatalf("round %d: byte %d = %#x, want %#x", i, j, dst[j], pat(j))
				}
			}
			select {
			case ev := <-e.Events():
				require.Equal(t, agent.EventNotify, ev.Kind, "round %d: %+v", i, ev)
				require.Equal(t, fmt.Sprint(i), string(ev.Msg))
			case <-time.After(5 * time.Second):
				t.Fatalf("round %d: the completion notification never arrived", i)
			}
			// Around the idle timeout: before it, at it, after it.
			time.Sleep(idle - 10*time.Millisecond + time.Duration(i%7)*5*time.Millisecond)
		}
		select {
		case ev := <-e.Events():
			t.Fatalf("an event after the last notification: %+v", ev)
		case <-time.After(300 * time.Millisecond):
		}
		assert.Zero(t, serve.Delta(ab.Stats(), before).Disconnected)
	})
}

// WithMaxOutgoingPerIP counts connections to one IP address, all agents
// there together. Sized as documented, (streams+1) × the agents at one
// address busy at once, it never fails an honest workload: the default
// carries six agents at 64 streams each (390 connections). Over it, the
// transfers that find no idle connection fail with ErrOutgoingLimit,
// which does not claim the live peer lost.
func TestOutgoingLimitSizing(t *testing.T) {
	const peers = 6
	t.Run("default", func(t *testing.T) {
		bubble(t, func(t *testing.T, nw *memNet) {
			backendtest.Watchdog(t, 2*time.Minute)
			active, _ := newAgent(t, nw, WithStreams(64), WithChunkSize(64<<10))
			// All posts at once, none idle: 4 MiB in 64 KiB chunks holds
			// every stream.
			var xs []*agent.Xfer
			for range peers {
				p, _ := newAgent(t, nw)
				m := make([]byte, 4<<20)
				x, _ := postRead(t, active, p, expose(t, p, agent.AccessRead, m), m)
				xs = append(xs, x)
			}
			for i, x := range xs {
				<-x.Done()
				assert.NoError(t, x.Err(), "transfer %d of %d concurrent ones to honest agents on one host", i+1, peers)
			}
		})
	})
	t.Run("over", func(t *testing.T) {
		bubble(t, func(t *testing.T, nw *memNet) {
			backendtest.Watchdog(t, 2*time.Minute)
			// Honest peers on one address that take their time to answer, so
			// that every transfer holds its connections while the others dial.
			slow := func(c net.Conn) {
				for {
					req, table, err := readRequest(c)
					if err != nil || req.typ != tRead {
						return
					}
					time.Sleep(300 * time.Millisecond)
					n := 0
					for i := 8; i < len(table); i += pieceSize {
						n += int(binary.LittleEndian.Uint64(table[i:]))
					}
					var hb [hdrSize]byte
					(&header{typ: tReadResp, id: req.id, length: uint64(n)}).put(hb[:])
					if _, err := c.Write(append(hb[:], make([]byte, n)...)); err != nil {
						return
					}
				}
			}
			const fit = 3
			active, _ := newAgent(t, nw, WithStreams(8), WithMaxOutgoingPerIP(fit*9))
			var xs []*agent.Xfer
			for range peers {
				x, err := active.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fakePassive(t, nw, uuid.New(), slow), Key: agent.NewKey(),
					Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 4096)), Remote: agent.Region{Addr: 4096, Len: 4096}}}})
				require.NoError(t, err)
				xs = append(xs, x)
			}
			failed := 0
			for _, x := range xs {
				<-x.Done()
				if err := x.Err(); err != nil {
					failed++
					require.ErrorIs(t, err, ErrOutgoingLimit)
					require.NotErrorIs(t, err, agent.ErrRemoteLost, "a live peer reported lost")
					require.ErrorContains(t, err, "WithMaxOutgoingPerIP")
				}
			}
			assert.GreaterOrEqual(t, failed, peers-fit, "%d peers fit %d connections at 9 each", fit, fit*9)
		})
	})
}

// truthfulBusyPinger is a passive peer that never answers, and pings
// "busy" every 20 ms claiming exactly the bytes it received, but a new
// claim only once it received 64 KiB more (counted in restarts): the
// claims that would restart the wait for its answer if our own keepalives
// counted as progress.
func truthfulBusyPinger(restarts *atomic.Int64) func(c net.Conn) {
	return func(c net.Conn) {
		var got atomic.Uint64
		got.Store(hsSize)
		go func() {
			buf := make([]byte, 4096)
			for {
				n, err := c.Read(buf)
				got.Add(uint64(n))
				if err != nil {
					return
				}
			}
		}()
		claim := uint64(hsSize)
		var ping [hdrSize]byte
		for {
			if g := got.Load(); g >= claim+minProgress {
				claim = g
				restarts.Add(1)
			}
			(&header{typ: tPing, status: stBusy, id: claim}).put(ping[:])
			if _, err := c.Write(ping[:]); err != nil {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// A busy ping restarts the wait for an answer when it claims 64 KiB more
// received than the last claim that did, no more than we sent. But "what
// we sent" includes our own keepalives, and the peer picks their rate: a
// passive peer announcing a 30 ms timeout gets a 40-byte ping every 10 ms,
// 64 KiB every ~20 s. So at a keepalive timeout above that (the docs
// mention 20 s deployments) a peer that never answers a 56-byte READ holds
// it forever with truthful claims, although the docs bound it by "one
// timeout per 64 KiB of our requests still in flight": here one timeout.
// TestBusyPingsFedByPingFlood shows the same in a second.
func TestBusyPingsFedByOurKeepalives(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		backendtest.Watchdog(t, 2*time.Minute)
		const timeout = 30 * time.Second
		var restarts atomic.Int64
		peer := fakePassiveAnswering(t, nw, handshake{self: uuid.New(), timeout: 30 * time.Millisecond}, truthfulBusyPinger(&restarts))
		a, _ := newAgent(t, nw, WithKeepalive(time.Second, timeout))
		x := postFake(t, a, agent.OpRead, peer, make([]byte, 4096))
		select {
		case <-x.Done():
			t.Logf("lost as documented: %v", x.Err())
		case <-time.After(timeout + timeout/2):
			t.Errorf("a 56-byte READ left unanswered for %v (keepalive timeout %v): the peer's %d truthful busy claims were fed by our own pings",
				timeout+timeout/2, timeout, restarts.Load())
			x.Cancel(nil)
		}
	})
}

// floodPings writes n keepalives at once on every connection b dialled,
// counted as the keepalive loop counts its own: what the loop sends to a
// peer announcing a short timeout over minutes, in an instant.
func floodPings(b *Backend, n int) {
	b.mu.Lock()
	var ps []*peer
	for _, p := range b.peers {
		if p.isReady() {
			ps = append(ps, p)
		}
	}
	b.mu.Unlock()
	var ping [hdrSize]byte
	(&header{typ: tPing}).put(ping[:])
	buf := bytes.Repeat(ping[:], n)
	for _, p := range ps {
		for _, s := range p.all() {
			s.w.wl.lock()
			_ = s.w.c.SetWriteDeadline(time.Now().Add(time.Second))
			k, _ := s.w.c.Write(buf)
			s.w.ptx.Add(uint64(k))
			s.w.tx.Add(uint64(k))
			s.w.wl.unlock()
		}
	}
}

// TestBusyPingsFedByOurKeepalives in a second: the pings we send count
// for nothing towards the progress a busy peer claims.
func TestBusyPingsFedByPingFlood(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		backendtest.Watchdog(t, time.Minute)
		const timeout = 300 * time.Millisecond
		var restarts atomic.Int64
		peer := fakePassive(t, nw, uuid.New(), truthfulBusyPinger(&restarts))
		a, b := newAgent(t, nw, WithStreams(1), WithKeepalive(50*time.Millisecond, timeout))
		x := postFake(t, a, agent.OpRead, peer, make([]byte, 4096))
		deadline := time.After(10 * timeout)
		for {
			floodPings(b, 2*minProgress/hdrSize)
			select {
			case <-x.Done():
				require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
				t.Logf("lost as documented after %d truthful busy claims of our pings: %v", restarts.Load(), x.Err())
				return
			case <-deadline:
				x.Cancel(nil)
				t.Fatalf("a 56-byte READ left unanswered for %v (keepalive timeout %v): the peer's %d truthful busy claims were fed by our own pings",
					10*timeout, timeout, restarts.Load())
			case <-time.After(timeout / 4):
			}
		}
	})
}

// A busy peer's first claim sets where progress is counted from: a peer
// that claims nothing received at first, after this agent wrote megabytes
// of WRITEs it acknowledged, must not earn a timeout for every 64 KiB of
// those, answered long ago, while it holds a new READ unanswered.
func TestBusyPingsCannotClaimAnsweredBytes(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		backendtest.Watchdog(t, time.Minute)
		const timeout = 300 * time.Millisecond
		var gotRead atomic.Bool
		peer := fakePassive(t, nw, uuid.New(), func(c net.Conn) {
			var pings sync.WaitGroup
			defer pings.Wait() // its next write fails: the agent closed the connection
			pings.Go(func() {  // the READ's bytes arrived: claim from zero up
				var ping [hdrSize]byte
				for claim := uint64(0); ; {
					if gotRead.Load() {
						claim += minProgress
					}
					(&header{typ: tPing, status: stBusy, id: claim}).put(ping[:])
					if _, err := c.Write(ping[:]); err != nil {
						return
					}
					time.Sleep(timeout / 3)
				}
			})
			for {
				req, table, err := readRequest(c)
				if err != nil {
					return
				}
				if req.typ == tRead {
					gotRead.Store(true)
					continue // never answered
				}
				n := 0
				for i := 8; i < len(table); i += pieceSize {
					n += int(binary.LittleEndian.Uint64(table[i:]))
				}
				if _, err := io.CopyN(io.Discard, c, int64(n)); err != nil {
					return
				}
				var hb [hdrSize]byte
				(&header{typ: tWriteAck, id: req.id}).put(hb[:])
				if _, err := c.Write(hb[:]); err != nil {
					return
				}
			}
		})
		a, _ := newAgent(t, nw, WithStreams(1), WithKeepalive(50*time.Millisecond, timeout))
		const big = 4 << 20 // 64 timeouts' worth of 64 KiB claims
		w := postFake(t, a, agent.OpWrite, peer, make([]byte, big))
		backendtest.DoneWithin(t, w, 10*time.Second, "the WRITE")
		require.NoError(t, w.Err())
		x := postFake(t, a, agent.OpRead, peer, make([]byte, 4096))
		took := backendtest.DoneWithin(t, x, 10*timeout, "a READ held by claims of answered bytes")
		require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
		t.Logf("lost after %v (timeout %v)", took, timeout)
	})
}
