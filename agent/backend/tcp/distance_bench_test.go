package tcp_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backendtest"
	"github.com/goxfer/goxfer/internal/faultproxy"
)

// At distance: the tcp backend against raw TCP when a round trip is added
// between the agents. This kernel has no netem, so the delay comes from a
// faultproxy on the path, which also bounds each connection's throughput
// (it holds 1 MiB per connection and direction in flight); raw TCP
// therefore goes through an identical proxy, over as many connections as
// the backend has data streams, so that the ratio compares the backend's
// pipelining with the ceiling of the same path.

// distanceRig is two agents in one process, the passive one reachable only
// through a proxy, and a raw TCP server behind a proxy of its own.
type distanceRig struct {
	size    int
	streams int

	gx, raw *faultproxy.Proxy
	active  *agent.Agent
	passive *tcp.Backend
	tg      backendtest.BenchTarget
	rbuf    []byte // the passive side's readable memory
	wbuf    []byte // and its writable memory
	wexp    *agent.Exposure
	local   []byte // the active side's memory
	conns   []net.Conn
}

// newDistanceRig builds a rig that moves size bytes per transfer, with
// streams data streams (tcp.WithStreams) and the raw baseline over as many
// connections; opts go to both agents' backends.
func newDistanceRig(tb testing.TB, size, streams int, opts ...tcp.Option) *distanceRig {
	tb.Helper()
	r := &distanceRig{size: size, streams: streams, local: make([]byte, size)}
	opts = append([]tcp.Option{tcp.WithStreams(streams)}, opts...)
	var err error
	r.gx, err = faultproxy.New("")
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = r.gx.Close() }) // after the agents, which say goodbye through it
	r.passive = tcp.New(append(opts[:len(opts):len(opts)], tcp.WithAdvertiseAddr(r.gx.Addr()))...)
	pa := backendtest.NewAgent(tb, r.passive)
	r.gx.SetUpstream(r.passive.Addr().String())
	r.active = backendtest.NewAgent(tb, tcp.New(opts...))
	r.rbuf, r.wbuf = make([]byte, size), make([]byte, size)
	for i := range r.rbuf {
		r.rbuf[i] = byte(i)
	}
	rexp, err := pa.Expose(agent.AccessRead, []agent.Local{agent.DRAM(r.rbuf)})
	require.NoError(tb, err)
	r.wexp, err = pa.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(r.wbuf)})
	require.NoError(tb, err)
	r.tg = backendtest.BenchTarget{Info: pa.Info(), ReadKey: rexp.Key(), WriteKey: r.wexp.Key(),
		Addr: agent.DRAM(r.rbuf).Addr, WriteAddr: agent.DRAM(r.wbuf).Addr, Size: size}

	per := size / streams
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = ln.Close() })
	go serveRaw(ln, make([]byte, per))
	r.raw, err = faultproxy.New(ln.Addr().String())
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = r.raw.Close() })
	r.conns = dialRawConns(tb, r.raw.Addr(), streams)
	return r
}

// setRTT adds rtt to the round trip of both paths, half in each direction.
func (r *distanceRig) setRTT(rtt time.Duration) {
	for _, p := range []*faultproxy.Proxy{r.gx, r.raw} {
		p.Latency(faultproxy.Both, rtt/2, 0)
	}
}

// goxfer moves size bytes with one transfer and returns how long it took.
func (r *distanceRig) goxfer(op agent.Op) (time.Duration, error) {
	key, base := r.tg.Remote(op)
	req := agent.Request{Op: op, Peer: r.tg.Info, Key: key,
		Segments: []agent.Segment{{Local: agent.DRAM(r.local), Remote: agent.Region{Addr: base, Len: uint64(r.size)}}}}
	t0 := time.Now()
	x, err := r.active.Post(context.Background(), req)
	if err != nil {
		return 0, err
	}
	<-x.Done()
	return time.Since(t0), x.Err()
}

// rawTCP moves size bytes split evenly over the raw connections and returns
// how long it took.
func (r *distanceRig) rawTCP(op agent.Op) (time.Duration, error) {
	t0 := time.Now()
	err := rawRound(r.conns, op, r.local[:r.size])
	return time.Since(t0), err
}

// distanceConfigs are the backend configurations BenchmarkDistance runs:
// the defaults, more streams, and a window per stream (chunk × in-flight
// frames) smaller than the proxy's, to show what too small a window costs.
var distanceConfigs = []struct {
	name    string
	streams int
	opts    []tcp.Option
}{
	{"default", 4, nil},
	{"streams=8", 8, nil},
	{"window=256KiB", 4, []tcp.Option{tcp.WithChunkSize(128 << 10), tcp.WithInflight(2)}},
}

// BenchmarkDistance measures 64 MiB READs and WRITEs through the tcp
// backend with 0, 1 and 10 ms added to the round trip, and raw TCP over as
// many connections as the backend has data streams, through an identical
// proxy, alternating which goes first in each iteration. It reports both
// throughputs and their ratio (goxfer/raw); ns/op covers the pair.
//
//	nice go test -run '^$' -bench Distance -benchtime 10x ./agent/backend/tcp/
func BenchmarkDistance(b *testing.B) {
	const size = 64 << 20
	for _, cfg := range distanceConfigs {
		b.Run(cfg.name, func(b *testing.B) {
			r := newDistanceRig(b, size, cfg.streams, cfg.opts...)
			for _, rtt := range []time.Duration{0, time.Millisecond, 10 * time.Millisecond} {
				for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
					b.Run(fmt.Sprintf("rtt=%v/%s", rtt, op), func(b *testing.B) {
						r.setRTT(rtt)
						benchDistance(b, r, op)
					})
				}
			}
		})
	}
}

func benchDistance(b *testing.B, r *distanceRig, op agent.Op) {
	// One untimed pair: connections dialled, windows grown.
	if _, err := r.goxfer(op); err != nil {
		b.Fatal(err)
	}
	if _, err := r.rawTCP(op); err != nil {
		b.Fatal(err)
	}
	var gx, raw time.Duration
	i := 0
	for b.Loop() {
		first, second := r.goxfer, r.rawTCP
		if i%2 == 1 {
			first, second = second, first
		}
		d1, err := first(op)
		if err != nil {
			b.Fatal(err)
		}
		d2, err := second(op)
		if err != nil {
			b.Fatal(err)
		}
		if i%2 == 1 {
			d1, d2 = d2, d1
		}
		gx += d1
		raw += d2
		i++
	}
	gbs := func(d time.Duration) float64 { return float64(i) * float64(r.size) / d.Seconds() / 1e9 }
	b.ReportMetric(gbs(gx), "goxfer-GB/s")
	b.ReportMetric(gbs(raw), "raw-GB/s")
	b.ReportMetric(raw.Seconds()/gx.Seconds(), "ratio")
}

// TestDistance runs the benchmark's rig small, without timing: READ and
// WRITE with a round trip added move the right bytes, and every connection
// of the backend, data and control, goes through the proxy.
func TestDistance(t *testing.T) {
	const size, streams = 4<<20 + 4096, 4
	r := newDistanceRig(t, size, streams)
	r.setRTT(2 * time.Millisecond)

	_, err := r.goxfer(agent.OpRead)
	require.NoError(t, err)
	require.True(t, bytes.Equal(r.rbuf, r.local), "READ through the proxy delivered other bytes")
	st := r.gx.Stats()
	assert.Equal(t, streams+1, st.Accepted, "the backend's data streams and control connection all go through the advertised proxy")
	// The proxy counts a piece after its Write returns: the initiator can
	// have the last bytes (and finish) before the count is up to date.
	assert.Eventually(t, func() bool { return r.gx.Stats().Downstream >= size }, 10*time.Second, time.Millisecond,
		"the READ's bytes came through the proxy (%d counted)", r.gx.Stats().Downstream)

	for i := range r.local {
		r.local[i] = byte(i * 7)
	}
	_, err = r.goxfer(agent.OpWrite)
	require.NoError(t, err)
	r.wexp.Revoke() // the passive side reads what was written only after revoking
	require.True(t, bytes.Equal(r.wbuf, r.local), "WRITE through the proxy delivered other bytes")
	assert.Eventually(t, func() bool { return r.gx.Stats().Upstream >= size }, 10*time.Second, time.Millisecond,
		"the WRITE's bytes went through the proxy (%d counted)", r.gx.Stats().Upstream)

	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		_, err := r.rawTCP(op)
		require.NoError(t, err, "raw baseline %s", op)
	}
	assert.Equal(t, streams+1, r.gx.Stats().Accepted, "no connection dialled around the proxy or again")
	assert.Equal(t, streams, r.raw.Stats().Accepted)
}
