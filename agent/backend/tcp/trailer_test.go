package tcp

import (
	"bytes"
	"context"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// A small WRITE's notification rides in its frame (stTrailer): the exposing
// agent delivers it after the payload landed and before it acknowledges,
// so the event is there when the writer's transfer is done.
func TestWriteNotificationInFrame(t *testing.T) {
	passive, _ := newAgent(t)
	active, _ := newAgent(t)
	dst := make([]byte, 4096)
	e, err := passive.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(dst)})
	require.NoError(t, err)
	for i := range 50 {
		src := bytes.Repeat([]byte{byte(i + 1)}, len(dst))
		note := []byte{'n', byte(i)}
		x, err := active.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: passive.Info(), Key: e.Key(), Notify: note,
			Segments: []agent.Segment{{Local: agent.DRAM(src), Remote: agent.DRAM(dst).Region}}})
		require.NoError(t, err)
		<-x.Done()
		require.NoError(t, x.Err())
		select {
		case ev := <-e.Events():
			require.Equal(t, note, ev.Msg, "write %d", i)
		default:
			t.Fatalf("write %d: done before its notification was delivered", i)
		}
	}
	e.Revoke()
	assert.Equal(t, bytes.Repeat([]byte{50}, len(dst)), dst)
}

// A trailer whose whole byte is zero (a frame its sender cut short and
// padded) delivers nothing; malformed trailers drop the connection.
func TestWriteTrailerByHand(t *testing.T) {
	tg := newTarget(t, loopback)
	a, b, g, ex := tg.a, tg.b, tg.g, tg.ex
	p := dialRaw(t, b, a.ID())
	var hs [hsSize]byte
	_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := io.ReadFull(p.c, hs[:])
	require.NoError(t, err)
	in, err := getHandshake(hs[:])
	require.NoError(t, err)
	require.True(t, in.trailers, "the listener announces that it takes trailers")

	wk := ex.w.Key()
	at := agent.DRAM(g.w).Addr
	write := func(id uint64, payload, note []byte, whole byte) []byte {
		trailer := append(bytes.Clone(note), whole)
		return frameBytes(header{typ: tWrite, status: stTrailer, count: 1, id: id, length: uint64(len(payload) + len(trailer)), key: wk},
			[][2]uint64{{at, uint64(len(payload))}}, append(bytes.Clone(payload), trailer...))
	}
	ack := func(id uint64) {
		t.Helper()
		h, _, err := p.next()
		require.NoError(t, err)
		require.Equal(t, uint8(tWriteAck), h.typ)
		require.Equal(t, uint8(stOK), h.status)
		require.Equal(t, id, h.id)
	}
	noEvent := func() {
		t.Helper()
		select {
		case ev := <-ex.w.Events():
			t.Fatalf("unexpected event %q", ev.Msg)
		default:
		}
	}

	_, err = p.c.Write(write(1, bytes.Repeat([]byte{1}, 64), make([]byte, 5), 0))
	require.NoError(t, err)
	ack(1)
	noEvent()

	_, err = p.c.Write(write(2, bytes.Repeat([]byte{2}, 64), []byte("done"), 1))
	require.NoError(t, err)
	ack(2)
	select {
	case ev := <-ex.w.Events():
		assert.Equal(t, []byte("done"), ev.Msg)
	default:
		t.Fatal("no event before the ack")
	}
	// Refused (a key that opens nothing): the payload and the trailer are
	// read past, nothing is delivered, the connection serves on.
	wk = agent.NewKey()
	_, err = p.c.Write(write(3, bytes.Repeat([]byte{3}, 64), []byte("no"), 1))
	require.NoError(t, err)
	h, _, err := p.next()
	require.NoError(t, err)
	require.Equal(t, uint8(stDenied), h.status)
	noEvent()
	wk = ex.w.Key()
	_, err = p.c.Write(write(4, bytes.Repeat([]byte{4}, 64), []byte("again"), 1))
	require.NoError(t, err)
	ack(4)
	select {
	case ev := <-ex.w.Events():
		assert.Equal(t, []byte("again"), ev.Msg)
	default:
		t.Fatal("no event before the ack")
	}
	tg.stillServes(t, nil)

	for _, tc := range []struct {
		name string
		h    header
	}{
		{"trailer flag without a trailer", header{typ: tWrite, status: stTrailer, count: 1, id: 3, length: 16, key: wk}},
		{"trailer past a notification's size", header{typ: tWrite, status: stTrailer, count: 1, id: 3, length: 16 + maxNotify + 2, key: wk}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := b.Stats()
			q, _ := dialHostile(t, b, a.ID())
			_, err := q.c.Write(frameBytes(tc.h, [][2]uint64{{at, 16}}, nil))
			require.NoError(t, err)
			q.dropped(t)
			waitStats(t, b, before, Stats{Disconnected: 1, ProtocolErrors: 1})
			noEvent()
		})
	}
}
