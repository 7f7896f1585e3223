package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// newAgent starts an agent on a tcp backend with opts.
func newAgent(t testing.TB, opts ...Option) (*agent.Agent, *Backend) {
	t.Helper()
	b := New(opts...)
	return backendtest.NewAgent(t, b), b
}

// rawPeer is a hand-driven client speaking the wire protocol.
type rawPeer struct {
	t  testing.TB
	c  net.Conn
	id uuid.UUID
}

// dialRaw connects to b, over b's network, and sends a handshake
// expecting agent expect.
func dialRaw(t testing.TB, b *Backend, expect uuid.UUID) *rawPeer {
	t.Helper()
	c := dialBackend(t, b)
	p := &rawPeer{t: t, c: c, id: uuid.New()}
	var hs [hsSize]byte
	(&handshake{self: p.id, expect: expect, timeout: 4 * time.Second}).put(hs[:])
	_, err := c.Write(hs[:])
	require.NoError(t, err)
	return p
}

func (p *rawPeer) answer() (status uint8, who uuid.UUID, err error) {
	var hs [hsSize]byte
	_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(p.c, hs[:]); err != nil {
		return 0, who, err
	}
	h, err := getHandshake(hs[:])
	return h.status, h.self, err
}

// frame sends one frame (frameBytes).
func (p *rawPeer) frame(h header, table [][2]uint64, payload []byte) {
	_, err := p.c.Write(frameBytes(h, table, payload))
	require.NoError(p.t, err)
}

// next reads frames until a non-ping one, or an error.
func (p *rawPeer) next() (header, []byte, error) {
	var hb [hdrSize]byte
	var h header
	for {
		_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(p.c, hb[:]); err != nil {
			return h, nil, err
		}
		h.get(hb[:])
		if h.typ == tPing {
			continue
		}
		body := make([]byte, h.length)
		_, err := io.ReadFull(p.c, body)
		return h, body, err
	}
}

func TestInvalidOptions(t *testing.T) {
	for _, o := range []Option{WithStreams(0), WithStreams(65), WithKeepalive(time.Second, time.Second),
		WithChunkSize(1), WithInflight(0), WithListenAddr("nope"), WithAdvertiseAddr(""),
		WithLatencyMode(-time.Microsecond), WithLatencyMode(time.Second)} {
		_, err := agent.New(agent.WithBackends(New(o)))
		require.ErrorIs(t, err, agent.ErrInvalidOption)
	}
}

// Every invalid option is reported, on one line.
func TestInvalidOptionsOnOneLine(t *testing.T) {
	_, err := agent.New(agent.WithBackends(New(WithStreams(0), WithChunkSize(1), nil)))
	require.ErrorIs(t, err, agent.ErrInvalidOption)
	assert.NotContains(t, err.Error(), "\n")
	assert.Contains(t, err.Error(), "; ")
	assert.Contains(t, err.Error(), "nil option")
}

func TestLoopbackToAnotherHost(t *testing.T) {
	_, b := newAgent(t)
	other := connInfo{host: [8]byte{1, 2, 3}, addr: "127.0.0.1:4000"}
	err := b.Reachable(context.Background(), agent.Info{ID: uuid.New(), Conns: []agent.ConnInfo{{Backend: Name, Data: other.marshal()}}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "WithAdvertiseAddr")

	same := connInfo{host: hostIdentity(), addr: "127.0.0.1:4000"}
	require.NoError(t, b.Reachable(context.Background(), agent.Info{ID: uuid.New(), Conns: []agent.ConnInfo{{Backend: Name, Data: same.marshal()}}}))
	routable := connInfo{host: [8]byte{9}, addr: "10.1.2.3:4000"}
	require.NoError(t, b.Reachable(context.Background(), agent.Info{ID: uuid.New(), Conns: []agent.ConnInfo{{Backend: Name, Data: routable.marshal()}}}))
}

func TestHandshakeWithStaleIdentity(t *testing.T) {
	a, b := newAgent(t)
	p := dialRaw(t, b, uuid.New()) // expects an agent that is not there
	status, who, err := p.answer()
	require.NoError(t, err)
	assert.Equal(t, uint8(stDenied), status)
	assert.Equal(t, a.ID(), who)
}

// Every malformed, oversized or unauthorised request, over a real socket:
// the connection is dropped or the request denied, the kind's counter
// moves, no byte outside the granted regions is read or written (guard
// bytes in the same allocation stay secret and unchanged), and an honest
// peer is still served afterwards.
func TestHostileFrames(t *testing.T) {
	tg := newTarget(t, loopback)
	a, b, g, ex := tg.a, tg.b, tg.g, tg.ex
	wBefore := bytes.Clone(g.w)
	base := g.base()
	addr := func(b []byte) uint64 { return agent.DRAM(b).Addr }
	revoked := func(acc agent.Access, mem []byte) agent.Key {
		e, err := a.Expose(acc, []agent.Local{agent.DRAM(mem)})
		require.NoError(t, err)
		e.Revoke()
		return e.Key()
	}
	rk, wk, sk := ex.r.Key(), ex.w.Key(), ex.s.Key()
	read := func(key agent.Key, pieces ...[2]uint64) []byte {
		return frameBytes(header{typ: tRead, count: uint32(len(pieces)), id: 1, key: key}, pieces, nil)
	}
	write := func(key agent.Key, pieces ...[2]uint64) []byte {
		var n uint64
		for _, pc := range pieces {
			n += pc[1]
		}
		return frameBytes(header{typ: tWrite, count: uint32(len(pieces)), id: 1, length: n, key: key}, pieces, bytes.Repeat([]byte{0xEE}, int(n)))
	}
	dropped := func(kind string) Stats {
		s := Stats{Disconnected: 1}
		switch kind {
		case "protocol":
			s.ProtocolErrors = 1
		case "limit":
			s.LimitRejected = 1
		}
		return s
	}
	denied := Stats{Denied: 1}

	cases := []struct {
		name string
		send []byte
		want Stats // the counters' move; Disconnected 0 means answered "denied"
	}{
		{"unknown type", frameBytes(header{typ: 99}, nil, nil), dropped("protocol")},
		{"answer type from the active side", frameBytes(header{typ: tReadResp, id: 1}, nil, nil), dropped("protocol")},
		{"no pieces", frameBytes(header{typ: tRead, id: 1, key: rk}, nil, nil), dropped("protocol")},
		{"piece of no bytes", read(rk, [2]uint64{addr(g.r), 0}), dropped("protocol")},
		{"write length mismatch", frameBytes(header{typ: tWrite, count: 1, length: 10, key: wk}, [][2]uint64{{addr(g.w), 4}}, nil), dropped("protocol")},
		{"notification with pieces", frameBytes(header{typ: tNotify, count: 1, length: 1, key: rk}, nil, []byte{1}), dropped("protocol")},
		{"too many pieces", frameBytes(header{typ: tRead, count: 1 << 30, key: rk}, nil, nil), dropped("limit")},
		{"one piece over", frameBytes(header{typ: tRead, count: 1025, key: rk}, nil, nil), dropped("limit")},
		{"huge piece", read(rk, [2]uint64{addr(g.r), 1 << 40}), dropped("limit")},
		{"max uint64 length", read(rk, [2]uint64{addr(g.r), ^uint64(0)}), dropped("limit")},
		{"pieces adding up past the frame limit", read(rk, [2]uint64{addr(g.r), 9 << 20}, [2]uint64{addr(g.r), 9 << 20}), dropped("limit")},
		{"lengths that wrap the sum", read(rk, [2]uint64{addr(g.r), 16}, [2]uint64{addr(g.r), ^uint64(0) - 8}), dropped("limit")},
		{"huge notification", frameBytes(header{typ: tNotify, length: 1 << 40}, nil, nil), dropped("limit")},
		{"huge WRITE payload", frameBytes(header{typ: tWrite, count: 1, length: 1 << 40, key: wk}, [][2]uint64{{addr(g.w), 1 << 40}}, nil), dropped("limit")},

		{"forged key", read(agent.NewKey(), [2]uint64{addr(g.r), 16}), denied},
		{"zero key", read(agent.Key{}, [2]uint64{addr(g.r), 16}), denied},
		{"past the end", read(rk, [2]uint64{addr(g.r) + page - 100, 200}), denied},
		{"before the start", read(rk, [2]uint64{addr(g.r) - 1, 2}), denied},
		{"the guard after", read(rk, [2]uint64{addr(g.r) + page, 16}), denied},
		{"the whole allocation", read(rk, [2]uint64{base, uint64(len(g.all))}), denied},
		{"a good piece then a bad one", read(rk, [2]uint64{addr(g.r), 16}, [2]uint64{addr(g.r) - 16, 16}), denied},
		{"address wraps around", read(rk, [2]uint64{^uint64(0) - 8, 64}), denied},
		{"address plus length wraps to the region", read(rk, [2]uint64{addr(g.r) + 16, ^uint64(0) - 15}), dropped("limit")},
		{"address zero", read(rk, [2]uint64{0, 16}), denied},
		{"straddling two regions", read(sk, [2]uint64{addr(g.s1) + page/2 - 8, 16}), denied},
		{"another exposure's memory", read(sk, [2]uint64{addr(g.r), 16}), denied},
		{"read with a write key", read(wk, [2]uint64{addr(g.w), 16}), denied},
		{"write to readable", write(rk, [2]uint64{addr(g.r), 16}), denied},
		{"write past the end", write(wk, [2]uint64{addr(g.w) + page - 8, 16}), denied},
		{"write before the start", write(wk, [2]uint64{addr(g.w) - 8, 16}), denied},
		{"write wraps around", write(wk, [2]uint64{^uint64(0) - 8, 64}), denied},
		{"write good piece then guard", write(wk, [2]uint64{addr(g.w), 16}, [2]uint64{addr(g.w) + page, 16}), denied},
		{"read after revoke", read(revoked(agent.AccessRead, g.r), [2]uint64{addr(g.r), 16}), denied},
		{"write after revoke", write(revoked(agent.AccessWrite, g.w), [2]uint64{addr(g.w), 16}), denied},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := b.Stats()
			p, rec := dialHostile(t, b, a.ID())
			_, err := p.c.Write(tc.send)
			require.NoError(t, err)
			if tc.want.Disconnected > 0 {
				p.dropped(t)
			} else {
				h, body, err := p.next()
				require.NoError(t, err)
				assert.Equal(t, uint8(stDenied), h.status)
				assert.Equal(t, uint64(1), h.id)
				assert.Contains(t, string(body), "access denied")
			}
			waitStats(t, b, before, tc.want)
			assert.False(t, g.leaked(rec.received()), "guard bytes reached the hostile peer")
			tg.stillServes(t, wBefore)
		})
	}
}

// Handshakes that are malformed, name another agent or none, or stop
// halfway are refused, dropped and counted.
func TestHostileHandshakes(t *testing.T) {
	tg := newTarget(t, loopback)
	a, b := tg.a, tg.b
	valid := func(self, expect uuid.UUID) []byte {
		var hs [hsSize]byte
		(&handshake{self: self, expect: expect, timeout: time.Second}).put(hs[:])
		return hs[:]
	}
	for _, tc := range []struct {
		name string
		send []byte
	}{
		{"bad magic", append([]byte("HTTP"), valid(uuid.New(), a.ID())[4:]...)},
		{"bad version", func() []byte { b := valid(uuid.New(), a.ID()); b[4] = 9; return b }()},
		{"another agent", valid(uuid.New(), uuid.New())},
		{"nil identity", valid(uuid.Nil, a.ID())},
		{"half a handshake", valid(uuid.New(), a.ID())[:20]},
		{"nothing", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, refused := b.Stats(), a.Stats().Refused
			c, err := net.Dial("tcp", b.Addr().String())
			require.NoError(t, err)
			defer c.Close()
			rec := &recorder{Conn: c}
			_, err = c.Write(tc.send)
			require.NoError(t, err)
			if len(tc.send) < hsSize {
				require.NoError(t, c.(*net.TCPConn).CloseWrite())
			}
			(&rawPeer{t: t, c: rec}).dropped(t)
			if got := rec.received(); len(got) > 0 {
				require.Len(t, got, hsSize, "the only answer is a handshake")
				in, err := getHandshake(got)
				require.NoError(t, err)
				require.Equal(t, uint8(stDenied), in.status)
			}
			waitStats(t, b, before, Stats{Disconnected: 1, HandshakeFailures: 1})
			assert.Greater(t, a.Stats().Refused, refused)
			tg.stillServes(t, nil)
		})
	}
}

// Requests after the agent closed get nothing: the connection is closed,
// new ones are refused, and no byte of the memory leaves.
func TestRequestsAfterAgentClosed(t *testing.T) {
	a, b := newAgent(t)
	g := newGuarded(t)
	ex := g.expose(t, a)
	p, rec := dialHostile(t, b, a.ID())
	addr := b.Addr().String()
	require.NoError(t, a.Close())
	_, _ = p.c.Write(frameBytes(header{typ: tRead, count: 1, id: 1, key: ex.r.Key()}, [][2]uint64{{agent.DRAM(g.r).Addr, page}}, nil))
	p.dropped(t)
	for got := rec.received()[hsSize:]; len(got) >= hdrSize; got = got[hdrSize:] {
		var h header
		h.get(got)
		require.Contains(t, []uint8{tPing, tBye}, h.typ, "a closed agent sent a frame of type %d", h.typ)
		require.Zero(t, h.length)
	}
	assert.False(t, bytes.Contains(rec.received(), g.r[:64]), "exposed bytes left a closed agent")
	if c, err := net.Dial("tcp", addr); err == nil { // the port may have a new owner by now
		defer c.Close()
		var hs [hsSize]byte
		(&handshake{self: uuid.New(), expect: a.ID()}).put(hs[:])
		_, _ = c.Write(hs[:])
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(c, hs[:]); err == nil {
			in, err := getHandshake(hs[:])
			require.False(t, err == nil && in.status == stOK && in.self == a.ID(), "a closed agent still serves")
		}
	}
	g.intact(t, nil)
}

// A passive peer that accepts requests and never answers is declared lost
// after the keepalive timeout; the transfer fails with ErrRemoteLost.
//
// Over loopback: the one keepalive loss the kernel's sockets carry; the
// other timing tests run in fake time.
func TestSilentPassivePeer(t *testing.T) {
	// Answers the handshake, then reads and says nothing.
	peer := fakePassive(t, loopback, uuid.New(), func(c net.Conn) { _, _ = io.Copy(io.Discard, c) })
	a, _ := newAgent(t, WithKeepalive(50*time.Millisecond, 300*time.Millisecond))
	dst := make([]byte, 1<<20)
	start := time.Now()
	x := postFake(t, a, agent.OpRead, peer, dst)
	select {
	case <-x.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("transfer to a silent peer hung")
	}
	require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
	t.Logf("silent peer detected after %v (timeout 300ms)", time.Since(start))
}

// An active peer that takes a lease and then goes silent is declared lost to
// the exposure it used.
func TestSilentActivePeer(t *testing.T) {
	bubble(t, func(t *testing.T, nw *memNet) {
		a, b := newAgent(t, nw, WithKeepalive(50*time.Millisecond, 300*time.Millisecond))
		src := make([]byte, 64)
		exp := expose(t, a, agent.AccessRead, src)
		p := dialRaw(t, b, a.ID())
		_, _, err := p.answer()
		require.NoError(t, err)
		p.frame(header{typ: tRead, count: 1, id: 1, key: exp.Key()}, [][2]uint64{{agent.DRAM(src).Addr, 64}}, nil)
		h, _, err := p.next()
		require.NoError(t, err)
		require.Equal(t, uint8(stOK), h.status)
		require.Equal(t, p.id, exp.Peer())
		select { // the raw peer now sends nothing, not even keepalives
		case ev := <-exp.Events():
			require.Equal(t, agent.EventPeerLost, ev.Kind)
			require.Equal(t, p.id, ev.From)
			require.ErrorIs(t, ev.Err, agent.ErrRemoteLost)
		case <-time.After(10 * time.Second):
			t.Fatal("silent active peer never reported lost")
		}
	})
}

// Fuzz inputs name the exposures and their memory through placeholders,
// replaced before sending, so that a corpus entry means the same in every
// run: fuzzKeyR, fuzzKeyW and fuzzKeyS stand for the keys of R, W and S1+S2
// of a guarded allocation, and any 8 bytes whose upper half is fuzzMark
// stand for the allocation's address plus their lower half.
var (
	fuzzKeyR = agent.Key{'f', 'u', 'z', 'z', 'k', 'e', 'y', 'R'}
	fuzzKeyW = agent.Key{'f', 'u', 'z', 'z', 'k', 'e', 'y', 'W'}
	fuzzKeyS = agent.Key{'f', 'u', 'z', 'z', 'k', 'e', 'y', 'S'}
)

const fuzzMark = 0x7a7a7a7a

func fuzzAddr(off int) uint64 { return fuzzMark<<32 | uint64(off) }

// resolve replaces the placeholders in data.
func resolve(data []byte, keys map[agent.Key]agent.Key, base uint64) []byte {
	data = bytes.Clone(data)
	for i := 0; i < len(data); {
		if i+16 <= len(data) {
			if k, ok := keys[agent.Key(data[i:i+16])]; ok {
				copy(data[i:], k[:])
				i += 16
				continue
			}
		}
		if i+8 <= len(data) {
			if v := binary.LittleEndian.Uint64(data[i:]); v>>32 == fuzzMark {
				binary.LittleEndian.PutUint64(data[i:], base+v&0xffffffff)
				i += 8
				continue
			}
		}
		i++
	}
	return data
}

// FuzzServerFrames drives a live server with arbitrary bytes after a valid
// handshake. The server must never crash; must answer or drop the
// connection, never hang; must send nothing but well-formed frames whose
// READ data holds only exposed bytes and never a guard byte; and must leave
// the guards and the read-only memory unchanged (WRITEs may change W, the
// only writable region).
func FuzzServerFrames(f *testing.F) {
	a, b := newAgent(f, WithKeepalive(50*time.Millisecond, 200*time.Millisecond))
	g := newGuarded(f)
	ex := g.expose(f, a)
	keys := map[agent.Key]agent.Key{fuzzKeyR: ex.r.Key(), fuzzKeyW: ex.w.Key(), fuzzKeyS: ex.s.Key()}
	base := g.base()
	const (
		offR = page
		offW = 3 * page
		offS = 5 * page
	)
	rd := func(key agent.Key, pieces ...[2]uint64) []byte {
		return frameBytes(header{typ: tRead, count: uint32(len(pieces)), id: 1, key: key}, pieces, nil)
	}
	wr := func(key agent.Key, off, n int) []byte {
		return frameBytes(header{typ: tWrite, count: 1, id: 2, length: uint64(n), key: key}, [][2]uint64{{fuzzAddr(off), uint64(n)}}, bytes.Repeat([]byte{7}, n))
	}
	for _, s := range [][]byte{
		rd(fuzzKeyR, [2]uint64{fuzzAddr(offR), 16}),
		rd(fuzzKeyR, [2]uint64{fuzzAddr(offR), page}, [2]uint64{fuzzAddr(offR + 8), 8}),
		rd(fuzzKeyR, [2]uint64{fuzzAddr(offR + page - 8), 16}),
		rd(fuzzKeyR, [2]uint64{fuzzAddr(offR - 1), 1}),
		rd(fuzzKeyS, [2]uint64{fuzzAddr(offS + page/2 - 4), 8}),
		rd(fuzzKeyW, [2]uint64{fuzzAddr(offW), 16}),
		wr(fuzzKeyW, offW, 16),
		wr(fuzzKeyW, offW+page-8, 16),
		wr(fuzzKeyR, offR, 16),
		append(append(rd(fuzzKeyR, [2]uint64{fuzzAddr(offR), 64}), wr(fuzzKeyW, offW+64, 64)...), rd(fuzzKeyS, [2]uint64{fuzzAddr(offS), page})...),
		frameBytes(header{typ: tNotify, length: 3, key: fuzzKeyR}, nil, []byte("hey")),
		frameBytes(header{typ: tPing}, nil, nil),
		frameBytes(header{typ: tBye}, nil, nil),
		[]byte("GXTP garbage"),
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		p := dialRaw(t, b, a.ID())
		if status, _, err := p.answer(); err != nil || status != stOK {
			t.Fatalf("handshake: status %d, %v", status, err)
		}
		tc := p.c.(*net.TCPConn)
		var out []byte
		read := make(chan error, 1)
		go func() { // read while writing: the server's answers must not back up
			_ = tc.SetReadDeadline(time.Now().Add(10 * time.Second))
			var err error
			out, err = io.ReadAll(tc)
			read <- err
		}()
		if _, err := tc.Write(resolve(data, keys, base)); err != nil && !errors.Is(err, net.ErrClosed) &&
			!strings.Contains(err.Error(), "reset") && !strings.Contains(err.Error(), "broken pipe") {
			t.Fatal(err)
		}
		_ = tc.CloseWrite()
		var ne net.Error
		if err := <-read; errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("server neither answered nor dropped the connection")
		}
		if g.leaked(out) {
			t.Fatal("guard bytes left the server")
		}
		checkServerOutput(t, out)
		g.intact(t, nil)
	})
}

// checkServerOutput parses what a server sent after its handshake: only
// pings, goodbyes, refusals and answers, READ data holding only exposed
// bytes. A frame cut short at the end is allowed (the connection dropped).
func checkServerOutput(t *testing.T, out []byte) {
	t.Helper()
	for len(out) >= hdrSize {
		var h header
		h.get(out)
		out = out[hdrSize:]
		if h.count != 0 {
			t.Fatalf("server frame type %d with %d pieces", h.typ, h.count)
		}
		n := min(uint64(len(out)), h.length)
		body := out[:n]
		out = out[n:]
		switch {
		case h.typ == tPing || h.typ == tBye || (h.typ == tWriteAck && h.status == stOK):
			if h.length != 0 {
				t.Fatalf("server frame type %d with %d payload bytes", h.typ, h.length)
			}
		case (h.typ == tReadResp || h.typ == tWriteAck) && h.status == stDenied:
			if h.length > maxErrMsg {
				t.Fatalf("refusal of %d bytes", h.length)
			}
		case h.typ == tReadResp && h.status == stOK:
			for i, c := range body {
				if c != exposedB {
					t.Fatalf("READ answer carries a byte that is not exposed memory at %d: %#x", i, c)
				}
			}
		default:
			t.Fatalf("server sent frame type %d status %d", h.typ, h.status)
		}
	}
}

// A token that claims a known agent's identity at another address gets
// connections of its own: transfers made with the genuine token still go to
// the genuine agent, and their keys never reach the impostor.
func TestForgedIdentityDoesNotRedirect(t *testing.T) {
	victim, _ := newAgent(t)
	src := bytes.Repeat([]byte{7}, 4096)
	exp := expose(t, victim, agent.AccessRead, src)

	// The impostor answers handshakes as the victim and records every key
	// it is sent.
	keys := make(chan agent.Key, 64)
	forgedInfo := fakePassive(t, loopback, victim.ID(), func(c net.Conn) {
		if req, _, err := readRequest(c); err == nil {
			keys <- req.key
		}
		// and hang up, so the decoy fails at once
	})

	active, _ := newAgent(t)
	dst := make([]byte, 4096)
	seg := []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}
	decoy, err := active.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: forgedInfo, Key: agent.NewKey(), Segments: seg})
	require.NoError(t, err)
	<-decoy.Done()
	require.ErrorIs(t, decoy.Err(), agent.ErrRemoteLost)
	require.Len(t, keys, 1, "the impostor got the forged token's transfer")

	for range 3 {
		x, err := active.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: victim.Info(), Key: exp.Key(), Segments: seg})
		require.NoError(t, err)
		<-x.Done()
		require.NoError(t, x.Err())
		require.Equal(t, src, dst)
	}
	for {
		select {
		case k := <-keys:
			require.NotEqual(t, exp.Key(), k, "the genuine key reached the impostor")
		default:
			return
		}
	}
}
