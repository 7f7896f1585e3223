//go:build linux

package cma_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/tcp"
)

// The benchmarks compare the cma backend, in the same run and the same
// repetition, with raw process_vm_readv/writev of the same bytes (one call,
// one thread: the ceiling the issue names) and with the tcp backend, both
// against one child process that exposes the memory over cma and tcp.

// benchHello is what the benchmark child prints on its first line.
type benchHello struct {
	Info      agent.Info
	ReadKey   agent.Key
	WriteKey  agent.Key
	Addr      uint64 // the read exposure's address
	WriteAddr uint64
	Size      int
	Pid       int
}

const childSize = 256 << 20

func benchChild() {
	a, err := agent.New(agent.WithBackends(cma.New(), tcp.New()))
	die(err)
	rbuf, wbuf := make([]byte, childSize), make([]byte, childSize)
	for i := range rbuf {
		rbuf[i] = byte(i)
	}
	rexp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(rbuf)})
	die(err)
	wexp, err := a.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(wbuf)})
	die(err)
	die(json.NewEncoder(os.Stdout).Encode(benchHello{
		Info: a.Info(), ReadKey: rexp.Key(), WriteKey: wexp.Key(),
		Addr: agent.DRAM(rbuf).Addr, WriteAddr: agent.DRAM(wbuf).Addr, Size: childSize, Pid: os.Getpid(),
	}))
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = a.Close()
}

var (
	childOnce sync.Once
	theChild  *procChild
	theHello  benchHello
)

// sharedChild starts one child for all cross-process benchmarks.
func sharedChild(b *testing.B) benchHello {
	childOnce.Do(func() { theChild = startProcChild(b, benchChildEnv, "", nil, &theHello) })
	require.NotNil(b, theChild, "benchmark child failed to start")
	return theHello
}

func stopSharedChild() {
	if theChild != nil {
		_ = theChild.stop()
	}
}

var shapes = []struct {
	name       string
	descs, len int
}{
	{"4KiB", 1, 4 << 10},
	{"1MiB", 1, 1 << 20},
	{"64MiB", 1, 64 << 20},
	{"256MiB", 1, 256 << 20},
	{"KV-4096x64KiB", 4096, 64 << 10},
}

// BenchmarkCMA measures READ and WRITE against a child process through the
// cma backend, through the tcp backend, and with one raw
// process_vm_readv/writev call, for each shape in turn, so the ratios
// compare the same moment of a noisy machine. The KV shape compares with
// the 256 MiB single region just before it.
func BenchmarkCMA(b *testing.B) {
	ch := sharedChild(b)
	a, err := agent.New(agent.WithBackends(cma.New(), tcp.New()))
	require.NoError(b, err)
	defer a.Close()
	local := make([]byte, childSize)
	for i := range local { // fault the pages in, as a KV cache's are
		local[i] = byte(i)
	}
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		for _, sh := range shapes {
			key, base := ch.ReadKey, ch.Addr
			if op == agent.OpWrite {
				key, base = ch.WriteKey, ch.WriteAddr
			}
			segs := make([]agent.Segment, sh.descs)
			for i := range segs {
				off := i * sh.len
				segs[i] = agent.Segment{
					Local:  agent.DRAM(local[off : off+sh.len]),
					Remote: agent.Region{Addr: base + uint64(off), Len: uint64(sh.len)},
				}
			}
			for _, backend := range []string{cma.Name, tcp.Name} {
				b.Run(fmt.Sprintf("%s/%s/%s", op, sh.name, backend), func(b *testing.B) {
					b.SetBytes(int64(sh.descs * sh.len))
					b.ReportAllocs()
					for b.Loop() {
						x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: ch.Info, Key: key, Segments: segs, Backend: backend})
						if err != nil {
							b.Fatal(err)
						}
						<-x.Done()
						if err := x.Err(); err != nil {
							b.Fatal(err)
						}
					}
				})
			}
			if sh.descs == 1 {
				b.Run(fmt.Sprintf("%s/%s/raw", op, sh.name), func(b *testing.B) {
					rawCopy(b, ch.Pid, op, local[:sh.len], base)
				})
			}
		}
	}
}

// rawCopy moves buf to or from the child's memory at addr with one
// process_vm_readv/writev call per operation.
func rawCopy(b *testing.B, pid int, op agent.Op, buf []byte, addr uint64) {
	b.SetBytes(int64(len(buf)))
	l := []unix.Iovec{{Base: &buf[0]}}
	l[0].SetLen(len(buf))
	r := []unix.RemoteIovec{{Base: uintptr(addr), Len: len(buf)}}
	for b.Loop() {
		var n int
		var err error
		if op == agent.OpRead {
			n, err = unix.ProcessVMReadv(pid, l, r, 0)
		} else {
			n, err = unix.ProcessVMWritev(pid, l, r, 0)
		}
		if err != nil || n != len(buf) {
			b.Fatalf("copied %d of %d bytes: %v", n, len(buf), err)
		}
	}
}
