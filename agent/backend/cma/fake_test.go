//go:build linux

package cma

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// fakeSocket is a cma control socket in the abstract namespace served by
// the test, published as a cma peer of this process under a fresh agent
// ID.
type fakeSocket struct {
	info  agent.Info
	nonce *[16]byte // what the probe reads: the handshake answer names it
}

// listenFake listens on a fresh fakeSocket and hands each connection it
// accepts to serve, with [backendtest.ServeConns].
func listenFake(t *testing.T, kind string, serve func(f *fakeSocket, c *net.UnixConn)) *fakeSocket {
	t.Helper()
	name := fmt.Sprintf("goxfer-cma-test/%s/%s", kind, uuid.New())
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@" + name, Net: "unix"})
	require.NoError(t, err)
	f := &fakeSocket{nonce: &[16]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}}
	ci := connInfo{host: hostIdentity(), pid: uint32(os.Getpid()), sock: name}
	f.info = agent.Info{ID: uuid.New(), Conns: []agent.ConnInfo{{Backend: Name, Data: ci.marshal()}}}
	backendtest.ServeConns(t, ln, func(c net.Conn) { serve(f, c.(*net.UnixConn)) })
	return f
}

// readHello reads a dialler's handshake.
func (f *fakeSocket) readHello(br *bufio.Reader) error {
	var hs [hsSize]byte
	_, err := io.ReadFull(br, hs[:])
	return err
}

// answer answers a handshake as an honest exposing side would, naming
// probe bytes this process can read.
func (f *fakeSocket) answer(c *net.UnixConn) error {
	var hs [hsSize]byte
	out := handshake{self: f.info.ID, pid: uint32(os.Getpid()), scope: noScope, nonce: *f.nonce}
	out.probe = uint64(uintptrOf(f.nonce))
	out.put(hs[:])
	_, err := c.Write(hs[:])
	return err
}

// newFakeExposer returns a fake socket that answers the handshake and then
// does what the test's serve says.
func newFakeExposer(t *testing.T, serve func(c *net.UnixConn, br *bufio.Reader)) *fakeSocket {
	t.Helper()
	return listenFake(t, "fake", func(f *fakeSocket, c *net.UnixConn) {
		br := bufio.NewReader(c)
		if f.readHello(br) != nil || f.answer(c) != nil {
			return
		}
		serve(c, br)
	})
}

// gatedExposer is a fake socket that holds every handshake answer until
// the test puts a token in gate, then answers and reads frames until the
// connection ends. It counts the connections accepted and still open.
type gatedExposer struct {
	*fakeSocket
	gate     chan struct{}
	accepted atomic.Int64
	open     atomic.Int64
}

func newGatedExposer(t *testing.T) *gatedExposer {
	t.Helper()
	g := &gatedExposer{gate: make(chan struct{}, 64)}
	g.fakeSocket = listenFake(t, "gated", func(f *fakeSocket, c *net.UnixConn) {
		g.accepted.Add(1)
		g.open.Add(1)
		defer g.open.Add(-1)
		br := bufio.NewReader(c)
		if f.readHello(br) != nil {
			return
		}
		<-g.gate
		if f.answer(c) != nil {
			return
		}
		_, _ = io.Copy(io.Discard, br)
	})
	// Before listenFake's cleanup, which waits for the connections' goroutines.
	t.Cleanup(func() { close(g.gate) })
	return g
}

// silentPeer is a fake socket that accepts and never answers.
type silentPeer struct {
	*fakeSocket
	accepts atomic.Int64
}

func newSilentPeer(t *testing.T) *silentPeer {
	t.Helper()
	s := &silentPeer{}
	s.fakeSocket = listenFake(t, "silent", func(*fakeSocket, *net.UnixConn) { s.accepts.Add(1) })
	return s
}

// readFrames reads the copying side's frames until the connection ends,
// calling on for each.
func readFrames(c *net.UnixConn, br *bufio.Reader, on func(f *frame)) {
	var hdr [hdrSize]byte
	var buf []byte
	var f frame
	for readFrame(br, hdr[:], &buf, limits{maxRanges: 4096, maxNotify: 64 << 10}, &f) == nil {
		on(&f)
	}
}
