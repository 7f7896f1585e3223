package tcp

import (
	"bytes"
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
)

func newAgent(t testing.TB, opts ...Option) (*agent.Agent, *Backend) {
	t.Helper()
	b := New(opts...)
	a, err := agent.New(agent.WithBackends(b))
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })
	return a, b
}

// rawPeer is a hand-driven client speaking the wire protocol.
type rawPeer struct {
	t  testing.TB
	c  net.Conn
	id uuid.UUID
}

func dialRaw(t testing.TB, b *Backend, expect uuid.UUID) *rawPeer {
	t.Helper()
	c, err := net.Dial("tcp", b.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	p := &rawPeer{t: t, c: c, id: uuid.New()}
	var hs [hsSize]byte
	(&handshake{self: p.id, expect: expect, timeout: 4 * time.Second}).put(hs[:])
	_, err = c.Write(hs[:])
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

func (p *rawPeer) frame(h header, table [][2]uint64, payload []byte) {
	b := make([]byte, hdrSize, hdrSize+len(table)*pieceSize+len(payload))
	h.put(b)
	for _, pc := range table {
		b = binary.LittleEndian.AppendUint64(b, pc[0])
		b = binary.LittleEndian.AppendUint64(b, pc[1])
	}
	b = append(b, payload...)
	_, err := p.c.Write(b)
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
		WithChunkSize(1), WithInflight(0), WithListenAddr("nope"), WithAdvertiseAddr("")} {
		_, err := agent.New(agent.WithBackends(New(o)))
		require.ErrorIs(t, err, ErrInvalidOption)
	}
}

func TestLoopbackToAnotherHost(t *testing.T) {
	_, b := newAgent(t)
	other := connInfo{host: [8]byte{1, 2, 3}, addr: "127.0.0.1:4000"}
	err := b.Reachable(agent.Info{ID: uuid.New(), Conns: []agent.ConnInfo{{Backend: Name, Data: other.marshal()}}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "WithAdvertiseAddr")

	same := connInfo{host: hostIdentity(), addr: "127.0.0.1:4000"}
	require.NoError(t, b.Reachable(agent.Info{ID: uuid.New(), Conns: []agent.ConnInfo{{Backend: Name, Data: same.marshal()}}}))
	routable := connInfo{host: [8]byte{9}, addr: "10.1.2.3:4000"}
	require.NoError(t, b.Reachable(agent.Info{ID: uuid.New(), Conns: []agent.ConnInfo{{Backend: Name, Data: routable.marshal()}}}))
}

func TestHandshakeWithStaleIdentity(t *testing.T) {
	a, b := newAgent(t)
	p := dialRaw(t, b, uuid.New()) // expects an agent that is not there
	status, who, err := p.answer()
	require.NoError(t, err)
	assert.Equal(t, uint8(stDenied), status)
	assert.Equal(t, a.ID(), who)
}

func TestHostileFrames(t *testing.T) {
	a, b := newAgent(t)
	src := bytes.Repeat([]byte{0xAB}, 4096)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	addr := agent.DRAM(src).Addr

	cases := []struct {
		name    string
		send    func(p *rawPeer)
		closed  bool // the connection is dropped
		refused bool
	}{
		{"unknown type", func(p *rawPeer) { p.frame(header{typ: 99}, nil, nil) }, true, true},
		{"too many pieces", func(p *rawPeer) { p.frame(header{typ: tRead, count: 1 << 30, key: exp.Key()}, nil, nil) }, true, true},
		{"huge piece", func(p *rawPeer) {
			p.frame(header{typ: tRead, count: 1, key: exp.Key()}, [][2]uint64{{addr, 1 << 40}}, nil)
		}, true, true},
		{"huge notification", func(p *rawPeer) { p.frame(header{typ: tNotify, length: 1 << 40}, nil, nil) }, true, true},
		{"write length mismatch", func(p *rawPeer) {
			p.frame(header{typ: tWrite, count: 1, length: 10, key: exp.Key()}, [][2]uint64{{addr, 4}}, nil)
		}, true, true},
		{"forged key", func(p *rawPeer) {
			p.frame(header{typ: tRead, count: 1, id: 1, key: agent.NewKey()}, [][2]uint64{{addr, 16}}, nil)
		}, false, true},
		{"out of bounds", func(p *rawPeer) {
			p.frame(header{typ: tRead, count: 1, id: 1, key: exp.Key()}, [][2]uint64{{addr + 4000, 200}}, nil)
		}, false, true},
		{"write to readable", func(p *rawPeer) {
			p.frame(header{typ: tWrite, count: 1, id: 1, length: 16, key: exp.Key()}, [][2]uint64{{addr, 16}}, make([]byte, 16))
		}, false, true},
		{"address wraps around", func(p *rawPeer) {
			p.frame(header{typ: tRead, count: 1, id: 1, key: exp.Key()}, [][2]uint64{{^uint64(0) - 8, 64}}, nil)
		}, false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := a.Stats().Refused
			p := dialRaw(t, b, a.ID())
			status, _, err := p.answer()
			require.NoError(t, err)
			require.Equal(t, uint8(stOK), status)
			tc.send(p)
			h, body, err := p.next()
			if tc.closed {
				require.Error(t, err, "connection should be dropped")
			} else {
				require.NoError(t, err)
				assert.Equal(t, uint8(stDenied), h.status)
				assert.Contains(t, string(body), "access denied")
			}
			if tc.refused {
				require.Eventually(t, func() bool { return a.Stats().Refused > before }, 5*time.Second, time.Millisecond)
			}
			exp.Revoke()
			exp2, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
			require.NoError(t, err)
			exp = exp2
			assert.Equal(t, bytes.Repeat([]byte{0xAB}, 4096), src, "exposed bytes changed")
		})
	}
}

// A passive peer that accepts requests and never answers is declared lost
// after the keepalive timeout; the transfer fails with ErrRemoteLost.
func TestSilentPassivePeer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	fake := uuid.New()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { // answer the handshake, then read and say nothing
				defer c.Close()
				var hs [hsSize]byte
				if _, err := io.ReadFull(c, hs[:]); err != nil {
					return
				}
				(&handshake{self: fake}).put(hs[:])
				_, _ = c.Write(hs[:])
				_, _ = io.Copy(io.Discard, c)
			}()
		}
	}()
	a, _ := newAgent(t, WithKeepalive(50*time.Millisecond, 300*time.Millisecond))
	ci := connInfo{host: hostIdentity(), addr: ln.Addr().String()}
	dst := make([]byte, 1<<20)
	start := time.Now()
	x, err := a.Post(agent.Request{Op: agent.OpRead, Peer: agent.Info{ID: fake, Conns: []agent.ConnInfo{{Backend: Name, Data: ci.marshal()}}}, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: 1 << 20}}}})
	require.NoError(t, err)
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
	a, b := newAgent(t, WithKeepalive(50*time.Millisecond, 300*time.Millisecond))
	src := make([]byte, 64)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	p := dialRaw(t, b, a.ID())
	_, _, err = p.answer()
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
}

// FuzzServerFrames feeds arbitrary bytes to a server after a valid
// handshake: it must never crash, never change exposed memory it was not
// granted to write, and must answer or drop the connection.
func FuzzServerFrames(f *testing.F) {
	a, b := newAgent(f, WithKeepalive(50*time.Millisecond, 200*time.Millisecond))
	src := bytes.Repeat([]byte{0x5A}, 4096)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(f, err)
	addr := agent.DRAM(src).Addr
	seed := func(h header, table [][2]uint64, payload []byte) []byte {
		buf := make([]byte, hdrSize)
		h.put(buf)
		for _, pc := range table {
			buf = binary.LittleEndian.AppendUint64(buf, pc[0])
			buf = binary.LittleEndian.AppendUint64(buf, pc[1])
		}
		return append(buf, payload...)
	}
	f.Add(seed(header{typ: tRead, count: 1, id: 1, key: exp.Key()}, [][2]uint64{{addr, 16}}, nil))
	f.Add(seed(header{typ: tWrite, count: 1, id: 1, length: 4, key: exp.Key()}, [][2]uint64{{addr, 4}}, []byte{1, 2, 3, 4}))
	f.Add(seed(header{typ: tNotify, length: 3, key: exp.Key()}, nil, []byte("hey")))
	f.Add(seed(header{typ: tPing}, nil, nil))
	f.Add(seed(header{typ: tBye}, nil, nil))
	f.Add([]byte("GXTP garbage"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p := dialRaw(t, b, a.ID())
		if _, _, err := p.answer(); err != nil {
			t.Fatal(err)
		}
		if _, err := p.c.Write(data); err != nil && !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "reset") {
			t.Fatal(err)
		}
		_ = p.c.(*net.TCPConn).CloseWrite()
		_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err := io.Copy(io.Discard, p.c)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("server neither answered nor dropped the connection")
		}
		if !bytes.Equal(src, bytes.Repeat([]byte{0x5A}, 4096)) {
			t.Fatal("read-only exposed memory changed")
		}
	})
}

// A token that claims a known agent's identity at another address gets
// connections of its own: transfers made with the genuine token still go to
// the genuine agent, and their keys never reach the impostor.
func TestForgedIdentityDoesNotRedirect(t *testing.T) {
	victim, _ := newAgent(t)
	src := bytes.Repeat([]byte{7}, 4096)
	exp, err := victim.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)

	// The impostor answers handshakes as the victim and records every key
	// it is sent.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	keys := make(chan agent.Key, 64)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var hs [hsSize]byte
				if _, err := io.ReadFull(c, hs[:]); err != nil {
					return
				}
				(&handshake{self: victim.ID()}).put(hs[:])
				_, _ = c.Write(hs[:])
				var hb [hdrSize]byte
				for {
					if _, err := io.ReadFull(c, hb[:]); err != nil {
						return
					}
					var h header
					if h.get(hb[:]); h.typ == tPing {
						continue
					}
					keys <- h.key
					return // hang up, so the decoy fails at once
				}
			}()
		}
	}()

	active, _ := newAgent(t)
	forged := connInfo{host: hostIdentity(), addr: ln.Addr().String()}
	forgedInfo := agent.Info{ID: victim.ID(), Conns: []agent.ConnInfo{{Backend: Name, Data: forged.marshal()}}}
	dst := make([]byte, 4096)
	seg := []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}
	decoy, err := active.Post(agent.Request{Op: agent.OpRead, Peer: forgedInfo, Key: agent.NewKey(), Segments: seg})
	require.NoError(t, err)
	<-decoy.Done()
	require.ErrorIs(t, decoy.Err(), agent.ErrRemoteLost)
	require.Len(t, keys, 1, "the impostor got the forged token's transfer")

	for range 3 {
		x, err := active.Post(agent.Request{Op: agent.OpRead, Peer: victim.Info(), Key: exp.Key(), Segments: seg})
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
