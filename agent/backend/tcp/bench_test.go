package tcp_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backendtest"
	"github.com/goxfer/goxfer/internal/testproc"
)

// The benchmarks compare the tcp backend with raw Go TCP measured in the same
// run: a stream over 1 and 4 connections (the ceiling of any TCP backend) and
// a 4 KiB ping-pong (the latency floor). Throughput runs cross-process: a
// re-executed child of the test binary exposes memory and serves the raw
// baselines.

const benchChildEnv = "GOXFER_TCP_BENCH_CHILD"

// childHello is what the benchmark child prints on its first line.
type childHello struct {
	backendtest.BenchTarget
	Raw  string // raw TCP stream server
	Ping string // raw TCP ping-pong server
}

const childSize = 256 << 20

// benchChild runs in the child process: it exposes a readable and a
// writable region of childSize bytes, serves the raw baselines, and exits
// when its standard input closes.
func benchChild() {
	die := func(err error) {
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
	}
	a, err := agent.New(agent.WithBackends(tcp.New()))
	die(err)
	tg, rbuf, err := backendtest.ExposeBenchTarget(a, childSize)
	die(err)
	raw, _ := net.Listen("tcp", "127.0.0.1:0")
	ping, _ := net.Listen("tcp", "127.0.0.1:0")
	go serveRaw(raw, rbuf)
	go servePing(ping)
	_ = json.NewEncoder(os.Stdout).Encode(childHello{BenchTarget: tg, Raw: raw.Addr().String(), Ping: ping.Addr().String()})
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = a.Close()
	os.Exit(0)
}

// serveRaw answers requests of 9 bytes (direction, length): 'r' sends length
// bytes, 'w' reads length bytes and answers one byte.
func serveRaw(ln net.Listener, buf []byte) {
	serveEach(ln, func(c net.Conn) {
		sink := make([]byte, len(buf))
		var req [9]byte
		for {
			if _, err := io.ReadFull(c, req[:]); err != nil {
				return
			}
			n := binary.LittleEndian.Uint64(req[1:])
			var err error
			if req[0] == 'r' {
				_, err = c.Write(buf[:n])
			} else if _, err = io.ReadFull(c, sink[:n]); err == nil {
				_, err = c.Write(req[:1])
			}
			if err != nil {
				return
			}
		}
	})
}

// servePing echoes 4 KiB messages.
func servePing(ln net.Listener) {
	serveEach(ln, func(c net.Conn) {
		buf := make([]byte, 4096)
		for {
			if _, err := io.ReadFull(c, buf); err != nil {
				return
			}
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	})
}

// serveEach hands each connection ln accepts to serve, on a goroutine of
// its own that closes it, until ln is closed.
func serveEach(ln net.Listener, serve func(c net.Conn)) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			serve(c)
		}()
	}
}

// benchTarget is one child for all cross-process benchmarks.
var benchTarget = testproc.Shared[childHello]{Env: benchChildEnv}

// BenchmarkTCP measures READ and WRITE through the tcp backend against a
// child process, one operation at a time, and next to each single-region
// shape of 1 MiB or more the raw TCP ceiling for the same bytes over 1 and
// 4 plain connections: every repetition measures both side by side, so
// ratios compare the same moment of a noisy machine. The KV shape compares
// with the 256 MiB single region just before it.
func BenchmarkTCP(b *testing.B) {
	ch := benchTarget.Hello(b)
	a, err := agent.New(agent.WithBackends(tcp.New()))
	require.NoError(b, err)
	defer a.Close()
	local := make([]byte, childSize)
	raws := map[int][]net.Conn{1: dialRawConns(b, ch.Raw, 1), 4: dialRawConns(b, ch.Raw, 4)}
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		for _, sh := range backendtest.BenchShapes {
			b.Run(fmt.Sprintf("%s/%s/goxfer", op, sh.Name), func(b *testing.B) {
				key, base := ch.Remote(op)
				b.SetBytes(int64(sh.Bytes()))
				b.ReportAllocs()
				backendtest.BenchPost(b, a, agent.Request{Op: op, Peer: ch.Info, Key: key, Segments: sh.Segments(local, base)})
			})
			if sh.Descs != 1 || sh.Len < 1<<20 {
				continue
			}
			for _, n := range []int{1, 4} {
				b.Run(fmt.Sprintf("%s/%s/raw-conns=%d", op, sh.Name, n), func(b *testing.B) {
					rawTransfer(b, raws[n], op, local[:sh.Len])
				})
			}
		}
	}
}

// dialRawConns dials n connections to the child's raw server at addr.
func dialRawConns(b testing.TB, addr string, n int) []net.Conn {
	cs := make([]net.Conn, n)
	for i := range cs {
		c, err := net.Dial("tcp", addr)
		require.NoError(b, err)
		b.Cleanup(func() { _ = c.Close() })
		cs[i] = c
	}
	return cs
}

// rawTransfer moves buf's bytes split evenly over plain connections to the
// child, in a loop (rawRound).
func rawTransfer(b *testing.B, cs []net.Conn, op agent.Op, buf []byte) {
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		if err := rawRound(cs, op, buf); err != nil {
			b.Error(err)
		}
	}
}

// rawRound moves buf's bytes split evenly over plain connections to a
// raw server (the child's, or one behind a proxy): READ asks it to send
// them, WRITE sends them and waits for a one-byte answer. It returns the
// errors of the connections that failed.
func rawRound(cs []net.Conn, op agent.Op, buf []byte) error {
	dir := byte('r')
	if op == agent.OpWrite {
		dir = 'w'
	}
	per := len(buf) / len(cs)
	errs := make([]error, len(cs))
	var wg sync.WaitGroup
	for i, c := range cs {
		wg.Go(func() {
			part := buf[i*per : (i+1)*per]
			var req [9]byte
			req[0] = dir
			binary.LittleEndian.PutUint64(req[1:], uint64(per))
			_, err := c.Write(req[:])
			if err == nil && dir == 'r' {
				_, err = io.ReadFull(c, part)
			} else if err == nil {
				if _, err = c.Write(part); err == nil {
					_, err = io.ReadFull(c, req[:1])
				}
			}
			errs[i] = err
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// BenchmarkLatency4KiB measures a 4 KiB READ including the passive side's
// completion event, in one process over loopback, against a raw 4 KiB
// ping-pong in the same process; p50 and p99 are reported in µs.
func BenchmarkLatency4KiB(b *testing.B) {
	b.Run("goxfer-read+notify", func(b *testing.B) {
		pa, aa := backendtest.Pair(b, tcp.New)
		src, dst := make([]byte, 4096), make([]byte, 4096)
		exp, err := pa.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
		require.NoError(b, err)
		segs := []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}
		req := agent.Request{Op: agent.OpRead, Peer: pa.Info(), Key: exp.Key(), Segments: segs, Notify: []byte{1}}
		lat := make([]time.Duration, 0, 1<<16)
		b.ReportAllocs()
		for b.Loop() {
			t0 := time.Now()
			x, err := aa.Post(context.Background(), req)
			if err != nil {
				b.Fatal(err)
			}
			<-x.Done()
			<-exp.Events()
			lat = append(lat, time.Since(t0))
			if x.Err() != nil {
				b.Fatal(x.Err())
			}
		}
		reportLatency(b, lat)
	})
	b.Run("raw-pingpong", func(b *testing.B) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(b, err)
		defer ln.Close()
		go servePing(ln)
		c, err := net.Dial("tcp", ln.Addr().String())
		require.NoError(b, err)
		defer c.Close()
		buf := make([]byte, 4096)
		lat := make([]time.Duration, 0, 1<<16)
		for b.Loop() {
			t0 := time.Now()
			if _, err := c.Write(buf); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(t0))
		}
		reportLatency(b, lat)
	})
}

func reportLatency(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
}
