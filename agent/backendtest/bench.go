package backendtest

import (
	"context"
	"testing"

	"github.com/goxfer/goxfer/agent"
)

// BenchShape is the layout of one benchmarked transfer: Descs adjacent
// descriptors of Len bytes each.
type BenchShape struct {
	Name       string
	Descs, Len int
}

// BenchShapes are what the backends' cross-process benchmarks move: one
// descriptor of 4 KiB to 256 MiB, and a KV cache's 4096 × 64 KiB (the
// 256 MiB of the shape before it).
var BenchShapes = []BenchShape{
	{"4KiB", 1, 4 << 10},
	{"1MiB", 1, 1 << 20},
	{"64MiB", 1, 64 << 20},
	{"256MiB", 1, 256 << 20},
	{"KV-4096x64KiB", 4096, 64 << 10},
}

// Bytes is how many bytes a transfer of the shape moves.
func (s BenchShape) Bytes() int { return s.Descs * s.Len }

// Segments cuts the first [BenchShape.Bytes] of local into the shape's
// descriptors, against the remote memory from address base on.
func (s BenchShape) Segments(local []byte, base uint64) []agent.Segment {
	segs := make([]agent.Segment, s.Descs)
	for i := range segs {
		off := i * s.Len
		segs[i] = agent.Segment{
			Local:  agent.DRAM(local[off : off+s.Len]),
			Remote: agent.Region{Addr: base + uint64(off), Len: uint64(s.Len)},
		}
	}
	return segs
}

// BenchTarget is what a peer needs to benchmark against an agent that
// exposes Size bytes for READs (at Addr, under ReadKey) and Size more for
// WRITEs. Benchmark children print it, as JSON, to their parent.
type BenchTarget struct {
	Info      agent.Info
	ReadKey   agent.Key
	WriteKey  agent.Key
	Addr      uint64 // the read exposure's address
	WriteAddr uint64
	Size      int
}

// ExposeBenchTarget allocates two buffers of size bytes, fills the first
// with byte(i) at offset i and exposes it on a for reading, exposes the
// second for writing, and returns the target and the first buffer. The
// exposures last as long as a.
func ExposeBenchTarget(a *agent.Agent, size int) (BenchTarget, []byte, error) {
	rbuf, wbuf := make([]byte, size), make([]byte, size)
	for i := range rbuf {
		rbuf[i] = byte(i)
	}
	rexp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(rbuf)})
	if err != nil {
		return BenchTarget{}, nil, err
	}
	wexp, err := a.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(wbuf)})
	if err != nil {
		return BenchTarget{}, nil, err
	}
	return BenchTarget{
		Info: a.Info(), ReadKey: rexp.Key(), WriteKey: wexp.Key(),
		Addr: agent.DRAM(rbuf).Addr, WriteAddr: agent.DRAM(wbuf).Addr, Size: size,
	}, rbuf, nil
}

// Remote returns the key and the address of the exposure op moves bytes
// from (READ) or to (WRITE).
func (tg BenchTarget) Remote(op agent.Op) (agent.Key, uint64) {
	if op == agent.OpWrite {
		return tg.WriteKey, tg.WriteAddr
	}
	return tg.ReadKey, tg.Addr
}

// BenchPost posts req from a once per [testing.B.Loop] iteration and waits
// for the transfer, failing b on any error.
func BenchPost(b *testing.B, a *agent.Agent, req agent.Request) {
	for b.Loop() {
		x, err := a.Post(context.Background(), req)
		if err != nil {
			b.Fatal(err)
		}
		<-x.Done()
		if err := x.Err(); err != nil {
			b.Fatal(err)
		}
	}
}
