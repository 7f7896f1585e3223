package tcp

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/binary"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/serve"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// The test-only hostile client: exposed memory surrounded by secret guard
// bytes in the same allocation, a recorder of every byte a raw peer
// receives, and the checks every hostile test ends with.

const (
	page     = 4096
	exposedB = 0x5A // every exposed readable byte; never a guard byte
)

// guarded is one allocation laid out as
//
//	guard | R | guard | W | guard | S1 S2 | guard
//
// with R exposed for reading, W for writing, and S1, S2 two adjacent
// regions exposed together for reading. Guards hold random secret bytes.
type guarded struct {
	all    []byte
	secret []byte // the guards' contents, in order
	r, w   []byte
	s1, s2 []byte
}

func newGuarded(t testing.TB) *guarded {
	t.Helper()
	g := &guarded{all: make([]byte, 8*page)}
	g.r, g.w = g.all[page:2*page], g.all[3*page:4*page]
	g.s1, g.s2 = g.all[5*page:5*page+page/2], g.all[5*page+page/2:6*page]
	for _, gd := range g.guards() {
		_, _ = crand.Read(gd)
		for i := range gd {
			if gd[i] == exposedB {
				gd[i] = 0xA5
			}
		}
		g.secret = append(g.secret, gd...)
	}
	for _, b := range [][]byte{g.r, g.s1, g.s2} {
		for i := range b {
			b[i] = exposedB
		}
	}
	return g
}

func (g *guarded) guards() [][]byte {
	return [][]byte{g.all[:page], g.all[2*page : 3*page], g.all[4*page : 5*page], g.all[6*page:]}
}

func (g *guarded) base() uint64 { return agent.DRAM(g.all).Addr }

// intact fails t unless every guard holds its secret and R, S1, S2 their
// exposed bytes; W must equal w.
func (g *guarded) intact(t testing.TB, w []byte) {
	t.Helper()
	var got []byte
	for _, gd := range g.guards() {
		got = append(got, gd...)
	}
	require.True(t, bytes.Equal(g.secret, got), "guard bytes around the exposed memory changed")
	for _, b := range [][]byte{g.r, g.s1, g.s2} {
		require.Equal(t, bytes.Repeat([]byte{exposedB}, len(b)), b, "read-only exposed memory changed")
	}
	if w != nil {
		require.True(t, bytes.Equal(w, g.w), "writable exposed memory changed by a refused WRITE")
	}
}

// leaked reports whether any 8 consecutive guard bytes occur in got.
func (g *guarded) leaked(got []byte) bool {
	for _, gd := range g.guards() {
		for i := 0; i+8 <= len(gd); i += 8 {
			if bytes.Contains(got, gd[i:i+8]) {
				return true
			}
		}
	}
	return false
}

// exposures exposes R, W and S1+S2 on a.
type exposures struct{ r, w, s *agent.Exposure }

func (g *guarded) expose(t testing.TB, a *agent.Agent) exposures {
	t.Helper()
	r, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(g.r)})
	require.NoError(t, err)
	w, err := a.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(g.w)})
	require.NoError(t, err)
	s, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(g.s1), agent.DRAM(g.s2)})
	require.NoError(t, err)
	return exposures{r, w, s}
}

// recorder keeps every byte read through it.
type recorder struct {
	net.Conn
	mu  sync.Mutex
	got []byte
}

func (r *recorder) Read(b []byte) (int, error) {
	n, err := r.Conn.Read(b)
	r.mu.Lock()
	r.got = append(r.got, b[:n]...)
	r.mu.Unlock()
	return n, err
}

func (r *recorder) received() []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return bytes.Clone(r.got)
}

// dialHostile is dialRaw with every received byte recorded. Its handshake
// has been answered with status OK when it returns.
func dialHostile(t testing.TB, b *Backend, expect [16]byte) (*rawPeer, *recorder) {
	t.Helper()
	p := dialRaw(t, b, expect)
	rec := &recorder{Conn: p.c}
	p.c = rec
	status, _, err := p.answer()
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), status)
	return p, rec
}

// greet sends the handshake hs on c and returns the answer, or an error if
// c closed first, or no answer came within 10 s.
func greet(c net.Conn, hs handshake) (handshake, error) {
	var b [hsSize]byte
	hs.put(b[:])
	if _, err := c.Write(b[:]); err != nil {
		return handshake{}, err
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return handshake{}, err
	}
	return getHandshake(b[:])
}

// dropped reports whether the server closed p's connection (rather than
// leaving it open until the hang guard).
func (p *rawPeer) dropped(t testing.TB) {
	t.Helper()
	_ = p.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := io.Copy(io.Discard, p.c)
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("the server kept the connection of a hostile peer open")
	}
}

// waitStats waits until b's counters moved by want since before, and fails
// if they moved by anything else, then or 5 ms later.
func waitStats(t testing.TB, b *Backend, before, want Stats) {
	t.Helper()
	backendtest.WaitCounters(t, func() Stats { return serve.Delta(b.Stats(), before) }, want, 5*time.Millisecond)
}

// expose exposes mem on a for acc.
func expose(t testing.TB, a *agent.Agent, acc agent.Access, mem []byte) *agent.Exposure {
	t.Helper()
	e, err := a.Expose(acc, []agent.Local{agent.DRAM(mem)})
	require.NoError(t, err)
	return e
}

// postRead starts a READ by active of all of r, which passive exposes under
// exp, into fresh memory, which it returns.
func postRead(t testing.TB, active, passive *agent.Agent, exp *agent.Exposure, r []byte) (*agent.Xfer, []byte) {
	t.Helper()
	dst := make([]byte, len(r))
	x, err := active.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: passive.Info(), Key: exp.Key(),
		Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(r).Region}}})
	require.NoError(t, err)
	return x, dst
}

// legitRead has active READ all of exp's region r from passive and checks
// the bytes: the agent still serves honest peers.
func legitRead(t testing.TB, active, passive *agent.Agent, exp *agent.Exposure, r []byte) {
	t.Helper()
	x, dst := postRead(t, active, passive, exp, r)
	backendtest.DoneWithin(t, x, 20*time.Second, "a legitimate transfer")
	require.NoError(t, x.Err(), "a legitimate transfer failed")
	require.Equal(t, r, dst)
}

// postFake starts an op between local and the len(local) bytes at address
// 4096 of peer, under a made-up key: what a fake peer is sent.
func postFake(t testing.TB, a *agent.Agent, op agent.Op, peer agent.Info, local []byte) *agent.Xfer {
	t.Helper()
	x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: peer, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: agent.Region{Addr: 4096, Len: uint64(len(local))}}}})
	require.NoError(t, err)
	return x
}

// target is an agent under attack: it exposes a guarded allocation, and
// an honest peer checks that it still serves.
type target struct {
	a      *agent.Agent
	b      *Backend
	honest *agent.Agent
	g      *guarded
	ex     exposures
}

// newTarget starts a target with opts, and its honest peer, on nw.
func newTarget(t testing.TB, nw network, opts ...Option) *target {
	t.Helper()
	a, b := newAgent(t, append(opts, nw)...)
	honest, _ := newAgent(t, nw)
	g := newGuarded(t)
	return &target{a: a, b: b, honest: honest, g: g, ex: g.expose(t, a)}
}

// stillServes fails t unless the target's memory is intact (g.intact, with
// W equal to w if w is not nil) and it serves the honest peer a READ.
func (tg *target) stillServes(t testing.TB, w []byte) {
	t.Helper()
	tg.g.intact(t, w)
	legitRead(t, tg.honest, tg.a, tg.ex.r, tg.g.r)
}

// frameBytes encodes one frame.
func frameBytes(h header, table [][2]uint64, payload []byte) []byte {
	b := make([]byte, hdrSize, hdrSize+len(table)*pieceSize+len(payload))
	h.put(b)
	for _, pc := range table {
		b = binary.LittleEndian.AppendUint64(b, pc[0])
		b = binary.LittleEndian.AppendUint64(b, pc[1])
	}
	return append(b, payload...)
}
