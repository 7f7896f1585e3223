//go:build linux

package cma

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/internal/retry"
	"github.com/goxfer/goxfer/internal/testproc"
)

// Attacks on the same-host device path (issue 15): shares handed out by
// the exposing side only after every check, a hostile exposing side's
// frames and file descriptors, revocation, Close and departure while a
// peer's allocation is mapped, deadlines, races, copies merged across
// allocations, and windows over memory the peer shares and memory it
// stages. Helpers are prefixed a15.

// a15DeviceHello handshakes p as this process, expecting agent to,
// announcing that it maps simulated device shares.
func (p *rawPeer) a15DeviceHello(to *agent.Agent) (handshake, error) {
	return p.shake(handshake{self: p.id, expect: to.ID(), pid: uint32(os.Getpid()), caps: capStaged | capDevice | capSim})
}

// a15Frame is a frame the exposing side sent, its table and payload
// copied.
type a15Frame struct {
	header
	table, payload []byte
}

// a15UntilGrant reads the exposing side's frames up to and including the
// next tGrant.
func (p *rawPeer) a15UntilGrant() ([]a15Frame, error) {
	var out []a15Frame
	var hdr [hdrSize]byte
	var buf []byte
	var f frame
	_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer p.c.SetReadDeadline(time.Time{})
	for {
		if err := readFrame(p.br, hdr[:], &buf, limits{maxRanges: 4096, maxNotify: 64 << 10, entry: devEntrySize}, &f); err != nil {
			return out, err
		}
		out = append(out, a15Frame{header: f.header, table: append([]byte(nil), f.table...), payload: append([]byte(nil), f.payload...)})
		if f.typ == tGrant {
			return out, nil
		}
	}
}

// A lease request over GPU memory is answered with a share only once the
// key, the access and every range passed: a peer without a live key, with
// a revoked one, asking the wrong access, or naming a range outside the
// exposure (though inside the allocation the exposure lies in, alone or
// after a range that passes) is refused and sent no share; a request that
// passes gets one share, of the allocation its ranges lie in, and a grant
// that names it.
func TestAttack15NoShareBeforeEveryCheck(t *testing.T) {
	for _, vmm := range []bool{false, true} {
		t.Run(fmt.Sprintf("vmm=%v", vmm), func(t *testing.T) {
			sim := devmem.NewSim(2)
			pas, pb := ipcAgent(t, sim, 8<<20)
			const n = 64 << 10
			var whole, other gbuf
			if vmm {
				whole, other = newVMMBuf(t, sim, 2*n, nil), newVMMBuf(t, sim, n, nil)
			} else {
				whole, other = newGBuf(t, sim, true, 2*n, nil), newGBuf(t, sim, true, n, nil)
			}
			base := whole.local().Addr
			exp, err := pas.Expose(agent.AccessRead, []agent.Local{agent.Device(uintptr(base), n, agent.KindVRAM, 1)})
			require.NoError(t, err)
			defer exp.Revoke()
			// Another exposure, of the other allocation, under its own key.
			otherExp, err := pas.Expose(agent.AccessRead, []agent.Local{other.local()})
			require.NoError(t, err)
			defer otherExp.Revoke()
			revoked, err := pas.Expose(agent.AccessRead, []agent.Local{agent.Device(uintptr(base), n, agent.KindVRAM, 1)})
			require.NoError(t, err)
			revoked.Revoke()

			read := uint8(agent.AccessRead)
			for _, tc := range []struct {
				name   string
				key    agent.Key
				access uint8
				ranges [][2]uint64
			}{
				{"no key", agent.NewKey(), read, [][2]uint64{{base, 4096}}},
				{"revoked key", revoked.Key(), read, [][2]uint64{{base, 4096}}},
				{"wrong access", exp.Key(), uint8(agent.AccessWrite), [][2]uint64{{base, 4096}}},
				{"outside, same allocation", exp.Key(), read, [][2]uint64{{base + n, 4096}}},
				{"across the exposure's end", exp.Key(), read, [][2]uint64{{base + n - 100, 200}}},
				{"second range outside, same allocation", exp.Key(), read, [][2]uint64{{base, 4096}, {base + n, 4096}}},
				{"last range outside", exp.Key(), read, [][2]uint64{{base, 4096}, {base + 8192, 4096}, {base + 2*n - 4096, 4096}}},
				{"range in another exposure", exp.Key(), read, [][2]uint64{{other.local().Addr, 4096}}},
				{"second range in another exposure", exp.Key(), read, [][2]uint64{{base, 4096}, {other.local().Addr, 4096}}},
			} {
				t.Run(tc.name, func(t *testing.T) {
					p := dialRaw(t, pb)
					in, err := p.a15DeviceHello(pas)
					require.NoError(t, err)
					require.Equal(t, uint8(stOK), in.status)
					require.NotZero(t, in.caps&capDevice, "the exposing side agreed no device shares")
					p.send(header{typ: tBegin, status: tc.access, count: uint32(len(tc.ranges)), id: 1, key: tc.key}, tc.ranges, nil)
					frames, err := p.a15UntilGrant()
					require.NoError(t, err)
					for _, f := range frames[:len(frames)-1] {
						assert.NotEqual(t, uint8(tShare), f.typ, "a share (of allocation %d) sent to a request that is refused", f.id)
					}
					g := frames[len(frames)-1]
					assert.Equal(t, uint8(stDenied), g.status, "the request was not refused: %q", g.payload)
					assert.Zero(t, g.count)
				})
			}

			// A request over two allocations, one of which cannot be
			// shared (a mapping this process imported, which only its
			// owner exports): the request is staged whole, and shares
			// nothing.
			t.Run("staged", func(t *testing.T) {
				sh, err := sim.Export(other.base, 1)
				require.NoError(t, err)
				if sh.Kind == devmem.ShareFD {
					defer unix.Close(sh.FD)
				}
				m, err := sim.Import(sh, -1)
				require.NoError(t, err)
				defer m.Close()
				mixed, err := pas.Expose(agent.AccessRead, []agent.Local{agent.Device(uintptr(base), n, agent.KindVRAM, 1), agent.Device(m.Ptr(), n, agent.KindVRAM, uint32(m.Dev()))})
				require.NoError(t, err)
				defer mixed.Revoke()
				p := dialRaw(t, pb)
				_, err = p.a15DeviceHello(pas)
				require.NoError(t, err)
				p.send(header{typ: tBegin, status: read, count: 2, id: 1, key: mixed.Key()}, [][2]uint64{{base, 4096}, {uint64(m.Ptr()), 4096}}, nil)
				frames, err := p.a15UntilGrant()
				require.NoError(t, err)
				for _, f := range frames[:len(frames)-1] {
					assert.NotEqual(t, uint8(tShare), f.typ, "a share (of allocation %d) sent to a request that is staged", f.id)
				}
				g := frames[len(frames)-1]
				require.Equal(t, uint8(stOK), g.status, "%q", g.payload)
				es, err := grantEntries(&frame{header: g.header, table: g.table}, 2, func(yield func(uint64) bool) { _ = yield(4096) && yield(4096) })
				require.NoError(t, err)
				for i, e := range es {
					assert.Zero(t, e.share, "range %d of a staged grant names a share", i)
				}
				p.send(header{typ: tEnd, id: 1}, nil, nil)
			})

			t.Run("honoured", func(t *testing.T) {
				p := dialRaw(t, pb)
				_, err := p.a15DeviceHello(pas)
				require.NoError(t, err)
				p.send(header{typ: tBegin, status: read, count: 2, id: 1, key: exp.Key()}, [][2]uint64{{base, 4096}, {base + 8192, 100}}, nil)
				frames, err := p.a15UntilGrant()
				require.NoError(t, err)
				require.Len(t, frames, 2, "one share, then the grant")
				sh := frames[0]
				require.Equal(t, uint8(tShare), sh.typ)
				f := frame{header: sh.header, payload: sh.payload}
				s, err := getShare(&f)
				require.NoError(t, err)
				assert.Equal(t, uint64(whole.base), s.base, "the share is the allocation the exposure lies in")
				g := frames[1]
				require.Equal(t, uint8(stOK), g.status, "%q", g.payload)
				es, err := grantEntries(&frame{header: g.header, table: g.table}, 2, func(yield func(uint64) bool) { _ = yield(4096) && yield(100) })
				require.NoError(t, err)
				assert.Equal(t, []grantEntry{{base, s.id}, {base + 8192, s.id}}, es)
			})
		})
	}
}

// a15WaitDone waits for x, failing t if it takes longer than d, and
// returns its error.
func a15WaitDone(t testing.TB, x *agent.Xfer, d time.Duration, what string) error {
	t.Helper()
	backendtest.DoneWithin(t, x, d, what)
	return x.Err()
}

// a15Exposer is a fake exposing side that agrees the simulator's device
// shares (capDevice, capSim) and hands each lease request (tBegin) to
// script, which answers it as it likes.
func a15Exposer(t *testing.T, script func(c *net.UnixConn, f *frame)) *fakeSocket {
	t.Helper()
	return listenFake(t, "a15", func(fs *fakeSocket, c *net.UnixConn) {
		defer c.Close()
		br := bufio.NewReader(c)
		if fs.readHello(br) != nil {
			return
		}
		var hs [hsSize]byte
		out := handshake{self: fs.info.ID, pid: uint32(os.Getpid()), scope: noScope, nonce: *fs.nonce, leases: 16, caps: capStaged | capDevice | capSim}
		out.probe = uint64(uintptrOf(fs.nonce))
		out.put(hs[:])
		if _, err := c.Write(hs[:]); err != nil {
			return
		}
		readFrames(c, br, func(f *frame) {
			if f.typ == tBegin {
				script(c, f)
			}
		})
	})
}

// a15Send writes frame b on c with fds attached (SCM_RIGHTS), if any.
func a15Send(c *net.UnixConn, b []byte, fds ...int) {
	if len(fds) == 0 {
		_, _ = c.Write(b)
		return
	}
	_, _, _ = c.WriteMsgUnix(b, unix.UnixRights(fds...), nil)
}

// a15FDs counts this process's open file descriptors.
func a15FDs(t testing.TB) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(es)
}

// a15Pipes returns the ends of n pipes, which the caller closes.
func a15Pipes(t testing.TB, n int) []int {
	t.Helper()
	var fds []int
	for range (n + 1) / 2 {
		var p [2]int
		require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
		fds = append(fds, p[0], p[1])
	}
	a15Close(fds[n:])
	return fds[:n]
}

func a15Close(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// A hostile exposing side that agreed device shares: forged handles,
// kinds and sizes, shares by file descriptor without one or with the
// wrong one, grants naming shares never sent or taken back or addresses
// outside their share, unshares of unknown shares, shares sent twice,
// descriptors on frames that are not shares and more of them than a
// connection queues. The copier fails the transfer, saying why (a share
// it cannot map), or drops the connection as a protocol violation; it
// neither hangs nor crashes, copies nothing it was not granted, and once
// its agent closes holds no mapping and no descriptor it received.
func TestAttack15HostileExposer(t *testing.T) {
	const n = 64 << 10
	type outcome int
	const (
		copied   outcome = iota // granted honestly: every byte arrives
		unmapped                // the share cannot be mapped: the transfer fails saying so
		violated                // a protocol violation: the connection is dropped
	)
	grantAll := func(c *net.UnixConn, f *frame, share uint64, at func(addr uint64) uint64) {
		var es []grantEntry
		for i := range int(f.count) {
			addr, _ := f.rangeAt(i)
			es = append(es, grantEntry{at(addr), share})
		}
		a15Send(c, entryBytes(header{typ: tGrant, status: stOK, count: f.count, id: f.id}, es...))
	}
	same := func(a uint64) uint64 { return a }
	for _, tc := range []struct {
		name string
		vmm  bool
		// script answers the request f for the remote allocation sh
		// (its descriptor, for a VMM allocation, is the script's to
		// send and close).
		script func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share)
		want   outcome
		why    string
	}{
		{"honest handle", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			a15Send(c, shareBytes(sh))
			grantAll(c, f, sh.ID, same)
		}, copied, ""},
		{"honest fd", true, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			a15Send(c, shareBytes(sh), sh.FD)
			grantAll(c, f, sh.ID, same)
		}, copied, ""},
		{"forged handle", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			sh.Handle[0] ^= 0xFF
			a15Send(c, shareBytes(sh))
			grantAll(c, f, sh.ID, same)
		}, unmapped, "mapping GPU memory"},
		{"handle of another process", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			binary.LittleEndian.PutUint32(sh.Handle[8:], 1) // init's
			a15Send(c, shareBytes(sh))
			grantAll(c, f, sh.ID, same)
		}, unmapped, "mapping GPU memory"},
		{"handle larger than its allocation", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			sh.Size += 1 << 20
			a15Send(c, shareBytes(sh))
			grantAll(c, f, sh.ID, same)
		}, unmapped, "mapping GPU memory"},
		{"fd larger than its file", true, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			sh.Size += 1 << 20
			a15Send(c, shareBytes(sh), sh.FD)
			grantAll(c, f, sh.ID, same)
		}, unmapped, "mapping GPU memory"},
		{"fd smaller than its file, granted past its end", true, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			sh.Size -= 100 // still the file's size in whole pages
			a15Send(c, shareBytes(sh), sh.FD)
			grantAll(c, f, sh.ID, func(a uint64) uint64 { return uint64(sh.Base) + sh.Size - n + 50 })
		}, violated, "outside device share"},
		{"fd of a pipe", true, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			p := a15Pipes(t, 2)
			defer a15Close(p)
			a15Send(c, shareBytes(sh), p[0])
			grantAll(c, f, sh.ID, same)
		}, unmapped, "mapping GPU memory"},
		{"fd of another allocation", true, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			sh.ID += 1000
			a15Send(c, shareBytes(sh), sh.FD)
			grantAll(c, f, sh.ID, same)
		}, unmapped, "mapping GPU memory"},
		{"unknown kind", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			b := shareBytes(sh)
			b[1] = 3 // the header's status: the share's kind
			a15Send(c, b)
			grantAll(c, f, sh.ID, same)
		}, violated, "device share of kind 3"},
		{"based at 0", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			sh.Base = 0
			a15Send(c, shareBytes(sh))
			grantAll(c, f, sh.ID, same)
		}, violated, "spans"},
		{"fd share without an fd", true, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			a15Send(c, shareBytes(sh))
			grantAll(c, f, sh.ID, same)
		}, violated, "came with none"},
		{"more shares than a connection maps", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			forged := sh
			forged.Handle[0] ^= 0xFF
			var b []byte
			for i := range maxShares + 1 {
				forged.ID = sh.ID + 1000 + uint64(i)
				b = append(b, shareBytes(forged)...)
			}
			a15Send(c, b)
			a15Send(c, shareBytes(sh))
			grantAll(c, f, sh.ID, same)
		}, violated, "device allocations shared on one connection"},
		{"grant names a share never sent", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			grantAll(c, f, sh.ID, same)
		}, violated, "which was not shared"},
		{"grant before its share", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			grantAll(c, f, sh.ID, same)
			a15Send(c, shareBytes(sh))
		}, violated, "which was not shared"},
		{"grant names a share taken back", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			a15Send(c, shareBytes(sh))
			a15Send(c, frameBytes(header{typ: tUnshare, id: sh.ID}, nil, nil))
			grantAll(c, f, sh.ID, same)
		}, violated, "which was not shared"},
		{"grant below the share", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			a15Send(c, shareBytes(sh))
			grantAll(c, f, sh.ID, func(a uint64) uint64 { return uint64(sh.Base) - 4096 })
		}, violated, "outside device share"},
		{"grant past the share", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			a15Send(c, shareBytes(sh))
			grantAll(c, f, sh.ID, func(a uint64) uint64 { return uint64(sh.Base) + sh.Size - 1 })
		}, violated, "outside device share"},
		{"unshare of an unknown share", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			a15Send(c, shareBytes(sh))
			a15Send(c, frameBytes(header{typ: tUnshare, id: sh.ID + 1}, nil, nil))
			grantAll(c, f, sh.ID, same)
		}, violated, "which was not shared"},
		{"share sent twice", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			a15Send(c, shareBytes(sh))
			a15Send(c, shareBytes(sh))
			grantAll(c, f, sh.ID, same)
		}, violated, "shared twice"},
		{"fds on a grant", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			p := a15Pipes(t, 3)
			defer a15Close(p)
			a15Send(c, shareBytes(sh))
			b := entryBytes(header{typ: tGrant, status: stOK, count: 1, id: f.id}, grantEntry{uint64(sh.Base) + guardLen, sh.ID})
			a15Send(c, b, p...)
		}, copied, ""},
		{"fd share claims an fd sent on another frame", true, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			p := a15Pipes(t, 1)
			defer a15Close(p)
			b := shareBytes(sh)
			a15Send(c, b[:1], p[0])  // the pipe rides on the share's first byte...
			a15Send(c, b[1:], sh.FD) // ...and the memory file on its second
			grantAll(c, f, sh.ID, same)
		}, unmapped, "mapping GPU memory"},
		{"too many fds on one frame", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			p := a15Pipes(t, maxQueuedFDs+5)
			defer a15Close(p)
			a15Send(c, shareBytes(sh), p...)
			grantAll(c, f, sh.ID, same)
		}, violated, "file descriptors"},
		{"too many fds over several frames", false, func(t *testing.T, c *net.UnixConn, f *frame, sh devmem.Share) {
			p := a15Pipes(t, maxQueuedFDs+2)
			defer a15Close(p)
			half := len(p) / 2
			a15Send(c, shareBytes(sh), p[:half]...)
			b := entryBytes(header{typ: tGrant, status: stOK, count: 1, id: f.id}, grantEntry{uint64(sh.Base) + guardLen, sh.ID})
			a15Send(c, b, p[half:]...)
		}, violated, "file descriptors"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sim := devmem.NewSim(2)
			src := randomBytes(n)
			var rem gbuf
			if tc.vmm {
				rem = newVMMBuf(t, sim, n, src)
			} else {
				rem = newGBuf(t, sim, true, n, src)
			}
			fk := a15Exposer(t, func(c *net.UnixConn, f *frame) {
				sh, err := sim.Export(rem.base, 1)
				if !assert.NoError(t, err) {
					return
				}
				if sh.Kind == devmem.ShareFD {
					defer unix.Close(sh.FD)
				}
				tc.script(t, c, f, sh)
			})
			loc := newGBuf(t, sim, true, n, nil)
			before := a15FDs(t)
			a, b := ipcAgent(t, sim, 0, WithTimeout(2*time.Second))
			x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fk.info, Key: agent.NewKey(),
				Segments: []agent.Segment{{Local: loc.local(), Remote: rem.local().Region}}})
			require.NoError(t, err)
			err = a15WaitDone(t, x, 10*time.Second, "a READ from a hostile exposing side")
			switch tc.want {
			case copied:
				require.NoError(t, err)
				assert.Equal(t, Name+"+ipc", x.Path())
				loc.check(t, src, "the READ")
			case unmapped:
				require.Error(t, err)
				require.ErrorContains(t, err, tc.why)
				loc.check(t, bytes.Repeat([]byte{0xEE}, n), "a READ of a share that was not mapped")
			case violated:
				require.ErrorIs(t, err, agent.ErrRemoteLost)
				require.ErrorContains(t, err, "protocol violation")
				require.ErrorContains(t, err, tc.why)
				loc.check(t, bytes.Repeat([]byte{0xEE}, n), "a READ refused as a protocol violation")
				st := b.Stats()
				assert.NotZero(t, st.ProtocolErrors+st.LimitRejected, "counted as a violation or over a limit")
			}
			require.NoError(t, a.Close())
			mappingsDrop(t, sim, 0, "the copying agent closed")
			require.Eventually(t, func() bool { return a15FDs(t) <= before }, 5*time.Second, time.Millisecond,
				"descriptors open: %d, before the copying agent: %d", a15FDs(t), before)
		})
	}
}

// a15Adjacent returns two allocations of GPU 1, of sz and 2*sz bytes
// (sz a whole number of pages), whose device addresses are neighbours:
// the first ends where the second begins. They are separate allocations
// that no copy may run across.
func a15Adjacent(t *testing.T, sim *devmem.Sim, sz int) (first, second uintptr) {
	t.Helper()
	for range 20 {
		// The simulator maps a reservation per allocation, top down:
		// a hole of the middle one's reservation and memory is filled by
		// one twice as large, which then follows the third.
		z, err := sim.Alloc(1, sz)
		require.NoError(t, err)
		a, err := sim.Alloc(1, sz)
		require.NoError(t, err)
		c, err := sim.Alloc(1, sz)
		require.NoError(t, err)
		require.NoError(t, sim.Free(a))
		b, err := sim.Alloc(1, 2*sz)
		require.NoError(t, err)
		t.Cleanup(func() { _, _, _ = sim.Free(z), sim.Free(c), sim.Free(b) })
		if c+uintptr(sz) == b {
			return c, b
		}
	}
	t.Fatal("could not lay out two neighbouring allocations on the simulator")
	return 0, 0
}

// Blocks contiguous on both sides merge into one copy on the GPU, but not
// across allocations: local GPU memory whose segments lie in two
// allocations that happen to be neighbours in the address space, facing
// one contiguous range of the peer's allocation, is copied allocation by
// allocation, READ and WRITE, and every byte arrives.
func TestAttack15NoCopyAcrossAllocations(t *testing.T) {
	sim := devmem.NewSim(2)
	act, _ := ipcAgent(t, sim, 0)
	pas, _ := ipcAgent(t, sim, 0)
	const sz, blk = 64 << 10, 4096
	first, second := a15Adjacent(t, sim, sz)
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		t.Run(op.String(), func(t *testing.T) {
			src := randomBytes(4 * blk)
			var rfill []byte
			if op == agent.OpRead {
				rfill = src
			} else {
				require.NoError(t, devmem.CopyToDevice(sim, 1, first+sz-2*blk, src[:2*blk]))
				require.NoError(t, devmem.CopyToDevice(sim, 1, second, src[2*blk:]))
			}
			rem := newGBuf(t, sim, true, 4*blk, rfill)
			exp, err := pas.Expose(op.Access(), []agent.Local{rem.local()})
			require.NoError(t, err)
			defer exp.Revoke()
			r := rem.local().Addr
			x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(),
				Segments: []agent.Segment{
					{Local: agent.Device(first+sz-2*blk, blk, agent.KindVRAM, 1), Remote: agent.Region{Addr: r, Len: blk, Kind: agent.KindVRAM, Device: 1}},
					{Local: agent.Device(first+sz-blk, blk, agent.KindVRAM, 1), Remote: agent.Region{Addr: r + blk, Len: blk, Kind: agent.KindVRAM, Device: 1}},
					{Local: agent.Device(second, blk, agent.KindVRAM, 1), Remote: agent.Region{Addr: r + 2*blk, Len: blk, Kind: agent.KindVRAM, Device: 1}},
					{Local: agent.Device(second+blk, blk, agent.KindVRAM, 1), Remote: agent.Region{Addr: r + 3*blk, Len: blk, Kind: agent.KindVRAM, Device: 1}},
				}})
			require.NoError(t, err)
			require.NoError(t, a15WaitDone(t, x, 30*time.Second, "blocks in neighbouring allocations"))
			assert.Equal(t, Name+"+ipc", x.Path())
			if op == agent.OpWrite {
				rem.check(t, src, "the peer's buffer")
				return
			}
			got := make([]byte, 4*blk)
			require.NoError(t, devmem.CopyToHost(sim, 1, got[:2*blk], first+sz-2*blk))
			require.NoError(t, devmem.CopyToHost(sim, 1, got[2*blk:], second))
			require.True(t, bytes.Equal(src, got), "the READ's bytes differ")
		})
	}
	// Blocks of one allocation, contiguous on both sides, still merge.
	t.Run("one allocation", func(t *testing.T) {
		src := randomBytes(4 * blk)
		rem := newGBuf(t, sim, true, 4*blk, src)
		loc := newGBuf(t, sim, true, 4*blk, nil)
		exp, err := pas.Expose(agent.AccessRead, []agent.Local{rem.local()})
		require.NoError(t, err)
		defer exp.Revoke()
		var segs []agent.Segment
		for i := range uint64(4) {
			segs = append(segs, agent.Segment{Local: agent.Device(loc.base+guardLen+uintptr(i*blk), blk, agent.KindVRAM, 1),
				Remote: agent.Region{Addr: rem.local().Addr + i*blk, Len: blk, Kind: agent.KindVRAM, Device: 1}})
		}
		sim.Record(true)
		defer sim.Record(false)
		x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(), Segments: segs})
		require.NoError(t, err)
		require.NoError(t, a15WaitDone(t, x, 30*time.Second, "blocks of one allocation"))
		loc.check(t, src, "the READ")
		var d2d []devmem.Event
		for _, e := range sim.Events() {
			if e.Kind == "device-to-device" {
				d2d = append(d2d, e)
			}
		}
		require.Len(t, d2d, 1, "four neighbouring blocks of one allocation take one copy")
		assert.Equal(t, uint64(4*blk), d2d[0].Bytes)
	})
}

// a15Mapped waits until sim has a mapping open: the copier holds the
// peer's allocation. It fails t if x finished first.
func a15Mapped(t *testing.T, sim *devmem.Sim, x *agent.Xfer) {
	t.Helper()
	require.Eventually(t, func() bool { return sim.Mappings() > 0 || backendtest.Finished(x) }, 10*time.Second, 100*time.Microsecond)
	require.False(t, backendtest.Finished(x), "the transfer finished before the test could act on it: %v", x.Err())
}

// Many READs and WRITEs over one allocation at once, through four
// exposures of it, from two agents of this process (which share their
// mappings), while each exposure is revoked at a moment of its own:
// every transfer ends, complete or refused; a WRITE that completed wrote
// its bytes; a READ that completed read the exposure's; nothing lands in
// an exposure's memory after its Revoke returned; and once every exposure
// is revoked the copier maps nothing. Run it with -race.
func TestAttack15RevokeRacesTransfers(t *testing.T) {
	backendtest.Watchdog(t, 3*time.Minute)
	sim := devmem.NewSim(2)
	// Two copying agents in this process share its mappings.
	act1, _ := ipcAgent(t, sim, 0, WithDeviceWindow(64<<10))
	act2, _ := ipcAgent(t, sim, 0, WithDeviceWindow(64<<10))
	pas, _ := ipcAgent(t, sim, 0)
	const q, per = 4 << 20, 4 // each exposure's bytes; transfers per exposure
	const slot = q / per
	for round := range 3 {
		readable := randomBytes(2 * q)
		rem := newGBuf(t, sim, true, 4*q, nil)
		require.NoError(t, devmem.CopyToDevice(sim, 1, rem.base+guardLen+2*q, readable))
		base := rem.local().Addr
		type xfer struct {
			x    *agent.Xfer
			op   agent.Op
			loc  gbuf
			data []byte // a WRITE's
			at   uint64
			exp  *agent.Exposure
		}
		var xs []xfer
		exps := make([]*agent.Exposure, 4)
		for i := range exps {
			acc := agent.AccessWrite
			if i >= 2 {
				acc = agent.AccessRead
			}
			var err error
			exps[i], err = pas.Expose(acc, []agent.Local{agent.Device(uintptr(base)+uintptr(i*q), q, agent.KindVRAM, 1)})
			require.NoError(t, err)
			for j := range per {
				x := xfer{op: agent.OpWrite, at: base + uint64(i*q+j*slot), exp: exps[i]}
				if i >= 2 {
					x.op = agent.OpRead
				} else {
					x.data = randomBytes(slot)
				}
				x.loc = newGBuf(t, sim, j%2 == 0, slot, x.data)
				xs = append(xs, x)
			}
		}
		rand.Shuffle(len(xs), func(i, j int) { xs[i], xs[j] = xs[j], xs[i] })
		sim.SetRate(32 << 20) // a 64 KiB window copies in 2 ms, a transfer's 1 MiB in 31
		for k := range xs {
			x := &xs[k]
			act := act1
			if k%2 == 1 {
				act = act2
			}
			var err error
			x.x, err = act.Post(context.Background(), agent.Request{Op: x.op, Peer: pas.Info(), Key: x.exp.Key(),
				Segments: []agent.Segment{{Local: x.loc.local(), Remote: agent.Region{Addr: x.at, Len: slot, Kind: agent.KindVRAM, Device: 1}}}})
			require.NoError(t, err)
		}
		snaps := make([][]byte, 4)
		var wg sync.WaitGroup
		for i, e := range exps {
			wg.Go(func() {
				time.Sleep(time.Duration(rand.IntN(25000*(round+1))) * time.Microsecond)
				e.Revoke()
				b := make([]byte, q)
				if err := devmem.CopyToHost(sim, 1, b, uintptr(base)+uintptr(i*q)); err != nil {
					panic(err)
				}
				snaps[i] = b
			})
		}
		wg.Wait()
		refused := 0
		for k, x := range xs {
			err := a15WaitDone(t, x.x, 30*time.Second, "a transfer racing revocation")
			if err != nil {
				require.ErrorIs(t, err, agent.ErrAccessDenied, "round %d, transfer %d", round, k)
				refused++
				continue
			}
			if x.op == agent.OpRead {
				x.loc.check(t, readable[x.at-base-2*q:][:slot], "a READ that completed")
			}
		}
		time.Sleep(10 * time.Millisecond)
		sim.SetRate(0)
		for i := range exps {
			now := make([]byte, q)
			require.NoError(t, devmem.CopyToHost(sim, 1, now, uintptr(base)+uintptr(i*q)))
			require.True(t, bytes.Equal(snaps[i], now), "round %d: exposure %d's memory changed after its Revoke returned", round, i)
		}
		for _, x := range xs {
			if x.op == agent.OpWrite && x.x.Err() == nil {
				require.True(t, bytes.Equal(x.data, snaps[(x.at-base)/q][(x.at-base)%q:][:slot]), "round %d: a WRITE that completed is not in the peer's memory", round)
			}
		}
		t.Logf("round %d: %d of %d transfers refused", round, refused, len(xs))
		mappingsDrop(t, sim, 0, "every exposure revoked")
	}
}

// The exposing agent closes while the copier's transfer maps its memory:
// Close returns once the copier's leases ended, no byte of a WRITE lands
// after it, the transfer ends, and the copier unmaps.
func TestAttack15CloseExposingMidTransfer(t *testing.T) {
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		t.Run(op.String(), func(t *testing.T) {
			sim := devmem.NewSim(2)
			sim.SetRate(128 << 20)
			act, _ := ipcAgent(t, sim, 0, WithDeviceWindow(1<<20))
			pas, _ := ipcAgent(t, sim, 0)
			const n = 32 << 20
			var lfill []byte
			if op == agent.OpWrite {
				lfill = randomBytes(n)
			}
			rem := newGBuf(t, sim, true, n, nil)
			loc := newGBuf(t, sim, true, n, lfill)
			exp, err := pas.Expose(op.Access(), []agent.Local{rem.local()})
			require.NoError(t, err)
			x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(),
				Segments: []agent.Segment{{Local: loc.local(), Remote: rem.local().Region}}})
			require.NoError(t, err)
			a15Mapped(t, sim, x)
			time.Sleep(20 * time.Millisecond)
			require.NoError(t, pas.Close())
			after := rem.all(t)
			err = a15WaitDone(t, x, 30*time.Second, "a transfer whose exposing agent closed")
			t.Logf("the transfer ended: %v", err)
			time.Sleep(20 * time.Millisecond)
			require.True(t, bytes.Equal(after, rem.all(t)), "the peer's memory changed after its agent's Close returned")
			mappingsDrop(t, sim, 0, "the exposing agent closed")
		})
	}
}

// The copying agent closes mid-transfer: after Close returns no copy runs
// on its GPU (the simulator's record), nothing lands in the peer's
// memory, the transfer has ended, and the copier maps nothing.
func TestAttack15CloseCopyingMidTransfer(t *testing.T) {
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		t.Run(op.String(), func(t *testing.T) {
			sim := devmem.NewSim(2)
			sim.SetRate(128 << 20)
			act, _ := ipcAgent(t, sim, 0, WithDeviceWindow(1<<20))
			pas, _ := ipcAgent(t, sim, 0)
			const n = 32 << 20
			var lfill []byte
			if op == agent.OpWrite {
				lfill = randomBytes(n)
			}
			rem := newGBuf(t, sim, true, n, nil)
			loc := newGBuf(t, sim, true, n, lfill)
			exp, err := pas.Expose(op.Access(), []agent.Local{rem.local()})
			require.NoError(t, err)
			defer exp.Revoke()
			sim.Record(true)
			defer sim.Record(false)
			x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(),
				Segments: []agent.Segment{{Local: loc.local(), Remote: rem.local().Region}}})
			require.NoError(t, err)
			a15Mapped(t, sim, x)
			time.Sleep(20 * time.Millisecond)
			require.NoError(t, act.Close())
			sim.Mark("closed", 0)()
			sim.SetRate(0) // the test's own reads
			require.True(t, backendtest.Finished(x), "the transfer outlived its agent's Close")
			require.ErrorIs(t, x.Err(), agent.ErrClosed)
			after, local := rem.all(t), loc.all(t)
			time.Sleep(50 * time.Millisecond)
			require.True(t, bytes.Equal(after, rem.all(t)), "the peer's memory changed after the copying agent's Close returned")
			require.True(t, bytes.Equal(local, loc.all(t)), "the local memory changed after the copying agent's Close returned")
			var closed time.Duration
			copies := 0
			for _, e := range sim.Events() {
				if e.Kind == "closed" {
					closed = e.Start
				}
			}
			require.NotZero(t, closed)
			for _, e := range sim.Events() {
				if e.Kind == "device-to-device" { // the copier's: the test's own reads copy to the host
					copies++
					assert.LessOrEqual(t, e.End, closed, "a copy of %d bytes ran after Close returned", e.Bytes)
				}
			}
			assert.NotZero(t, copies, "nothing was copied before Close")
			mappingsDrop(t, sim, 0, "the copying agent closed")
		})
	}
}

// This file's child processes, on the simulator: an exposing child (the
// departure test's) that exposes an allocation for READ and WRITE and
// waits until its standard input closes or it is killed, and a copying
// child (the cross-process revocation test's).
const (
	a15ChildEnv = "GOXFER_CMA_A15_CHILD"
	// a15KindEnv says which child: "handle" or "fd" an exposing one (how
	// its allocation is shared), "copier" a copying one.
	a15KindEnv  = "GOXFER_CMA_A15_KIND"
	a15ChildLen = 32 << 20
)

// a15Hello is what the child says once its exposures are up.
type a15Hello struct {
	Info        agent.Info
	Read, Write agent.Key
	Addr        uint64
	Pid         int
}

func init() {
	if os.Getenv(a15ChildEnv) == "" {
		return
	}
	var err error
	switch kind := os.Getenv(a15KindEnv); kind {
	case "copier":
		err = a15Copier()
	default:
		err = a15Child(kind == "fd")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "a15 child:", err)
		os.Exit(2)
	}
	os.Exit(0)
}

func a15Child(vmm bool) error {
	sim := devmem.NewSim(2)
	a, err := agent.New(agent.WithBackends(New()), agent.WithDevice(sim))
	if err != nil {
		return err
	}
	defer a.Close()
	alloc := sim.Alloc
	if vmm {
		alloc = sim.AllocShareable
	}
	p, err := alloc(1, a15ChildLen)
	if err != nil {
		return err
	}
	fill := make([]byte, a15ChildLen)
	for i := range fill {
		fill[i] = byte(i * 7)
	}
	if err := devmem.CopyToDevice(sim, 1, p, fill); err != nil {
		return err
	}
	mem := []agent.Local{agent.Device(p, a15ChildLen, agent.KindVRAM, 1)}
	r, err := a.Expose(agent.AccessRead, mem)
	if err != nil {
		return err
	}
	w, err := a.Expose(agent.AccessWrite, mem)
	if err != nil {
		return err
	}
	if err := json.NewEncoder(os.Stdout).Encode(a15Hello{Info: a.Info(), Read: r.Key(), Write: w.Key(), Addr: uint64(p), Pid: os.Getpid()}); err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// a15Target is the exposure the copying child WRITEs, and its report.
type a15Target struct {
	Info agent.Info
	Key  agent.Key
	Addr uint64
}

type a15Report struct {
	Mapped   bool   `json:",omitempty"` // the child maps the parent's allocation
	Done     bool   `json:",omitempty"` // the WRITE ended, with Err
	Err      string `json:",omitempty"`
	Denied   bool   `json:",omitempty"` // Err is ErrAccessDenied
	Mappings int    `json:",omitempty"` // mappings left once they had a while to go
}

// a15Copier is the copying child: it says hello (its process ID), reads a
// target, WRITEs a15ChildLen bytes of its GPU memory there through a
// mapping at 64 MiB/s, and reports when it has mapped the target, when
// the WRITE ended and, once the mappings had 10 s to go, how many are
// left.
func a15Copier() error {
	sim := devmem.NewSim(2)
	a, err := agent.New(agent.WithBackends(New(WithDeviceWindow(1<<20))), agent.WithDevice(sim))
	if err != nil {
		return err
	}
	defer a.Close()
	out := json.NewEncoder(os.Stdout)
	if err := out.Encode(os.Getpid()); err != nil {
		return err
	}
	var tg a15Target
	if err := json.NewDecoder(os.Stdin).Decode(&tg); err != nil {
		return err
	}
	p, err := sim.Alloc(1, a15ChildLen)
	if err != nil {
		return err
	}
	defer sim.Free(p)
	if err := devmem.CopyToDevice(sim, 1, p, bytes.Repeat([]byte{0x5A}, a15ChildLen)); err != nil {
		return err
	}
	sim.SetRate(64 << 20)
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: tg.Info, Key: tg.Key,
		Segments: []agent.Segment{{Local: agent.Device(p, a15ChildLen, agent.KindVRAM, 1), Remote: agent.Region{Addr: tg.Addr, Len: a15ChildLen, Kind: agent.KindVRAM, Device: 1}}}})
	if err != nil {
		return err
	}
	for sim.Mappings() == 0 && !backendtest.Finished(x) {
		time.Sleep(100 * time.Microsecond)
	}
	if err := out.Encode(a15Report{Mapped: sim.Mappings() > 0}); err != nil {
		return err
	}
	<-x.Done()
	r := a15Report{Done: true, Denied: errors.Is(x.Err(), agent.ErrAccessDenied)}
	if x.Err() != nil {
		r.Err = x.Err().Error()
	}
	if err := out.Encode(r); err != nil {
		return err
	}
	for end := time.Now().Add(10 * time.Second); sim.Mappings() > 0 && time.Now().Before(end); {
		time.Sleep(time.Millisecond)
	}
	if err := out.Encode(a15Report{Mappings: sim.Mappings()}); err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// A peer process killed while this side maps its allocation and copies
// through the mapping, READ and WRITE, shared by handle and by file
// descriptor: the transfer ends with ErrRemoteLost within the timeout,
// and the mapping goes.
func TestAttack15PeerKilledWhileMapped(t *testing.T) {
	const timeout = 2 * time.Second
	for _, kind := range []string{"handle", "fd"} {
		for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
			t.Run(kind+"/"+op.String(), func(t *testing.T) {
				var hello a15Hello
				child := testproc.Spawn(t, a15ChildEnv, &hello, func(c *exec.Cmd) { c.Env = append(c.Env, a15KindEnv+"="+kind) })
				t.Cleanup(func() {
					_ = unix.Kill(hello.Pid, unix.SIGKILL)
					_ = child.Stop()
				})
				sim := devmem.NewSim(2)
				act, _ := ipcAgent(t, sim, 0, WithDeviceWindow(1<<20), WithTimeout(timeout))
				loc := newGBuf(t, sim, true, a15ChildLen, nil)
				sim.SetRate(64 << 20) // half a second for the whole
				key := hello.Read
				if op == agent.OpWrite {
					key = hello.Write
				}
				x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: hello.Info, Key: key,
					Segments: []agent.Segment{{Local: loc.local(), Remote: agent.Region{Addr: hello.Addr, Len: a15ChildLen, Kind: agent.KindVRAM, Device: 1}}}})
				require.NoError(t, err)
				a15Mapped(t, sim, x)
				assert.Equal(t, Name+"+ipc", x.Path())
				time.Sleep(50 * time.Millisecond)
				require.NoError(t, unix.Kill(hello.Pid, unix.SIGKILL))
				took := backendtest.DoneWithin(t, x, 10*time.Second, "a transfer whose peer was killed")
				require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
				assert.Less(t, took, timeout, "the transfer outlived its peer by the timeout")
				mappingsDrop(t, sim, 0, "the peer was killed")
			})
		}
	}
}

// a15Deadline cancels x with ctx's error once ctx ends, as a caller
// bounding the transfer by its context does (Post's context bounds only
// the start).
func a15Deadline(ctx context.Context, x *agent.Xfer) (stop func() bool) {
	return context.AfterFunc(ctx, func() { x.Cancel(ctx.Err()) })
}

// A transfer whose deadline passes while it waits for a grant over GPU
// memory (the exposing side shared the allocation, then went silent) or
// while it copies through a mapping ends, cancelled with the deadline's
// error, at once or after the window being copied, not at the timeout;
// nothing is copied after it ended; no goroutine of it outlives the
// agent.
func TestAttack15Deadlines(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) }) // last: after the agents close
	const timeout = 5 * time.Second
	sim := devmem.NewSim(2)
	for _, n := range []int{64 << 10, 8 << 20} { // copied on the reader, or by a driver
		t.Run(fmt.Sprintf("grant/%d", n), func(t *testing.T) {
			rem := newGBuf(t, sim, true, n, nil)
			var once sync.Once
			fk := a15Exposer(t, func(c *net.UnixConn, f *frame) {
				once.Do(func() {
					sh, err := sim.Export(rem.base, 1)
					if assert.NoError(t, err) {
						a15Send(c, shareBytes(sh)) // and no grant, ever
					}
				})
			})
			act, _ := ipcAgent(t, sim, 0, WithTimeout(timeout), WithDeviceWindow(1<<20))
			loc := newGBuf(t, sim, true, n, nil)
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fk.info, Key: agent.NewKey(),
				Segments: []agent.Segment{{Local: loc.local(), Remote: rem.local().Region}}})
			require.NoError(t, err)
			defer a15Deadline(ctx, x)()
			took := backendtest.DoneWithin(t, x, 2*timeout, "a transfer waiting for a grant")
			require.ErrorIs(t, x.Err(), agent.ErrCancelled)
			require.ErrorIs(t, x.Err(), context.DeadlineExceeded)
			assert.Less(t, took, timeout/2, "the transfer ended at the timeout, not at its deadline")
			require.NoError(t, act.Close())
			mappingsDrop(t, sim, 0, "the copying agent closed")
		})
	}
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		t.Run("copy/"+op.String(), func(t *testing.T) {
			act, _ := ipcAgent(t, sim, 0, WithTimeout(timeout), WithDeviceWindow(1<<20))
			pas, _ := ipcAgent(t, sim, 0, WithTimeout(timeout))
			const n = 32 << 20
			rem := newGBuf(t, sim, true, n, nil)
			loc := newGBuf(t, sim, true, n, randomBytes(n))
			exp, err := pas.Expose(op.Access(), []agent.Local{rem.local()})
			require.NoError(t, err)
			defer exp.Revoke()
			sim.SetRate(32 << 20) // 31 ms a window, a second for the whole
			defer sim.SetRate(0)
			ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
			defer cancel()
			x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(),
				Segments: []agent.Segment{{Local: loc.local(), Remote: rem.local().Region}}})
			require.NoError(t, err)
			defer a15Deadline(ctx, x)()
			took := backendtest.DoneWithin(t, x, 2*timeout, "a transfer copying past its deadline")
			require.ErrorIs(t, x.Err(), agent.ErrCancelled)
			require.ErrorIs(t, x.Err(), context.DeadlineExceeded)
			assert.Less(t, took, timeout/2, "the transfer ended at the timeout, not after the window it was copying")
			sim.SetRate(0)
			after, local := rem.all(t), loc.all(t)
			time.Sleep(50 * time.Millisecond)
			require.True(t, bytes.Equal(after, rem.all(t)), "the peer's memory changed after the transfer ended")
			require.True(t, bytes.Equal(local, loc.all(t)), "the local memory changed after the transfer ended")
			exp.Revoke()
			mappingsDrop(t, sim, 0, "the exposure revoked")
			require.NoError(t, act.Close())
			require.NoError(t, pas.Close())
		})
	}
}

// The copying process does not see the exporting GPU (one GPU per process,
// as CUDA_VISIBLE_DEVICES arranges; here a simulator with one GPU against
// memory of the exporter's GPU 1): docs/gpu.md says the mapping is then
// opened on the copier's first GPU. READ and WRITE move every byte, into
// GPU and host memory, and the mapping goes with the exposure.
func TestAttack15ExportingGPUNotVisible(t *testing.T) {
	one, two := devmem.NewSim(1), devmem.NewSim(2)
	act, _ := ipcAgent(t, one, 0)
	pas, _ := ipcAgent(t, two, 0)
	const n = 1 << 20
	for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
		for _, localVRAM := range []bool{true, false} {
			t.Run(fmt.Sprintf("%v/local=%s", op, kindName(localVRAM)), func(t *testing.T) {
				src := randomBytes(n)
				var rfill, lfill []byte
				if op == agent.OpRead {
					rfill = src
				} else {
					lfill = src
				}
				rem := newGBuf(t, two, true, n, rfill)
				if lfill == nil {
					lfill = make([]byte, n)
				}
				var local agent.Local
				var got func() []byte
				if localVRAM {
					p, err := one.Alloc(0, n)
					require.NoError(t, err)
					t.Cleanup(func() { _ = one.Free(p) })
					require.NoError(t, devmem.CopyToDevice(one, 0, p, lfill))
					local = agent.Device(p, n, agent.KindVRAM, 0)
					got = func() []byte {
						b := make([]byte, n)
						require.NoError(t, devmem.CopyToHost(one, 0, b, p))
						return b
					}
				} else {
					b := bytes.Clone(lfill)
					local = agent.DRAM(b)
					got = func() []byte { return b }
				}
				exp, err := pas.Expose(op.Access(), []agent.Local{rem.local()})
				require.NoError(t, err)
				x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(),
					Segments: []agent.Segment{{Local: local, Remote: rem.local().Region}}})
				require.NoError(t, err)
				require.NoError(t, a15WaitDone(t, x, 10*time.Second, "a transfer of a GPU this process does not see"))
				assert.Equal(t, Name+"+ipc", x.Path())
				require.True(t, bytes.Equal(src, got()), "the local memory")
				rem.check(t, src, "the peer's buffer")
				assert.Equal(t, 1, one.Mappings(), "mapped on the copier's GPU")
				exp.Revoke()
				mappingsDrop(t, one, 0, "the exposure revoked")
			})
		}
	}
}

// a15MappingAt returns where this process mapped the allocation id of
// process pid, or 0.
func a15MappingAt(sim *devmem.Sim, pid int, id uint64) uintptr {
	importsMu.Lock()
	defer importsMu.Unlock()
	if im := imports[importKey{drv: sim, pid: pid, id: id}]; im != nil {
		return im.m.Ptr()
	}
	return 0
}

// Neither does a copy run from one mapping of the peer's into the next,
// however neighbouring this process mapped them: a grant placing two
// blocks at the end of one share and the start of another, facing
// contiguous local GPU memory, is copied mapping by mapping.
func TestAttack15NoCopyAcrossMappings(t *testing.T) {
	// Laying the mappings out as neighbours depends on the address space
	// of the moment (other goroutines map memory too): tried afresh until
	// it holds. An attempt takes milliseconds; 8 attempts all missed once
	// in CI, late in a run whose address space other tests had cut up.
	retry.Until(t, 64, a15NeighbourMappings)
}

// a15NeighbourMappings runs TestAttack15NoCopyAcrossMappings once; false
// if the two mappings did not come out as neighbours.
func a15NeighbourMappings(t *testing.T) bool {
	const sz, blk = 64 << 10, 4096
	sim := devmem.NewSim(2)
	src := randomBytes(2 * blk)
	var shares [2]devmem.Share
	for i := range shares {
		p, err := sim.Alloc(1, sz)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sim.Free(p) })
		// The second share is mapped below the first: the blocks are its
		// last and the first's first.
		at, data := p, src[blk:]
		if i == 1 {
			at, data = p+sz-blk, src[:blk]
		}
		require.NoError(t, devmem.CopyToDevice(sim, 1, at, data))
		shares[i], err = sim.Export(p, 1)
		require.NoError(t, err)
	}
	// The address space the copier's mappings will take, top down: a
	// reservation and its memory each, sz bytes. Holes above and below a
	// placeholder take the first share's; the placeholder's, freed once
	// that share is mapped, takes the second's reservation, right below
	// the first's (the simulator copies through the reservation's
	// address).
	reserve := func(n uintptr) unsafe.Pointer {
		p, err := unix.MmapPtr(-1, 0, nil, n, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANON|unix.MAP_NORESERVE)
		require.NoError(t, err)
		return p
	}
	hole := reserve(4 * sz)
	// Gaps above it that could take a mapping are filled first.
	for range 1 << 12 {
		f := reserve(sz)
		if uintptr(f) < uintptr(hole) {
			require.NoError(t, unix.MunmapPtr(f, sz))
			break
		}
		t.Cleanup(func() { _ = unix.MunmapPtr(f, sz) })
	}
	placeholder := unsafe.Add(hole, 2*sz)
	require.NoError(t, unix.MunmapPtr(hole, 2*sz))
	require.NoError(t, unix.MunmapPtr(unsafe.Add(hole, 3*sz), sz))
	freed := false
	defer func() {
		if !freed {
			_ = unix.MunmapPtr(placeholder, sz)
		}
	}()
	adjacent := make(chan bool, 1)
	fk := a15Exposer(t, func(c *net.UnixConn, f *frame) {
		a15Send(c, shareBytes(shares[0]))
		if !assert.Eventually(t, func() bool { return sim.Mappings() == 1 }, 5*time.Second, 100*time.Microsecond) {
			return
		}
		freed = unix.MunmapPtr(placeholder, sz) == nil
		a15Send(c, shareBytes(shares[1]))
		if !assert.Eventually(t, func() bool { return sim.Mappings() == 2 }, 5*time.Second, 100*time.Microsecond) {
			return
		}
		first, second := a15MappingAt(sim, os.Getpid(), shares[0].ID), a15MappingAt(sim, os.Getpid(), shares[1].ID)
		adjacent <- second+sz == first
		a15Send(c, entryBytes(header{typ: tGrant, status: stOK, count: 2, id: f.id},
			grantEntry{uint64(shares[1].Base) + sz - blk, shares[1].ID}, grantEntry{uint64(shares[0].Base), shares[0].ID}))
	})
	act, _ := ipcAgent(t, sim, 0)
	loc := newGBuf(t, sim, true, 2*blk, nil)
	x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fk.info, Key: agent.NewKey(),
		Segments: []agent.Segment{
			{Local: agent.Device(loc.base+guardLen, blk, agent.KindVRAM, 1), Remote: agent.Region{Addr: uint64(shares[1].Base) + sz - blk, Len: blk, Kind: agent.KindVRAM, Device: 1}},
			{Local: agent.Device(loc.base+guardLen+blk, blk, agent.KindVRAM, 1), Remote: agent.Region{Addr: uint64(shares[0].Base), Len: blk, Kind: agent.KindVRAM, Device: 1}},
		}})
	require.NoError(t, err)
	err = a15WaitDone(t, x, 30*time.Second, "blocks in neighbouring mappings")
	select {
	case adj := <-adjacent:
		if !adj {
			t.Log("the two mappings did not come out as neighbours")
			return false
		}
	default:
		t.Fatal("the exposing side did not grant")
	}
	require.NoError(t, err)
	loc.check(t, src, "the READ")
	return true
}

// Revocation while the copier is another process, WRITEing through its
// mapping of this process's allocation: once Revoke returns no byte
// lands, the WRITE ends (complete, or refused), and the copying process
// drops its mapping (tUnshare).
func TestAttack15RevokeCopierInAnotherProcess(t *testing.T) {
	sim := devmem.NewSim(2)
	pas, _ := ipcAgent(t, sim, 0)
	for round := range 3 {
		rem := newGBuf(t, sim, true, a15ChildLen, nil)
		exp, err := pas.Expose(agent.AccessWrite, []agent.Local{rem.local()})
		require.NoError(t, err)
		var pid int
		child := testproc.Spawn(t, a15ChildEnv, &pid, func(c *exec.Cmd) { c.Env = append(c.Env, a15KindEnv+"=copier") })
		t.Cleanup(func() { _ = child.Stop() })
		require.NoError(t, json.NewEncoder(child.Stdin).Encode(a15Target{Info: pas.Info(), Key: exp.Key(), Addr: rem.local().Addr}))
		next := func(what string) a15Report {
			t.Helper()
			var r a15Report
			require.NoError(t, child.Stdout.Decode(&r), "%s; the child's stderr:\n%s", what, child.Stderr())
			return r
		}
		require.True(t, next("mapped").Mapped, "the copying child mapped nothing")
		time.Sleep(time.Duration(round) * 50 * time.Millisecond)
		exp.Revoke()
		after := rem.all(t)
		done := next("done")
		require.True(t, done.Done)
		if done.Err != "" {
			require.True(t, done.Denied, "round %d: the WRITE failed otherwise than refused: %s", round, done.Err)
		}
		t.Logf("round %d: the WRITE ended: %q", round, done.Err)
		time.Sleep(20 * time.Millisecond)
		require.True(t, bytes.Equal(after, rem.all(t)), "round %d: the memory changed after Revoke returned", round)
		assert.Zero(t, next("mappings").Mappings, "round %d: mappings left in the copying process", round)
		require.NoError(t, child.Stop())
	}
}

// The exposing side's descriptors of VMM allocations (Export duplicates
// one per share) and the copier's (one per tShare) are closed, whatever
// becomes of the request: granted, refused, granted again under a second
// exposure of the allocation, revoked. Once both agents closed, no
// descriptor is left.
func TestAttack15NoDescriptorLeft(t *testing.T) {
	sim := devmem.NewSim(2)
	const n = 256 << 10
	src := randomBytes(2 * n)
	whole := newVMMBuf(t, sim, 2*n, src)
	loc := newGBuf(t, sim, true, n, nil)
	before := a15FDs(t)
	b1, b2 := New(), New()
	act, err := agent.New(agent.WithBackends(b1), agent.WithDevice(sim))
	require.NoError(t, err)
	pas, err := agent.New(agent.WithBackends(b2), agent.WithDevice(sim))
	require.NoError(t, err)
	base := whole.local().Addr
	read := func(exp *agent.Exposure, at uint64) error {
		x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(),
			Segments: []agent.Segment{{Local: loc.local(), Remote: agent.Region{Addr: at, Len: n, Kind: agent.KindVRAM, Device: 1}}}})
		require.NoError(t, err)
		return a15WaitDone(t, x, 30*time.Second, "a READ")
	}
	for range 10 {
		first, err := pas.Expose(agent.AccessRead, []agent.Local{agent.Device(uintptr(base), n, agent.KindVRAM, 1)})
		require.NoError(t, err)
		require.NoError(t, read(first, base))
		require.ErrorIs(t, read(first, base+n), agent.ErrAccessDenied)
		second, err := pas.Expose(agent.AccessRead, []agent.Local{agent.Device(uintptr(base)+n, n, agent.KindVRAM, 1)})
		require.NoError(t, err)
		require.NoError(t, read(second, base+n))
		loc.check(t, src[n:], "the READ of the second exposure")
		first.Revoke()
		second.Revoke()
		mappingsDrop(t, sim, 0, "both exposures revoked")
	}
	require.NoError(t, act.Close())
	require.NoError(t, pas.Close())
	require.Eventually(t, func() bool { return a15FDs(t) <= before }, 5*time.Second, time.Millisecond,
		"descriptors open: %d, before the agents: %d", a15FDs(t), before)
}

// One transfer over the peer's GPU memory that it can share and memory it
// cannot (a mapping it imported, which only its owner exports), in either
// order: a grant that says shared grows the windows after it, and a
// window that reaches the unshareable memory must still be staged within
// the peer's pool. READ and WRITE move every byte.
func TestAttack15SharedThenUnshareable(t *testing.T) {
	sim := devmem.NewSim(2)
	act, _ := ipcAgent(t, sim, 0)
	pas, _ := ipcAgent(t, sim, 8<<20) // 4 MiB for peers' leases
	const a, b = 8 << 20, 40 << 20
	for _, sharedFirst := range []bool{true, false} {
		for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
			t.Run(fmt.Sprintf("%v/sharedFirst=%v", op, sharedFirst), func(t *testing.T) {
				src := randomBytes(a + b)
				var rfill, lfill []byte
				if op == agent.OpRead {
					rfill = src
				} else {
					lfill = src
				}
				shared := newGBuf(t, sim, true, a, rfill[:min(len(rfill), a)])
				owner := newGBuf(t, sim, true, b, rfill[min(len(rfill), a):])
				sh, err := sim.Export(owner.base, 1)
				require.NoError(t, err)
				m, err := sim.Import(sh, -1)
				require.NoError(t, err)
				defer m.Close()
				unshared := agent.Device(m.Ptr()+guardLen, b, agent.KindVRAM, uint32(m.Dev()))
				exp, err := pas.Expose(op.Access(), []agent.Local{shared.local(), unshared})
				require.NoError(t, err)
				defer exp.Revoke()
				loc := newGBuf(t, sim, true, a+b, lfill)
				segs := []agent.Segment{
					{Local: agent.Device(loc.base+guardLen, a, agent.KindVRAM, 1), Remote: shared.local().Region},
					{Local: agent.Device(loc.base+guardLen+a, b, agent.KindVRAM, 1), Remote: unshared.Region},
				}
				if !sharedFirst {
					segs[0], segs[1] = segs[1], segs[0]
				}
				x, err := act.Post(context.Background(), agent.Request{Op: op, Peer: pas.Info(), Key: exp.Key(), Segments: segs})
				require.NoError(t, err)
				require.NoError(t, a15WaitDone(t, x, time.Minute, "shared and unshareable GPU memory"))
				if op == agent.OpRead {
					loc.check(t, src, "the local buffer")
					return
				}
				shared.check(t, src[:a], "the peer's shared buffer")
				owner.check(t, src[a:], "the peer's unshareable buffer")
			})
		}
	}
}

// Thousands of blocks of one shared allocation, as a KV cache hand-off
// moves them: once the first grants showed the allocation shared, the
// rest moves in large windows, each one merged copy; every byte arrives.
func TestAttack15ManyBlocksFewWindows(t *testing.T) {
	sim := devmem.NewSim(2)
	act, _ := ipcAgent(t, sim, 0)
	pas, _ := ipcAgent(t, sim, 0)
	const blocks, blk = 4096, 16 << 10
	src := randomBytes(blocks * blk)
	rem := newGBuf(t, sim, true, blocks*blk, src)
	loc := newGBuf(t, sim, true, blocks*blk, nil)
	exp, err := pas.Expose(agent.AccessRead, []agent.Local{rem.local()})
	require.NoError(t, err)
	defer exp.Revoke()
	segs := make([]agent.Segment, blocks)
	for i := range segs {
		off := uint64(i * blk)
		segs[i] = agent.Segment{Local: agent.Device(loc.base+guardLen+uintptr(off), blk, agent.KindVRAM, 1),
			Remote: agent.Region{Addr: rem.local().Addr + off, Len: blk, Kind: agent.KindVRAM, Device: 1}}
	}
	sim.Record(true)
	defer sim.Record(false)
	x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(), Segments: segs})
	require.NoError(t, err)
	require.NoError(t, a15WaitDone(t, x, time.Minute, "thousands of blocks"))
	loc.check(t, src, "the READ")
	copies := 0
	for _, e := range sim.Events() {
		if e.Kind == "device-to-device" {
			copies++
		}
	}
	// A staged lease's worth per window until a grant came back (at most
	// the windows in flight), then one window for the rest.
	assert.LessOrEqual(t, copies, ipcDepth+2, "%d blocks took %d copies", blocks, copies)
}
