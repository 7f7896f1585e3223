//go:build ucx

package ucx

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/serve"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// onLoop runs f on b's progress thread and waits for it.
func onLoop(t *testing.T, b *Backend, f func(l *loop)) {
	t.Helper()
	done := make(chan struct{})
	require.NoError(t, b.submit(command{run: func(l *loop) { f(l); close(done) }}))
	<-done
}

// newUCXAgent starts an agent on a ucx backend with opts.
func newUCXAgent(t *testing.T, opts ...Option) (*agent.Agent, *Backend) {
	t.Helper()
	u := New(opts...)
	return backendtest.NewAgent(t, u), u
}

// since returns what each counter moved by from before to s.
var since = serve.Delta

// waitStats waits until u's counters moved by want since before, and fails
// if they moved by anything else, then or 50 ms later.
func waitStats(t *testing.T, u *Backend, before, want Stats) {
	t.Helper()
	backendtest.WaitCounters(t, func() Stats { return since(u.Stats(), before) }, want, 50*time.Millisecond)
}

// exposing is two agents: a exposes mem, 1 MiB, for reading (revoked
// when the test ends) and b reaches it.
type exposing struct {
	a, b   *agent.Agent
	ua, ub *Backend
	mem    []byte
	exp    *agent.Exposure
}

func newExposing(t *testing.T) *exposing {
	t.Helper()
	e := &exposing{mem: make([]byte, 1<<20)}
	e.a, e.ua = newUCXAgent(t)
	e.b, e.ub = newUCXAgent(t)
	var err error
	e.exp, err = e.a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(e.mem)})
	require.NoError(t, err)
	t.Cleanup(e.exp.Revoke)
	return e
}

// post has b move the first n bytes of mem by op under key, and returns
// the transfer's error.
func (e *exposing) post(t *testing.T, key agent.Key, op agent.Op, n uint64) error {
	t.Helper()
	x, err := e.b.Post(context.Background(), agent.Request{Op: op, Peer: e.a.Info(), Key: key,
		Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, n)), Remote: agent.Region{Addr: agent.DRAM(e.mem).Addr, Len: n}}}})
	require.NoError(t, err)
	<-x.Done()
	return x.Err()
}

// Lease requests refused by the exposing side count as denied there, the
// connection kept; the agent sees them under the backend's name.
func TestStatsDenied(t *testing.T) {
	e := newExposing(t)
	a, ua, ub, exp := e.a, e.ua, e.ub, e.exp
	post := func(key agent.Key, op agent.Op, n uint64) error { return e.post(t, key, op, n) }
	require.NoError(t, post(exp.Key(), agent.OpRead, 1<<20))
	beforeA, beforeB := ua.Stats(), ub.Stats()
	require.ErrorIs(t, post(agent.NewKey(), agent.OpRead, 1<<20), agent.ErrAccessDenied) // unknown key
	require.ErrorIs(t, post(agent.NewKey(), agent.OpRead, 4096), agent.ErrAccessDenied)  // inline
	require.ErrorIs(t, post(exp.Key(), agent.OpWrite, 1<<20), agent.ErrAccessDenied)     // wrong access kind
	waitStats(t, ua, beforeA, Stats{Denied: 3})
	assert.Equal(t, Stats{}, since(ub.Stats(), beforeB))
	require.NoError(t, post(exp.Key(), agent.OpRead, 1<<20), "the connection is kept")
	c, ok := a.Stats().Backends[Name]
	require.True(t, ok, "the agent collects ucx's counters")
	assert.Equal(t, beforeA.Denied+3, c.Denied)
}

// Malformed and out-of-place messages count as protocol errors (over a
// limit: limit_rejected) where they arrive; a lease requested twice on
// one connection costs the connection.
func TestStatsMalformed(t *testing.T) {
	e := newExposing(t)
	a, ua, ub, exp, mem := e.a, e.ua, e.ub, e.exp, e.mem
	require.NoError(t, e.post(t, exp.Key(), agent.OpRead, 4096))

	before, refused := ua.Stats(), a.Stats().Refused
	onLoop(t, ub, func(l *loop) {
		p := l.outs[a.ID()][0]
		require.True(t, p.ready)
		l.send(p.ep, []byte{1, 2, 3})                                // shorter than a header
		l.send(p.ep, header(nil, 99, 0, 0, p.remote))                // unknown type
		l.send(p.ep, header(nil, tPing, 0, 0, cid{1}))               // no such connection
		l.send(p.ep, append(header(nil, tGrant, 0, 0, p.remote), 8)) // a grant to the exposing side, and malformed
		m := header(nil, tOpen, uint8(agent.AccessRead), uint32(l.b.cfg.maxRanges+1), p.remote)
		l.send(p.ep, m) // too many ranges
	})
	waitStats(t, ua, before, Stats{ProtocolErrors: 4, LimitRejected: 1})
	assert.Equal(t, refused+5, a.Stats().Refused)

	// The same lease twice: the second costs the connection.
	before = ua.Stats()
	onLoop(t, ub, func(l *loop) {
		p := l.outs[a.ID()][0]
		m := header(nil, tOpen, uint8(agent.AccessRead), 1, p.remote)
		m = binary.LittleEndian.AppendUint64(m, 1<<60)
		k := exp.Key()
		m = append(m, k[:]...)
		m = binary.LittleEndian.AppendUint64(m, agent.DRAM(mem).Addr)
		m = binary.LittleEndian.AppendUint64(m, 4096)
		l.send(p.ep, m)
		l.send(p.ep, m)
	})
	waitStats(t, ua, before, Stats{Disconnected: 1, ProtocolErrors: 1})
}

// A hello naming another agent is a handshake failure where it arrives;
// the side that sent it hears nothing and times out.
func TestStatsHandshakeAndTimeout(t *testing.T) {
	a, ua := newUCXAgent(t)
	b, ub := newUCXAgent(t, WithTimeout(300*time.Millisecond))
	beforeA, beforeB := ua.Stats(), ub.Stats()
	wrong := a.Info()
	wrong.ID = uuid.New()
	x, err := b.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: wrong, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 4096)), Remote: agent.Region{Addr: 4096, Len: 4096}}}})
	require.NoError(t, err)
	<-x.Done()
	require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
	waitStats(t, ua, beforeA, Stats{Disconnected: 1, HandshakeFailures: 1})
	waitStats(t, ub, beforeB, Stats{Disconnected: 1, Timeouts: 1})
}

// A lease request left unanswered is a timeout.
func TestStatsLeaseTimeout(t *testing.T) {
	peer, _ := backendtest.StartStuck(t, New(WithTimeout(time.Minute)))
	a, u := newUCXAgent(t, WithTimeout(300*time.Millisecond))
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: peer, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 1<<20)), Remote: agent.Region{Addr: 4096, Len: 1 << 20}}}})
	require.NoError(t, err)
	<-x.Done()
	require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
	waitStats(t, u, Stats{}, Stats{Disconnected: 1, Timeouts: 1})
}

// Only transports that wake an armed worker on every event may sleep while
// bytes move.
func TestSocketsOnly(t *testing.T) {
	for tls, want := range map[string]bool{
		"tcp": true, "tcp,self": true, " self , tcp ": true, `\tcp,self`: true,
		"": false, "all": false, "^posix": false, "posix,self": false, "tcp,posix,self": false,
		"rc,self": false, "sm,tcp": false, "self": true,
	} {
		assert.Equal(t, want, socketsOnly(tls), "%q", tls)
	}
}
