//go:build linux

package cma_test

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backendtest"
	"github.com/goxfer/goxfer/internal/testproc"
)

// The benchmarks compare the cma backend, in the same run and the same
// repetition, with raw process_vm_readv/writev of the same bytes (one call,
// one thread: the ceiling the issue names) and with the tcp backend, both
// against one child process that exposes the memory over cma and tcp.

// benchHello is what the benchmark child prints on its first line.
type benchHello struct {
	backendtest.BenchTarget
	Pid int
}

const childSize = 256 << 20

// benchChild exposes childSize bytes for READs and as many for WRITEs on
// cma and tcp, and serves them until its standard input closes.
func benchChild() {
	a, err := agent.New(agent.WithBackends(cma.New(), tcp.New()))
	die(err)
	tg, _, err := backendtest.ExposeBenchTarget(a, childSize)
	die(err)
	die(json.NewEncoder(os.Stdout).Encode(benchHello{BenchTarget: tg, Pid: os.Getpid()}))
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = a.Close()
}

// benchTarget is one child for all cross-process benchmarks.
var benchTarget = testproc.Shared[benchHello]{Env: benchChildEnv}

// BenchmarkCMA measures READ and WRITE against a child process through the
// cma backend, through the tcp backend, and with one raw
// process_vm_readv/writev call, for each shape in turn (up to 1 MiB also
// through cma with a completion notification), so the ratios
// compare the same moment of a noisy machine. The KV shape compares with
// the 256 MiB single region just before it.
func BenchmarkCMA(b *testing.B) {
	ch := benchTarget.Hello(b)
	a, err := agent.New(agent.WithBackends(cma.New(), tcp.New()))
	require.NoError(b, err)
	defer a.Close()
	local := make([]byte, childSize)
	for i := range local { // fault the pages in, as a KV cache's are
		local[i] = byte(i)
	}
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		for _, sh := range backendtest.BenchShapes {
			key, base := ch.Remote(op)
			segs := sh.Segments(local, base)
			for _, backend := range []string{cma.Name, tcp.Name} {
				b.Run(fmt.Sprintf("%s/%s/%s", op, sh.Name, backend), func(b *testing.B) {
					b.SetBytes(int64(sh.Bytes()))
					b.ReportAllocs()
					backendtest.BenchPost(b, a, agent.Request{Op: op, Peer: ch.Info, Key: key, Segments: segs, Backend: backend})
				})
			}
			if sh.Descs == 1 && sh.Len <= 1<<20 {
				// With a completion notification, as connect's transfers
				// always carry: its sendmsg wakes the child's reader.
				b.Run(fmt.Sprintf("%s/%s/cma+notify", op, sh.Name), func(b *testing.B) {
					b.SetBytes(int64(sh.Bytes()))
					b.ReportAllocs()
					backendtest.BenchPost(b, a, agent.Request{Op: op, Peer: ch.Info, Key: key, Segments: segs, Backend: cma.Name, Notify: []byte("done")})
				})
			}
			if sh.Descs == 1 {
				b.Run(fmt.Sprintf("%s/%s/raw", op, sh.Name), func(b *testing.B) {
					rawCopy(b, ch.Pid, op, local[:sh.Len], base)
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
