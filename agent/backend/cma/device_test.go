//go:build linux

package cma

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
	"github.com/goxfer/goxfer/agent/devmem"
)

// devAgent starts an agent on a cma backend with opts whose device memory
// is drv; pool, if not 0, is its staging pool (256 KiB chunks). The
// same-host device path is off (WithDeviceIPC(false)): these tests are
// about staging; ipcAgent's have it on.
func devAgent(t testing.TB, drv devmem.Driver, pool int, opts ...Option) (*agent.Agent, *Backend) {
	t.Helper()
	return ipcAgent(t, drv, pool, append([]Option{WithDeviceIPC(false)}, opts...)...)
}

// ipcAgent is devAgent with the device path as opts leave it: on by
// default.
func ipcAgent(t testing.TB, drv devmem.Driver, pool int, opts ...Option) (*agent.Agent, *Backend) {
	t.Helper()
	b := New(opts...)
	aopts := []agent.Option{agent.WithBackends(b), agent.WithDevice(drv)}
	if pool > 0 {
		aopts = append(aopts, agent.WithStaging(256<<10, pool))
	}
	a, err := agent.New(aopts...)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, a.Close()) })
	return a, b
}

// guardLen is how many guard bytes surround each test buffer.
const guardLen = 512

// gbuf is a test buffer of n bytes between two guards, in simulated
// device memory (GPU 1) or in host memory.
type gbuf struct {
	sim  *devmem.Sim
	vram bool
	base uintptr // the first guard
	host []byte  // guards included, for host memory
	n    int
}

func newGBuf(t testing.TB, sim *devmem.Sim, vram bool, n int, fill []byte) gbuf {
	t.Helper()
	all := bytes.Repeat([]byte{0xEE}, n+2*guardLen)
	copy(all[guardLen:], fill)
	g := gbuf{sim: sim, vram: vram, n: n}
	if !vram {
		g.host = all
		return g
	}
	p, err := sim.Alloc(1, len(all))
	require.NoError(t, err)
	t.Cleanup(func() { _ = sim.Free(p) })
	require.NoError(t, devmem.CopyToDevice(sim, 1, p, all))
	g.base = p
	return g
}

// local describes the n bytes between the guards.
func (g gbuf) local() agent.Local {
	if !g.vram {
		return agent.DRAM(g.host[guardLen : guardLen+g.n])
	}
	return agent.Device(g.base+guardLen, g.n, agent.KindVRAM, 1)
}

// all returns the buffer's bytes, guards included.
func (g gbuf) all(t testing.TB) []byte {
	t.Helper()
	if !g.vram {
		return bytes.Clone(g.host)
	}
	out := make([]byte, g.n+2*guardLen)
	require.NoError(t, devmem.CopyToHost(g.sim, 1, out, g.base))
	return out
}

// check checks that the buffer holds want between intact guards.
func (g gbuf) check(t testing.TB, want []byte, what string) {
	t.Helper()
	all := g.all(t)
	guard := bytes.Repeat([]byte{0xEE}, guardLen)
	require.Equal(t, guard, all[:guardLen], "%s: guard before the buffer", what)
	require.Equal(t, guard, all[guardLen+g.n:], "%s: guard after the buffer", what)
	if !bytes.Equal(want, all[guardLen:guardLen+g.n]) {
		i := 0
		for i < len(want) && want[i] == all[guardLen+i] {
			i++
		}
		t.Fatalf("%s: the %d bytes differ from byte %d", what, g.n, i)
	}
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return b
}

// event waits for the exposure's next event.
func event(t testing.TB, e *agent.Exposure) agent.Event {
	t.Helper()
	select {
	case ev := <-e.Events():
		return ev
	case <-time.After(20 * time.Second):
		t.Fatal("no event on the exposure within 20s")
		return agent.Event{}
	}
}

// READ and WRITE with GPU memory on either side or both, one window or
// several: every byte arrives, the guards around both buffers stay intact,
// the path says the bytes were staged, and the notification is delivered
// only once the bytes are in place (a WRITE into the peer's GPU memory
// reached the device before it) and the peer's staging buffers are back.
func TestDeviceReadWrite(t *testing.T) {
	sim := devmem.NewSim(2)
	act, _ := devAgent(t, sim, 0)
	pas, _ := devAgent(t, sim, 0)
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		for _, kinds := range []struct{ local, remote bool }{{false, true}, {true, true}, {true, false}} {
			for _, n := range []int{1, 4096 + 3, 3<<20 + 17, 13<<20 + 5} {
				name := fmt.Sprintf("%v/local=%s/remote=%s/%d", op, kindName(kinds.local), kindName(kinds.remote), n)
				t.Run(name, func(t *testing.T) {
					src := randomBytes(n)
					var lfill, rfill []byte
					if op == agent.OpWrite {
						lfill = src
					} else {
						rfill = src
					}
					loc := newGBuf(t, sim, kinds.local, n, lfill)
					rem := newGBuf(t, sim, kinds.remote, n, rfill)
					exp, err := pas.Expose(op.Access(), []agent.Local{rem.local()})
					require.NoError(t, err)
					defer exp.Revoke()
					x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(), Notify: []byte("done"),
						Segments: []agent.Segment{{Local: loc.local(), Remote: rem.local().Region}}})
					require.NoError(t, err)
					backendtest.DoneWithin(t, x, 30*time.Second, name)
					require.NoError(t, x.Err())
					assert.Equal(t, Name, x.Backend())
					assert.Equal(t, Name+"+staging", x.Path())
					// Once the transfer is done, the bytes are in place: a
					// WRITE's in the peer's device too.
					loc.check(t, src, "the local buffer")
					rem.check(t, src, "the peer's buffer")
					ev := event(t, exp)
					require.Equal(t, agent.EventNotify, ev.Kind)
					require.NoError(t, ev.Err)
					// At the notification the leases that staged them are
					// released.
					assert.Zero(t, pas.Stats().StagingBuffers, "the peer's staging buffers in use at the notification")
					assert.Zero(t, act.Stats().StagingBuffers, "staging buffers in use after the transfer")
				})
			}
		}
	}
}

func kindName(vram bool) string {
	if vram {
		return "vram"
	}
	return "dram"
}

// Thousands of small segments scattered over the peer's GPU memory, more
// than one lease's ranges and one system call's pieces: each lands where
// it should, and the gaps between them, in device memory, stay untouched.
func TestDeviceManySmallSegments(t *testing.T) {
	sim := devmem.NewSim(2)
	act, _ := devAgent(t, sim, 0, WithChunkSize(4<<10))
	pas, _ := devAgent(t, sim, 0)
	const segs, stride = 5000, 800
	n := segs * stride
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		t.Run(op.String(), func(t *testing.T) {
			remote0 := randomBytes(n)
			rem := newGBuf(t, sim, true, n, remote0)
			local := randomBytes(n)
			local0 := bytes.Clone(local)
			exp, err := pas.Expose(op.Access(), []agent.Local{rem.local()})
			require.NoError(t, err)
			defer exp.Revoke()
			var ss []agent.Segment
			wantRemote, wantLocal := bytes.Clone(remote0), bytes.Clone(local0)
			ra := rem.local().Addr
			for i := range segs {
				off, l := i*stride+rand.IntN(100), 1+rand.IntN(700)
				ss = append(ss, agent.Segment{Local: agent.DRAM(local[off : off+l]), Remote: agent.Region{Addr: ra + uint64(off), Len: uint64(l), Kind: agent.KindVRAM, Device: 1}})
				if op == agent.OpRead {
					copy(wantLocal[off:off+l], remote0[off:off+l])
				} else {
					copy(wantRemote[off:off+l], local0[off:off+l])
				}
			}
			x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(), Segments: ss})
			require.NoError(t, err)
			backendtest.DoneWithin(t, x, 30*time.Second, "many small segments")
			require.NoError(t, x.Err())
			assert.Equal(t, Name+"+staging", x.Path())
			require.True(t, bytes.Equal(wantLocal, local), "local bytes")
			rem.check(t, wantRemote, "the peer's GPU memory")
		})
	}
}

// Several transfers at once on one connection, against a peer whose
// staging pool holds a single lease's buffers at a time: lease requests
// that wait for buffers wait off the connection's reader, so the ends that
// free them still arrive, and every transfer completes.
func TestDeviceConcurrentSmallPool(t *testing.T) {
	backendtest.Watchdog(t, 2*time.Minute)
	sim := devmem.NewSim(2)
	act, _ := devAgent(t, sim, 0)
	pas, _ := devAgent(t, sim, 8<<20) // 4 MiB for peers' leases
	const n, each = 3<<20 + 1, 6
	src := randomBytes(n)
	rem := newGBuf(t, sim, true, n, src)
	rexp, err := pas.Expose(agent.AccessRead, []agent.Local{rem.local()})
	require.NoError(t, err)
	defer rexp.Revoke()
	dst := newGBuf(t, sim, true, n, nil)
	wexp, err := pas.Expose(agent.AccessWrite, []agent.Local{dst.local()})
	require.NoError(t, err)
	defer wexp.Revoke()

	var xs []*agent.Xfer
	reads := make([][]byte, each)
	for i := range each {
		reads[i] = make([]byte, n)
		x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: rexp.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(reads[i]), Remote: rem.local().Region}}})
		require.NoError(t, err)
		xs = append(xs, x)
		x, err = act.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: pas.Info(), Key: wexp.Key(),
			Segments: []agent.Segment{{Local: agent.DRAM(src), Remote: dst.local().Region}}})
		require.NoError(t, err)
		xs = append(xs, x)
	}
	// And one of several windows, more than the pool holds at once.
	big := newGBuf(t, sim, true, 20<<20, nil)
	bexp, err := pas.Expose(agent.AccessWrite, []agent.Local{big.local()})
	require.NoError(t, err)
	defer bexp.Revoke()
	bsrc := randomBytes(20 << 20)
	x, err := act.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: pas.Info(), Key: bexp.Key(),
		Segments: []agent.Segment{{Local: agent.DRAM(bsrc), Remote: big.local().Region}}})
	require.NoError(t, err)
	xs = append(xs, x)
	failed, first := waitAll(t, xs, time.Minute, "a transfer against a small staging pool")
	require.Zero(t, failed, "first failure: %v", first)
	for i := range reads {
		require.True(t, bytes.Equal(src, reads[i]), "READ %d", i)
	}
	dst.check(t, src, "WRITE")
	big.check(t, bsrc, "the large WRITE")
}

// An exposure of GPU memory revoked while a transfer's staged leases are
// held: Revoke returns once they ended, with every staging buffer back,
// and no byte of a WRITE lands in the device afterwards; the transfer ends
// either way, refused or complete.
func TestDeviceRevokeDuringStagedLease(t *testing.T) {
	backendtest.Watchdog(t, 2*time.Minute)
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		t.Run(op.String(), func(t *testing.T) {
			sim := devmem.NewSim(2)
			sim.SetRate(1 << 30) // 64 MiB of device copies take 60 ms or so
			act, _ := devAgent(t, sim, 0)
			pas, _ := devAgent(t, sim, 0)
			const n = 64 << 20
			src := randomBytes(n)
			var rfill []byte
			if op == agent.OpRead {
				rfill = src
			}
			rem := newGBuf(t, sim, true, n, rfill)
			local := make([]byte, n)
			if op == agent.OpWrite {
				copy(local, src)
			}
			for round := range 3 {
				exp, err := pas.Expose(op.Access(), []agent.Local{rem.local()})
				require.NoError(t, err)
				x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(),
					Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: rem.local().Region}}})
				require.NoError(t, err)
				// Until the peer stages (a lease is held), then a little later
				// each round.
				deadline := time.Now().Add(10 * time.Second)
				for pas.Stats().StagingBuffers == 0 && !backendtest.Finished(x) && time.Now().Before(deadline) {
					time.Sleep(100 * time.Microsecond)
				}
				time.Sleep(time.Duration(round) * 5 * time.Millisecond)
				exp.Revoke()
				assert.Zero(t, pas.Stats().StagingBuffers, "round %d: staging buffers in use once Revoke returned", round)
				after := rem.all(t)
				backendtest.DoneWithin(t, x, 30*time.Second, "a transfer whose exposure was revoked")
				if err := x.Err(); err != nil {
					require.ErrorIs(t, err, agent.ErrAccessDenied, "round %d", round)
				}
				require.True(t, bytes.Equal(after, rem.all(t)), "round %d: the device changed after Revoke returned", round)
				assert.Zero(t, pas.Stats().StagingBuffers, "round %d", round)
			}
		})
	}
}

// failingToDevice is the simulator, whose copies into device memory fail.
type failingToDevice struct{ *devmem.Sim }

func (d failingToDevice) NewStream(dev int) (devmem.Stream, error) {
	s, err := d.Sim.NewStream(dev)
	return failingStream{s}, err
}

type failingStream struct{ devmem.Stream }

func (failingStream) ToDevice(uintptr, []byte) error { return errors.New("injected H2D failure") }

// A WRITE into the peer's GPU memory that its agent cannot copy from the
// staging buffers into the device: the WRITE fails, saying so, the
// notification it carried is not sent, and the exposure's next
// notification carries the failure.
func TestDeviceWriteFlushFailure(t *testing.T) {
	sim := devmem.NewSim(2)
	act, _ := devAgent(t, sim, 0)
	pas, _ := devAgent(t, failingToDevice{sim}, 0)
	for _, n := range []int{4096, 9 << 20} { // one lease, several
		rem := newGBuf(t, sim, true, n, nil)
		exp, err := pas.Expose(agent.AccessWrite, []agent.Local{rem.local()})
		require.NoError(t, err)
		x, err := act.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: pas.Info(), Key: exp.Key(), Notify: []byte("done"),
			Segments: []agent.Segment{{Local: agent.DRAM(randomBytes(n)), Remote: rem.local().Region}}})
		require.NoError(t, err)
		backendtest.DoneWithin(t, x, 30*time.Second, "a WRITE whose staging fails")
		require.ErrorIs(t, x.Err(), agent.ErrStaging, "%d bytes", n)
		require.ErrorContains(t, x.Err(), "injected H2D failure")
		require.NoError(t, act.Notify(context.Background(), pas.Info(), exp.Key(), []byte("after")))
		ev := event(t, exp)
		require.Equal(t, agent.EventNotify, ev.Kind)
		require.Equal(t, "after", string(ev.Msg), "the failed WRITE's own notification is not sent")
		require.ErrorIs(t, ev.Err, agent.ErrStaging, "%d bytes", n)
		require.ErrorContains(t, ev.Err, "injected H2D failure")
		exp.Revoke()
		assert.Zero(t, pas.Stats().StagingBuffers)
	}
}

// stagedHello handshakes as this process, expecting agent to, announcing
// that it takes staged grants.
func (p *rawPeer) stagedHello(to *agent.Agent) (handshake, error) {
	return p.shake(handshake{self: p.id, expect: to.ID(), pid: uint32(os.Getpid()), caps: capStaged})
}

// grantTable reads the answer to a lease request, staged addresses
// included.
func (p *rawPeer) grantTable() (header, []uint64, string, error) {
	var hb [hdrSize]byte
	var h header
	_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(p.br, hb[:]); err != nil {
		return h, nil, "", err
	}
	h.get(hb[:])
	tb := make([]byte, int(h.count)*addrSize)
	if _, err := io.ReadFull(p.br, tb); err != nil {
		return h, nil, "", err
	}
	var addrs []uint64
	for i := range int(h.count) {
		addrs = append(addrs, binary.LittleEndian.Uint64(tb[i*addrSize:]))
	}
	msg := make([]byte, h.length)
	_, err := io.ReadFull(p.br, msg)
	return h, addrs, string(msg), err
}

// vmRead reads n bytes at addr of this process as cma's copier does.
func vmRead(t testing.TB, addr uint64, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	l := []unix.Iovec{{Base: &b[0]}}
	l[0].SetLen(n)
	_, err := unix.ProcessVMReadv(os.Getpid(), l, []unix.RemoteIovec{{Base: uintptr(addr), Len: n}}, 0)
	require.NoError(t, err)
	return b
}

// vmWrite writes b at addr of this process as cma's copier does.
func vmWrite(t testing.TB, addr uint64, b []byte) {
	t.Helper()
	l := []unix.Iovec{{Base: &b[0]}}
	l[0].SetLen(len(b))
	_, err := unix.ProcessVMWritev(os.Getpid(), l, []unix.RemoteIovec{{Base: uintptr(addr), Len: len(b)}}, 0)
	require.NoError(t, err)
}

// The protocol by hand: a grant over GPU memory names, per range, where to
// copy (a staging buffer for device memory, the range itself for host
// memory), filled for a READ; a WRITE's buffers reach the device at the
// lease's end, before a notification that follows it is delivered. A
// dialler that does not announce staged grants is refused device memory,
// and told why.
func TestDeviceStagedGrantByHand(t *testing.T) {
	sim := devmem.NewSim(2)
	a, b := devAgent(t, sim, 0)
	const n = 10000
	src := randomBytes(n)
	dev := newGBuf(t, sim, true, n, src)
	host := randomBytes(n)
	rexp, err := a.Expose(agent.AccessRead, []agent.Local{dev.local(), agent.DRAM(host)})
	require.NoError(t, err)
	defer rexp.Revoke()
	da, ha := dev.local().Addr, agent.DRAM(host).Addr

	p := dialRaw(t, b)
	in, err := p.stagedHello(a)
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), in.status)
	require.Equal(t, uint16(capStaged), in.caps, "the exposing side takes up staged grants")
	p.send(header{typ: tBegin, status: uint8(agent.AccessRead), count: 3, id: 1, key: rexp.Key()},
		[][2]uint64{{ha + 5, 100}, {da + 100, 5000}, {da, 1}}, nil)
	h, addrs, msg, err := p.grantTable()
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), h.status, msg)
	require.Len(t, addrs, 3)
	assert.Equal(t, ha+5, addrs[0], "host memory is copied in place")
	assert.NotEqual(t, da+100, addrs[1], "device memory is staged")
	assert.Equal(t, host[5:105], vmRead(t, addrs[0], 100))
	assert.Equal(t, src[100:5100], vmRead(t, addrs[1], 5000))
	assert.Equal(t, src[:1], vmRead(t, addrs[2], 1))
	assert.NotZero(t, a.Stats().StagingBuffers, "the lease holds its buffers until it ends")
	p.send(header{typ: tEnd, id: 1}, nil, nil)

	// WRITE, then a notification right behind the end.
	wdev := newGBuf(t, sim, true, n, nil)
	wexp, err := a.Expose(agent.AccessWrite, []agent.Local{wdev.local()})
	require.NoError(t, err)
	defer wexp.Revoke()
	p.send(header{typ: tBegin, status: uint8(agent.AccessWrite), count: 1, id: 2, key: wexp.Key()}, [][2]uint64{{wdev.local().Addr, n}}, nil)
	h, addrs, msg, err = p.grantTable()
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), h.status, msg)
	require.Len(t, addrs, 1)
	vmWrite(t, addrs[0], src)
	wdev.check(t, bytes.Repeat([]byte{0xEE}, n), "the device before the lease's end")
	p.send(header{typ: tEnd, status: endWritten | endAck, id: 2}, nil, nil)
	h, addrs, msg, err = p.grantTable()
	require.NoError(t, err)
	require.Equal(t, header{typ: tFlushed, status: stOK, id: 2}, h, msg)
	require.Empty(t, addrs)
	wdev.check(t, src, "the device once the flush was answered")
	p.send(header{typ: tNotify, length: 4, key: wexp.Key()}, nil, []byte("done"))
	ev := event(t, wexp)
	require.Equal(t, agent.EventNotify, ev.Kind)
	require.NoError(t, ev.Err)
	wdev.check(t, src, "the device at the notification")
	assert.Zero(t, a.Stats().StagingBuffers)

	// A dialler that did not announce staged grants.
	q := dialRaw(t, b)
	in, err = q.hello(a.ID(), os.Getpid())
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), in.status)
	require.Zero(t, in.caps, "no capabilities to a dialler that announced none")
	q.send(header{typ: tBegin, status: uint8(agent.AccessRead), count: 1, id: 1, key: rexp.Key()}, [][2]uint64{{da, 16}}, nil)
	h, addrs, msg, err = q.grantTable()
	require.NoError(t, err)
	require.Equal(t, uint8(stDenied), h.status)
	require.Empty(t, addrs)
	assert.Contains(t, msg, "predates staged grants")
	// Host memory of the same exposure is still served, in place.
	q.send(header{typ: tBegin, status: uint8(agent.AccessRead), count: 1, id: 2, key: rexp.Key()}, [][2]uint64{{ha, 16}}, nil)
	h, addrs, msg, err = q.grantTable()
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), h.status, msg)
	require.Empty(t, addrs)
	q.send(header{typ: tEnd, id: 2}, nil, nil)
}

// A peer that ends a lease request of GPU memory before its grant (a
// transfer that gave up): the request is answered all the same, the lease
// released, and the requests behind it served.
func TestDeviceEndBeforeGrant(t *testing.T) {
	sim := devmem.NewSim(2)
	a, b := devAgent(t, sim, 0)
	const n = 1 << 20
	src := randomBytes(n)
	dev := newGBuf(t, sim, true, n, src)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{dev.local()})
	require.NoError(t, err)
	defer exp.Revoke()
	p := dialRaw(t, b)
	_, err = p.stagedHello(a)
	require.NoError(t, err)
	for id := uint64(1); id <= 20; id++ {
		p.send(header{typ: tBegin, status: uint8(agent.AccessRead), count: 1, id: id, key: exp.Key()}, [][2]uint64{{dev.local().Addr, n}}, nil)
		if id%2 == 1 {
			p.send(header{typ: tEnd, id: id}, nil, nil)
		}
	}
	got := map[uint64]bool{}
	for range 20 {
		h, addrs, msg, err := p.grantTable()
		require.NoError(t, err)
		require.False(t, got[h.id], "lease %d answered twice", h.id)
		got[h.id] = true
		if h.id%2 == 0 {
			require.Equal(t, uint8(stOK), h.status, msg)
			require.Len(t, addrs, 1)
			require.Equal(t, src, vmRead(t, addrs[0], n))
			p.send(header{typ: tEnd, id: h.id}, nil, nil)
		}
	}
	p.send(header{typ: tBye}, nil, nil)
	exp.Revoke()
	assert.Zero(t, a.Stats().StagingBuffers)
}

// A peer that takes a staged lease and never ends it cannot hold up
// Revoke for long: as for host memory, about twice the timeout; the
// staging buffers come back.
func TestDeviceRevokeBoundedAgainstSilentStagedLease(t *testing.T) {
	const timeout = 300 * time.Millisecond
	sim := devmem.NewSim(2)
	a, b := devAgent(t, sim, 0, WithTimeout(timeout))
	dev := newGBuf(t, sim, true, 1<<20, nil)
	exp, err := a.Expose(agent.AccessWrite, []agent.Local{dev.local()})
	require.NoError(t, err)
	p := dialRaw(t, b)
	_, err = p.stagedHello(a)
	require.NoError(t, err)
	p.send(header{typ: tBegin, status: uint8(agent.AccessWrite), count: 1, id: 1, key: exp.Key()}, [][2]uint64{{dev.local().Addr, 1 << 20}}, nil)
	h, _, msg, err := p.grantTable()
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), h.status, msg)
	require.NotZero(t, a.Stats().StagingBuffers)
	start := time.Now()
	done := make(chan struct{})
	go func() { exp.Revoke(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * timeout):
		t.Fatalf("Revoke still waits after %v on a staged lease whose holder never ends it", 20*timeout)
	}
	took := time.Since(start)
	assert.GreaterOrEqual(t, took, timeout, "released before the holder could have been given WithTimeout")
	assert.Zero(t, a.Stats().StagingBuffers)
}

// A peer that predates staged grants (its handshake answer names none):
// a transfer that needs its GPU memory fails at once, saying why.
func TestDeviceOldPeer(t *testing.T) {
	f := newFakeExposer(t, func(c *net.UnixConn, br *bufio.Reader) { _, _ = io.Copy(io.Discard, br) })
	sim := devmem.NewSim(2)
	a, _ := devAgent(t, sim, 0)
	buf := make([]byte, 4096)
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: f.info, Key: agent.NewKey(),
		Segments: []agent.Segment{{Local: agent.DRAM(buf), Remote: agent.Region{Addr: 0x10000, Len: 4096, Kind: agent.KindVRAM}}}})
	require.ErrorIs(t, err, agent.ErrAccessDenied)
	require.ErrorContains(t, err, "predates staged grants")
	require.Nil(t, x)
}

// A hostile exposing side's staged grants: a table that does not match the
// request, or an address whose range wraps or starts at 0, drops the
// connection as a protocol violation and fails the transfer; a matching
// table is honoured (the copier copies where the grant says).
func TestDeviceHostileGrantTable(t *testing.T) {
	staged := randomBytes(4096)
	orig := make([]byte, 4096)
	for _, tc := range []struct {
		name  string
		table func(addr uint64, count uint32) (uint32, []uint64)
		ok    bool
	}{
		{"Honoured", func(_ uint64, c uint32) (uint32, []uint64) {
			return c, []uint64{uint64(uintptrOf(&staged[0])), uint64(uintptrOf(&staged[1000]))}
		}, true},
		{"Short", func(a uint64, c uint32) (uint32, []uint64) { return c - 1, []uint64{a} }, false},
		{"Long", func(a uint64, c uint32) (uint32, []uint64) { return c + 1, []uint64{a, a, a} }, false},
		{"Wraps", func(a uint64, c uint32) (uint32, []uint64) { return c, []uint64{a, ^uint64(0) - 10} }, false},
		{"Zero", func(a uint64, c uint32) (uint32, []uint64) { return c, []uint64{0, a} }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeExposer(t, func(c *net.UnixConn, br *bufio.Reader) {
				readFrames(c, br, func(fr *frame) {
					if fr.typ != tBegin {
						return
					}
					addr, _ := fr.rangeAt(0)
					count, addrs := tc.table(addr, fr.count)
					b := make([]byte, hdrSize)
					(&header{typ: tGrant, status: stOK, count: count, id: fr.id}).put(b)
					for _, a := range addrs {
						b = binary.LittleEndian.AppendUint64(b, a)
					}
					_, _ = c.Write(b)
				})
			})
			a, b := newAgent(t)
			dst := make([]byte, 2000)
			base := uint64(uintptrOf(&orig[0]))
			x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: f.info, Key: agent.NewKey(),
				Segments: []agent.Segment{
					{Local: agent.DRAM(dst[:1000]), Remote: agent.Region{Addr: base, Len: 1000}},
					{Local: agent.DRAM(dst[1000:]), Remote: agent.Region{Addr: base + 2000, Len: 1000}},
				}})
			require.NoError(t, err)
			backendtest.DoneWithin(t, x, 10*time.Second, "a READ under a hostile grant")
			if tc.ok {
				require.NoError(t, x.Err())
				require.Equal(t, staged[:1000], dst[:1000])
				require.Equal(t, staged[1000:2000], dst[1000:])
				return
			}
			require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
			require.Equal(t, make([]byte, 2000), dst, "nothing copied")
			require.Eventually(t, func() bool { return b.Stats().ProtocolErrors > 0 }, 5*time.Second, time.Millisecond)
		})
	}
}

// stagedAddrs on every table length and address a grant may carry.
func TestStagedAddrs(t *testing.T) {
	lens := func(ls ...uint64) func(func(uint64) bool) {
		return func(yield func(uint64) bool) {
			for _, l := range ls {
				if !yield(l) {
					return
				}
			}
		}
	}
	table := func(as ...uint64) *frame {
		f := &frame{header: header{typ: tGrant, count: uint32(len(as)), id: 7}}
		for _, a := range as {
			f.table = binary.LittleEndian.AppendUint64(f.table, a)
		}
		return f
	}
	got, err := stagedAddrs(table(), 2, lens(1, 2))
	require.NoError(t, err)
	require.Nil(t, got, "no table: in place")
	got, err = stagedAddrs(table(0x1000, 0x2000), 2, lens(16, 16))
	require.NoError(t, err)
	require.Equal(t, []uint64{0x1000, 0x2000}, got)
	for _, tc := range []struct {
		f      *frame
		ranges int
		lens   []uint64
	}{
		{table(0x1000), 2, []uint64{1, 1}},
		{table(0x1000, 0x2000, 0x3000), 2, []uint64{1, 1}},
		{table(0x1000, 0), 2, []uint64{1, 1}},
		{table(0x1000, ^uint64(0)), 2, []uint64{1, 2}},
		{table(0x1000, 0x2000), 2, []uint64{1}},       // fewer ranges than the window says
		{table(0x1000, 0x2000), 2, []uint64{1, 1, 1}}, // more
	} {
		_, err := stagedAddrs(tc.f, tc.ranges, lens(tc.lens...))
		require.ErrorIs(t, err, errProtocol, "%+v", tc)
	}
}

// Transfers of several windows each over one connection at once, from
// the peer's GPU memory, with chunks small enough for several workers to
// copy each window: for the race detector.
func TestDeviceRaceManyTransfers(t *testing.T) {
	sim := devmem.NewSim(2)
	act, _ := devAgent(t, sim, 0, WithChunkSize(64<<10))
	pas, _ := devAgent(t, sim, 0)
	const n = 9<<20 + 3
	src := randomBytes(n)
	rem := newGBuf(t, sim, true, n, src)
	exp, err := pas.Expose(agent.AccessRead, []agent.Local{rem.local()})
	require.NoError(t, err)
	defer exp.Revoke()
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dst := make([]byte, n)
			x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(),
				Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: rem.local().Region}}})
			if !assert.NoError(t, err) {
				return
			}
			<-x.Done()
			if assert.NoError(t, x.Err()) {
				assert.True(t, bytes.Equal(src, dst))
			}
		}()
	}
	wg.Wait()
}

// A peer that asks for staged leases and never reads the grants: the
// stager's write times out, and the connection is dropped (counted as a
// timeout) with every lease released, as when the reader's own write
// times out.
func TestDeviceGrantsNeverRead(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	const timeout = 300 * time.Millisecond
	sim := devmem.NewSim(2)
	a, b := devAgent(t, sim, 0, WithTimeout(timeout))
	dev := newGBuf(t, sim, true, 4096, nil)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{dev.local()})
	require.NoError(t, err)
	p := dialRaw(t, b)
	_, err = p.stagedHello(a)
	require.NoError(t, err)
	table := make([][2]uint64, 4096) // a grant of 32 KiB
	for i := range table {
		table[i] = [2]uint64{dev.local().Addr + uint64(i), 1}
	}
	for id := uint64(1); id <= 64; id++ {
		p.send(header{typ: tBegin, status: uint8(agent.AccessRead), count: uint32(len(table)), id: id, key: exp.Key()}, table, nil)
	}
	require.Eventually(t, func() bool { return b.Stats().Timeouts > 0 }, 20*time.Second, time.Millisecond,
		"the connection of a peer that never reads its grants is dropped")
	start := time.Now()
	exp.Revoke()
	assert.Less(t, time.Since(start), 10*timeout, "Revoke waited")
	assert.Zero(t, a.Stats().StagingBuffers)
}

// A staged WRITE lease held across several renewals keeps its staging
// buffers: the bytes written into them after the renewals reach the device
// at the lease's end.
func TestDeviceStagedLeaseRenewed(t *testing.T) {
	const timeout = 100 * time.Millisecond
	sim := devmem.NewSim(2)
	a, b := devAgent(t, sim, 0, WithTimeout(timeout))
	const n = 300 << 10
	dev := newGBuf(t, sim, true, n, nil)
	exp, err := a.Expose(agent.AccessWrite, []agent.Local{dev.local()})
	require.NoError(t, err)
	defer exp.Revoke()
	p := dialRaw(t, b)
	_, err = p.stagedHello(a)
	require.NoError(t, err)
	p.send(header{typ: tBegin, status: uint8(agent.AccessWrite), count: 1, id: 1, key: exp.Key()}, [][2]uint64{{dev.local().Addr, n}}, nil)
	h, addrs, msg, err := p.grantTable()
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), h.status, msg)
	require.Len(t, addrs, 1)
	// Meanwhile another peer's staged leases, on other device memory, come
	// and go through the same pool: had a renewal given the buffers back,
	// they would be reused.
	other := newGBuf(t, sim, true, n, nil)
	oexp, err := a.Expose(agent.AccessWrite, []agent.Local{other.local()})
	require.NoError(t, err)
	defer oexp.Revoke()
	q := dialRaw(t, b)
	_, err = q.stagedHello(a)
	require.NoError(t, err)
	for id := uint64(1); id <= 5; id++ {
		time.Sleep(timeout)
		q.send(header{typ: tBegin, status: uint8(agent.AccessWrite), count: 1, id: id, key: oexp.Key()}, [][2]uint64{{other.local().Addr, n}}, nil)
		h, qa, msg, err := q.grantTable()
		require.NoError(t, err)
		require.Equal(t, uint8(stOK), h.status, msg)
		require.NotEqual(t, addrs[0], qa[0], "a buffer of a lease still held was given to another")
		vmWrite(t, qa[0], bytes.Repeat([]byte{0x11}, n))
		q.send(header{typ: tEnd, status: endWritten, id: id}, nil, nil)
	}
	src := randomBytes(n)
	vmWrite(t, addrs[0], src)
	p.send(header{typ: tEnd, status: endWritten, id: 1}, nil, nil)
	p.send(header{typ: tNotify, length: 4, key: exp.Key()}, nil, []byte("done"))
	for {
		ev := event(t, exp)
		require.NoError(t, ev.Err)
		if string(ev.Msg) == "done" {
			break
		}
	}
	dev.check(t, src, "the device after a lease renewed several times")
}

// The copying side's wait for a staged WRITE's copy into the peer's
// device, against fake exposing sides: the WRITE ends with the peer's
// word, success or failure; a peer that never answers is lost after the
// timeout; an answer to a lease not awaiting one is a protocol violation.
func TestDeviceFlushAnswer(t *testing.T) {
	for _, tc := range []struct {
		name   string
		answer func(c *net.UnixConn, f *frame) // on the tEnd
		check  func(t *testing.T, err error, staged []byte, src []byte)
	}{
		{"OK", func(c *net.UnixConn, f *frame) {
			_, _ = c.Write(frameBytes(header{typ: tFlushed, status: stOK, id: f.id}, nil, nil))
		}, func(t *testing.T, err error, staged, src []byte) {
			require.NoError(t, err)
			require.Equal(t, src, staged, "the WRITE went where the grant said")
		}},
		{"Failed", func(c *net.UnixConn, f *frame) {
			_, _ = c.Write(frameBytes(header{typ: tFlushed, status: stFailed, id: f.id, length: 4}, nil, []byte("boom")))
		}, func(t *testing.T, err error, _, _ []byte) {
			require.ErrorIs(t, err, agent.ErrStaging)
			require.ErrorContains(t, err, "boom")
		}},
		{"Silent", func(*net.UnixConn, *frame) {}, func(t *testing.T, err error, _, _ []byte) {
			require.ErrorIs(t, err, agent.ErrRemoteLost)
		}},
		{"OtherLease", func(c *net.UnixConn, f *frame) {
			_, _ = c.Write(frameBytes(header{typ: tFlushed, status: stOK, id: f.id + 1}, nil, nil))
		}, func(t *testing.T, err error, _, _ []byte) {
			require.ErrorIs(t, err, agent.ErrRemoteLost)
			require.ErrorIs(t, err, errProtocol)
		}},
		{"GrantAgain", func(c *net.UnixConn, f *frame) {
			_, _ = c.Write(frameBytes(header{typ: tGrant, status: stOK, id: f.id}, nil, nil))
		}, func(t *testing.T, err error, _, _ []byte) {
			require.ErrorIs(t, err, agent.ErrRemoteLost)
			require.ErrorIs(t, err, errProtocol)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			staged := make([]byte, 3000)
			ends := make(chan uint8, 1)
			f := newFakeExposer(t, func(c *net.UnixConn, br *bufio.Reader) {
				readFrames(c, br, func(fr *frame) {
					switch fr.typ {
					case tBegin:
						_, _ = c.Write(grantBytes(header{typ: tGrant, status: stOK, count: fr.count, id: fr.id}, []uint64{uint64(uintptrOf(&staged[0]))}))
					case tEnd:
						ends <- fr.status
						tc.answer(c, fr)
					}
				})
			})
			a, _ := newAgent(t, WithTimeout(300*time.Millisecond))
			src := randomBytes(3000)
			x, err := a.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: f.info, Key: agent.NewKey(),
				Segments: []agent.Segment{{Local: agent.DRAM(src), Remote: agent.Region{Addr: 0x10000, Len: 3000}}}})
			require.NoError(t, err)
			backendtest.DoneWithin(t, x, 10*time.Second, "a staged WRITE")
			require.Equal(t, uint8(endWritten|endAck), <-ends, "the end of a staged WRITE written in full asks for the outcome")
			tc.check(t, x.Err(), staged, src)
		})
	}
}

// The exposing side's answers to lease ends that ask for them, and its
// refusal of an end with unknown status bits.
func TestDeviceFlushAnswerByHand(t *testing.T) {
	sim := devmem.NewSim(2)
	a, b := devAgent(t, failingToDevice{sim}, 0)
	dev := newGBuf(t, sim, true, 4096, nil)
	exp, err := a.Expose(agent.AccessWrite, []agent.Local{dev.local()})
	require.NoError(t, err)
	defer exp.Revoke()
	p := dialRaw(t, b)
	_, err = p.stagedHello(a)
	require.NoError(t, err)

	// A copy into the device that fails is reported.
	p.send(header{typ: tBegin, status: uint8(agent.AccessWrite), count: 1, id: 1, key: exp.Key()}, [][2]uint64{{dev.local().Addr, 4096}}, nil)
	h, addrs, msg, err := p.grantTable()
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), h.status, msg)
	vmWrite(t, addrs[0], randomBytes(4096))
	p.send(header{typ: tEnd, status: endWritten | endAck, id: 1}, nil, nil)
	h, _, msg, err = p.grantTable()
	require.NoError(t, err)
	require.Equal(t, uint8(tFlushed), h.typ)
	require.Equal(t, uint8(stFailed), h.status)
	assert.Contains(t, msg, "injected H2D failure")

	// An end of a lease never granted, asking for an answer.
	p.send(header{typ: tEnd, status: endAck, id: 99}, nil, nil)
	h, _, msg, err = p.grantTable()
	require.NoError(t, err)
	require.Equal(t, header{typ: tFlushed, status: stFailed, id: 99, length: uint32(len(msg))}, h)
	assert.Contains(t, msg, "never granted")

	// Unknown status bits: the connection is dropped.
	p.send(header{typ: tEnd, status: 0x80, id: 1}, nil, nil)
	_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = io.Copy(io.Discard, p.br)
	require.NoError(t, err, "the exposing side closed the connection")
	require.Eventually(t, func() bool { return b.Stats().ProtocolErrors > 0 }, 5*time.Second, time.Millisecond)
}

// A peer that asks for staged leases and ends them faster than they are
// staged (here: while the stager waits for the peer to read its grants)
// cannot queue requests without bound: past maxPending waiting, ended ones
// included, the connection is dropped as over a limit.
func TestDeviceStagerQueueBounded(t *testing.T) {
	backendtest.Watchdog(t, time.Minute)
	sim := devmem.NewSim(2)
	a, b := devAgent(t, sim, 0, WithTimeout(10*time.Second))
	dev := newGBuf(t, sim, true, 4096, nil)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{dev.local()})
	require.NoError(t, err)
	defer exp.Revoke()
	p := dialRaw(t, b)
	_, err = p.stagedHello(a)
	require.NoError(t, err)
	table := make([][2]uint64, 4096) // grants of 32 KiB, never read: the stager's write waits
	for i := range table {
		table[i] = [2]uint64{dev.local().Addr + uint64(i), 1}
	}
	id := uint64(1)
	for ; id <= 32; id++ {
		p.send(header{typ: tBegin, status: uint8(agent.AccessRead), count: uint32(len(table)), id: id, key: exp.Key()}, table, nil)
	}
	var frames []byte
	for range maxPending + 1 {
		frames = append(frames, frameBytes(header{typ: tBegin, status: uint8(agent.AccessRead), count: 1, id: id, key: exp.Key()}, [][2]uint64{{dev.local().Addr, 1}}, nil)...)
		frames = append(frames, frameBytes(header{typ: tEnd, id: id}, nil, nil)...)
		id++
	}
	_, _ = p.c.Write(frames) // cut short once the connection is dropped
	require.Eventually(t, func() bool { return b.Stats().LimitRejected > 0 }, 20*time.Second, time.Millisecond,
		"a connection queueing more than %d lease requests is dropped", maxPending)
	_ = p.c.Close() // the exposing side drains its end before releasing the leases
	exp.Revoke()
	assert.Zero(t, a.Stats().StagingBuffers)
}
