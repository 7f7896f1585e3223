package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// readRequest reads one request's header and table from c, skipping pings.
func readRequest(c net.Conn) (header, []byte, error) {
	var hb [hdrSize]byte
	var h header
	for {
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			return h, nil, err
		}
		if h.get(hb[:]); h.typ != tPing {
			break
		}
	}
	if h.count > 1<<16 {
		return h, nil, errors.New("huge table")
	}
	table := make([]byte, int(h.count)*pieceSize)
	_, err := io.ReadFull(c, table)
	return h, table, err
}

// A hostile passive peer answering with huge or wrong lengths, wrong ids,
// unsolicited frames, or trickling its answers: the transfer fails with
// ErrRemoteLost within the keepalive timeout, the connection is dropped and
// counted by kind, and no byte lands outside the transfer's local memory.
func TestHostilePassivePeer(t *testing.T) {
	const timeout = 300 * time.Millisecond
	answer := func(c net.Conn, h header, payload []byte) {
		var hb [hdrSize]byte
		h.put(hb[:])
		_, _ = c.Write(append(hb[:], payload...))
	}
	onRequest := func(bad func(c net.Conn, req header, n uint64)) func(c net.Conn) {
		return func(c net.Conn) {
			req, table, err := readRequest(c)
			if err != nil || len(table) < pieceSize {
				return
			}
			bad(c, req, binary.LittleEndian.Uint64(table[8:]))
			_, _ = io.Copy(io.Discard, c)
		}
	}
	protocol := Stats{Disconnected: 1, ProtocolErrors: 1}
	slow := Stats{Disconnected: 1, Timeouts: 1}
	for _, tc := range []struct {
		name  string
		serve func(c net.Conn)
		want  Stats
	}{
		{"huge READ answer", onRequest(func(c net.Conn, req header, n uint64) {
			answer(c, header{typ: tReadResp, id: req.id, length: 1 << 40}, bytes.Repeat([]byte{0xEE}, 8192))
		}), protocol},
		{"READ answer one byte long", onRequest(func(c net.Conn, req header, n uint64) {
			answer(c, header{typ: tReadResp, id: req.id, length: n + 1}, bytes.Repeat([]byte{0xEE}, int(n+1)))
		}), protocol},
		{"READ answer one byte short", onRequest(func(c net.Conn, req header, n uint64) {
			answer(c, header{typ: tReadResp, id: req.id, length: n - 1}, bytes.Repeat([]byte{0xEE}, int(n-1)))
		}), protocol},
		{"wrong id", onRequest(func(c net.Conn, req header, n uint64) {
			answer(c, header{typ: tReadResp, id: req.id + 1, length: n}, bytes.Repeat([]byte{0xEE}, int(n)))
		}), protocol},
		{"WRITE ack to a READ", onRequest(func(c net.Conn, req header, n uint64) {
			answer(c, header{typ: tWriteAck, id: req.id}, nil)
		}), protocol},
		{"huge refusal text", onRequest(func(c net.Conn, req header, n uint64) {
			answer(c, header{typ: tReadResp, status: stDenied, id: req.id, length: 1 << 40}, []byte("no"))
		}), protocol},
		{"request from the passive side", onRequest(func(c net.Conn, req header, n uint64) {
			answer(c, header{typ: tRead, count: 1, id: 1}, make([]byte, pieceSize))
		}), protocol},
		{"notification to the active side", onRequest(func(c net.Conn, req header, n uint64) {
			answer(c, header{typ: tNotify, length: 2}, []byte("hi"))
		}), protocol},
		{"trickled answer", onRequest(func(c net.Conn, req header, n uint64) {
			answer(c, header{typ: tReadResp, id: req.id, length: n}, nil)
			for range n {
				if _, err := c.Write([]byte{0xEE}); err != nil {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		}), slow},
		{"pings, never answers", func(c net.Conn) {
			go func() { _, _ = io.Copy(io.Discard, c) }()
			var hb [hdrSize]byte
			(&header{typ: tPing}).put(hb[:])
			for {
				_ = c.SetWriteDeadline(time.Now().Add(time.Second))
				if _, err := c.Write(hb[:]); err != nil {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		}, slow},
		{"silent", onRequest(func(c net.Conn, req header, n uint64) {}), slow},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bubble(t, func(t *testing.T, nw *memNet) {
				peer := fakePassive(t, nw, uuid.New(), tc.serve)
				a, b := newAgent(t, nw, WithStreams(1), WithKeepalive(50*time.Millisecond, timeout))
				all := bytes.Repeat([]byte{0x11}, 3*page)
				dst := all[page : 2*page]
				clear(dst)
				start := time.Now()
				x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: peer, Key: agent.NewKey(),
					Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 1 << 20, Len: page}}}})
				require.NoError(t, err)
				select {
				case <-x.Done():
				case <-time.After(20 * time.Second):
					t.Fatal("a transfer to a hostile peer hung")
				}
				require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
				t.Logf("failed after %v: %v", time.Since(start), x.Err())
				assert.Equal(t, bytes.Repeat([]byte{0x11}, page), all[:page], "bytes landed before the transfer's memory")
				assert.Equal(t, bytes.Repeat([]byte{0x11}, page), all[2*page:], "bytes landed after the transfer's memory")
				require.Eventually(t, func() bool { return b.Stats().Disconnected > 0 }, 10*time.Second, time.Millisecond)
				got := b.Stats()
				// The control connection may fail of the same cause in the same
				// instant: count one or two.
				n := got.Disconnected
				assert.LessOrEqual(t, n, uint64(2))
				want := tc.want
				want.Disconnected *= n
				want.ProtocolErrors *= n
				want.Timeouts *= n
				assert.Equal(t, want, got)
			})
		})
	}
}

// A passive peer announcing lower limits than this agent's gets frames
// within them, however the transfer is shaped; one announcing none (an
// older agent) gets this agent's own.
func TestPeerAnnouncedLimits(t *testing.T) {
	const maxPieces, maxFrame = 16, 8 << 10
	var mu sync.Mutex
	var violations []string
	var frames int
	serve := func(c net.Conn) {
		for {
			h, table, err := readRequest(c)
			if err != nil {
				return
			}
			var total uint64
			for i := 0; i < len(table); i += pieceSize {
				total += binary.LittleEndian.Uint64(table[i+8:])
			}
			mu.Lock()
			frames++
			if h.count > maxPieces || total > maxFrame {
				violations = append(violations, "frame over the announced limits")
			}
			mu.Unlock()
			ans := header{id: h.id, typ: tWriteAck}
			var payload []byte
			switch h.typ {
			case tRead:
				ans.typ, ans.length = tReadResp, total
				payload = bytes.Repeat([]byte{0xCD}, int(total))
			case tWrite:
				if _, err := io.CopyN(io.Discard, c, int64(h.length)); err != nil {
					return
				}
			default:
				return
			}
			var hb [hdrSize]byte
			ans.put(hb[:])
			if _, err := c.Write(append(hb[:], payload...)); err != nil {
				return
			}
		}
	}
	peer := fakePassiveAnswering(t, loopback, handshake{self: uuid.New(), maxPieces: maxPieces, maxFrame: maxFrame}, serve)
	a, _ := newAgent(t)
	var segs []agent.Segment
	var dsts [][]byte
	for i := range 64 {
		d := make([]byte, 1<<10)
		dsts = append(dsts, d)
		segs = append(segs, agent.Segment{Local: agent.DRAM(d), Remote: agent.Region{Addr: uint64(1<<20 + i<<10), Len: 1 << 10}})
	}
	big := make([]byte, 100<<10)
	dsts = append(dsts, big)
	segs = append(segs, agent.Segment{Local: agent.DRAM(big), Remote: agent.Region{Addr: 1 << 30, Len: 100 << 10}})
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: peer, Key: agent.NewKey(), Segments: segs})
		require.NoError(t, err)
		<-x.Done()
		require.NoError(t, x.Err(), "%v", op)
	}
	for _, d := range dsts {
		require.Equal(t, bytes.Repeat([]byte{0xCD}, len(d)), d)
	}
	mu.Lock()
	defer mu.Unlock()
	assert.Empty(t, violations)
	assert.GreaterOrEqual(t, frames, 2*(164<<10)/maxFrame, "frames were cut to the announced size")
}
