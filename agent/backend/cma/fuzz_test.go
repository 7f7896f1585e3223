//go:build linux

package cma

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
)

func frameSeeds() [][]byte {
	key := agent.Key{1, 2, 3}
	return [][]byte{
		frameBytes(header{typ: tBegin, status: 1, count: 1, id: 1, key: key}, [][2]uint64{{0x1000, 16}}, nil),
		frameBytes(header{typ: tBegin, status: 2, count: 2, id: 2, key: key}, [][2]uint64{{0x1000, 16}, {0x2000, 1}}, nil),
		frameBytes(header{typ: tGrant, status: stDenied, id: 1, length: 4}, nil, []byte("nope")),
		grantBytes(header{typ: tGrant, status: stOK, count: 2, id: 1}, []uint64{0x1000, 0x7f0000001000}),
		grantBytes(header{typ: tGrant, status: stOK, count: 1, id: 2}, []uint64{^uint64(0) - 4}),
		grantBytes(header{typ: tGrant, status: stDenied, count: 1, id: 3}, []uint64{0x1000}),
		frameBytes(header{typ: tEnd, id: 1}, nil, nil),
		frameBytes(header{typ: tEnd, status: endWritten | endAck, id: 1}, nil, nil),
		frameBytes(header{typ: tFlushed, status: stFailed, id: 1, length: 4}, nil, []byte("boom")),
		frameBytes(header{typ: tNotify, length: 3, key: key}, nil, []byte("hey")),
		frameBytes(header{typ: tBye}, nil, nil),
		[]byte("GXCM garbage"),
	}
}

// grantBytes encodes a grant with a table of staged addresses.
func grantBytes(h header, addrs []uint64) []byte {
	b := make([]byte, hdrSize)
	h.put(b)
	for _, a := range addrs {
		b = binary.LittleEndian.AppendUint64(b, a)
	}
	return b
}

// FuzzReadFrame feeds arbitrary bytes to the frame decoder: it must never
// panic, never accept a frame outside the limits, and never allocate more
// than the limits allow.
func FuzzReadFrame(f *testing.F) {
	for _, s := range frameSeeds() {
		f.Add(s)
	}
	lim := limits{maxRanges: 64, maxNotify: 1 << 10}
	f.Fuzz(func(t *testing.T, data []byte) {
		r := bytes.NewReader(data)
		var hdr [hdrSize]byte
		var buf []byte
		var fr frame
		for {
			err := readFrame(r, hdr[:], &buf, lim, &fr)
			if err != nil {
				if !errors.Is(err, errProtocol) && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
					t.Fatalf("unexpected error %v", err)
				}
				break
			}
			if cap(buf) > lim.maxRanges*rangeSize+maxErrMsg+lim.maxNotify {
				t.Fatalf("buffer of %d bytes", cap(buf))
			}
			entry := rangeSize
			if fr.typ == tGrant {
				entry = addrSize
				if fr.count != 0 && fr.status != stOK {
					t.Fatalf("refusal with %d staged addresses", fr.count)
				}
			}
			if len(fr.table) != int(fr.count)*entry || int(fr.count) > lim.maxRanges {
				t.Fatalf("frame type %d with %d entries and a table of %d bytes", fr.typ, fr.count, len(fr.table))
			}
		}
	})
}

// FuzzHandshake feeds arbitrary bytes to the handshake decoder.
func FuzzHandshake(f *testing.F) {
	var hs [hsSize]byte
	(&handshake{pid: 1, probe: 0x1000}).put(hs[:])
	f.Add(hs[:])
	f.Add([]byte("GXCM"))
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) < hsSize {
			data = append(data, make([]byte, hsSize-len(data))...)
		}
		h, err := getHandshake(data)
		if err == nil {
			var out [hsSize]byte
			h.put(out[:])
			h2, err := getHandshake(out[:])
			require.NoError(t, err)
			require.Equal(t, h, h2)
		}
	})
}

// FuzzServerFrames sends arbitrary bytes to an exposing agent after a valid
// handshake: it must answer or drop the connection, never hang, and never
// let read-only memory change.
func FuzzServerFrames(f *testing.F) {
	a, b := newAgent(f, WithTimeout(time.Second))
	src := bytes.Repeat([]byte{0x5A}, 4096)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(f, err)
	addr := agent.DRAM(src).Addr
	for _, s := range frameSeeds() {
		f.Add(s)
	}
	f.Add(frameBytes(header{typ: tBegin, status: 1, count: 1, id: 1, key: exp.Key()}, [][2]uint64{{addr, 16}}, nil))
	f.Add(append(frameBytes(header{typ: tBegin, status: 1, count: 1, id: 1, key: exp.Key()}, [][2]uint64{{addr, 16}}, nil),
		frameBytes(header{typ: tEnd, id: 1}, nil, nil)...))
	f.Add(frameBytes(header{typ: tNotify, length: 2, key: exp.Key()}, nil, []byte("hi")))
	f.Fuzz(func(t *testing.T, data []byte) {
		p := dialRaw(t, b)
		if _, err := p.hello(a.ID(), os.Getpid()); err != nil {
			t.Fatal(err)
		}
		if _, err := p.c.Write(data); err != nil && !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "reset") && !strings.Contains(err.Error(), "broken pipe") {
			t.Fatal(err)
		}
		_ = p.c.CloseWrite()
		_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err := io.Copy(io.Discard, p.br)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("server neither answered nor dropped the connection")
		}
		if !bytes.Equal(src, bytes.Repeat([]byte{0x5A}, 4096)) {
			t.Fatal("read-only exposed memory changed")
		}
	})
}

// FuzzStagedAddrs decodes arbitrary grants against a request of ranges
// whose count and lengths the input chooses too: stagedAddrs never panics,
// and what it accepts is one address per range, none 0, none whose range
// wraps.
func FuzzStagedAddrs(f *testing.F) {
	f.Add(uint8(2), uint64(4096), grantBytes(header{typ: tGrant, status: stOK, count: 2, id: 1}, []uint64{0x1000, 0x2000}))
	f.Add(uint8(2), uint64(4096), grantBytes(header{typ: tGrant, status: stOK, count: 1, id: 1}, []uint64{0x1000}))
	f.Add(uint8(1), uint64(1<<20), grantBytes(header{typ: tGrant, status: stOK, count: 1, id: 1}, []uint64{^uint64(0) - 100}))
	f.Add(uint8(3), uint64(1), grantBytes(header{typ: tGrant, status: stOK, id: 1}, nil))
	lim := limits{maxRanges: 64, maxNotify: 1 << 10}
	f.Fuzz(func(t *testing.T, ranges uint8, n uint64, data []byte) {
		var hdr [hdrSize]byte
		var buf []byte
		var fr frame
		if readFrame(bytes.NewReader(data), hdr[:], &buf, lim, &fr) != nil || fr.typ != tGrant {
			return
		}
		addrs, err := stagedAddrs(&fr, int(ranges), fuzzLens(ranges, n))
		if err != nil {
			if !errors.Is(err, errProtocol) {
				t.Fatalf("unexpected error %v", err)
			}
			return
		}
		if addrs == nil {
			if fr.count != 0 {
				t.Fatalf("a table of %d addresses decoded as none", fr.count)
			}
			return
		}
		if len(addrs) != int(ranges) {
			t.Fatalf("%d addresses for %d ranges", len(addrs), ranges)
		}
		for i, a := range addrs {
			if a == 0 || a+n+uint64(i) < a {
				t.Fatalf("range %d of %d bytes accepted at 0x%x", i, n+uint64(i), a)
			}
		}
	})
}

// FuzzClientGrants answers a copying agent's lease request with arbitrary
// bytes, staged addresses included, then hangs up: the READ ends, whatever
// it was told, and the agent neither panics nor hangs.
func FuzzClientGrants(f *testing.F) {
	staged := bytes.Repeat([]byte{0x3C}, 4096)
	at := uint64(uintptrOf(&staged[0]))
	f.Add(grantBytes(header{typ: tGrant, status: stOK, id: 1}, nil))
	f.Add(grantBytes(header{typ: tGrant, status: stOK, count: 1, id: 1}, []uint64{at}))
	f.Add(grantBytes(header{typ: tGrant, status: stOK, count: 1, id: 1}, []uint64{0x1000}))
	f.Add(grantBytes(header{typ: tGrant, status: stOK, count: 2, id: 1}, []uint64{at, at}))
	f.Add(grantBytes(header{typ: tGrant, status: stOK, count: 1, id: 2}, []uint64{at}))
	f.Add(frameBytes(header{typ: tGrant, status: stDenied, id: 1, length: 4}, nil, []byte("nope")))
	f.Add([]byte("GXCM garbage"))
	a, _ := newAgent(f, WithTimeout(time.Second))
	orig := make([]byte, 4096)
	f.Fuzz(func(t *testing.T, data []byte) {
		fk := newFakeExposer(t, func(c *net.UnixConn, br *bufio.Reader) {
			var hdr [hdrSize]byte
			var buf []byte
			var fr frame
			if readFrame(br, hdr[:], &buf, limits{maxRanges: 4096, maxNotify: 64 << 10}, &fr) != nil {
				return
			}
			_, _ = c.Write(data)
			_ = c.Close()
		})
		dst := make([]byte, 4096)
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: fk.info, Key: agent.NewKey(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(orig).Region}}})
		if err != nil {
			return // not reachable: nothing asked
		}
		select {
		case <-x.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the READ did not end")
		}
	})
}

// shareBytes encodes a tShare for sh.
func shareBytes(sh devmem.Share) []byte {
	b := make([]byte, hdrSize, hdrSize+shareSize)
	(&header{typ: tShare, status: uint8(sh.Kind), id: sh.ID, length: shareSize}).put(b)
	return putShare(b, sh)
}

// entryBytes encodes a grant whose table holds (address, share) entries.
func entryBytes(h header, es ...grantEntry) []byte {
	b := make([]byte, hdrSize)
	h.put(b)
	for _, e := range es {
		b = binary.LittleEndian.AppendUint64(b, e.addr)
		b = binary.LittleEndian.AppendUint64(b, e.share)
	}
	return b
}

// FuzzDeviceFrames decodes arbitrary frames as a copier on a connection
// that agreed capDevice does, then the device parts of what it accepts
// (getShare, grantEntries, for a request whose range count and lengths
// the input chooses): nothing panics, every refusal is a protocol
// violation, a share that decodes spans a range that neither is empty
// nor wraps and encodes back to the same bytes, and a grant's entries are
// one per range, none at 0, none whose range wraps.
func FuzzDeviceFrames(f *testing.F) {
	h := devmem.Share{Kind: devmem.ShareHandle, GPU: [16]byte{1, 2}, ID: 7, Base: 0x7f0000000000, Size: 1 << 21, FD: -1}
	h.Handle[0], h.Handle[63] = 0xAA, 0x55
	f.Add(uint8(2), uint64(4096), shareBytes(h))
	f.Add(uint8(1), uint64(1), shareBytes(devmem.Share{Kind: devmem.ShareFD, ID: 8, Base: 0x1000, Size: 4096}))
	f.Add(uint8(1), uint64(1), shareBytes(devmem.Share{Kind: devmem.ShareFD, ID: 9, Base: ^uintptr(0) - 10, Size: 4096}))
	f.Add(uint8(2), uint64(4096), entryBytes(header{typ: tGrant, status: stOK, count: 2, id: 1}, grantEntry{0x1000, 7}, grantEntry{0x2000, 0}))
	f.Add(uint8(2), uint64(4096), entryBytes(header{typ: tGrant, status: stOK, count: 1, id: 1}, grantEntry{0x1000, 7}))
	f.Add(uint8(1), uint64(1<<20), entryBytes(header{typ: tGrant, status: stOK, count: 1, id: 1}, grantEntry{^uint64(0) - 100, 7}))
	f.Add(uint8(1), uint64(1), frameBytes(header{typ: tUnshare, id: 7}, nil, nil))
	f.Add(uint8(1), uint64(1), frameBytes(header{typ: tUnshare}, nil, nil))
	lim := limits{maxRanges: 64, maxNotify: 1 << 10, entry: devEntrySize}
	f.Fuzz(func(t *testing.T, ranges uint8, n uint64, data []byte) {
		r := bytes.NewReader(data)
		var hdr [hdrSize]byte
		var buf []byte
		var fr frame
		for {
			err := readFrame(r, hdr[:], &buf, lim, &fr)
			if err != nil {
				if !errors.Is(err, errProtocol) && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
					t.Fatalf("unexpected error %v", err)
				}
				return
			}
			switch fr.typ {
			case tShare:
				sh, err := getShare(&fr)
				if err != nil {
					if !errors.Is(err, errProtocol) {
						t.Fatalf("unexpected error %v", err)
					}
					continue
				}
				if sh.size == 0 || sh.base == 0 || sh.base+sh.size < sh.base {
					t.Fatalf("share [0x%x, +%d) accepted", sh.base, sh.size)
				}
				back := putShare(nil, devmem.Share{Kind: sh.kind, GPU: sh.gpu, ID: sh.id, Base: uintptr(sh.base), Size: sh.size, Handle: sh.hdl})
				if sh.kind == devmem.ShareHandle && !bytes.Equal(back, fr.payload) {
					t.Fatalf("share %d encodes back as %x, decoded from %x", sh.id, back, fr.payload)
				}
			case tGrant:
				es, err := grantEntries(&fr, int(ranges), fuzzLens(ranges, n))
				if err != nil {
					if !errors.Is(err, errProtocol) {
						t.Fatalf("unexpected error %v", err)
					}
					continue
				}
				if es == nil {
					if fr.count != 0 {
						t.Fatalf("a table of %d entries decoded as none", fr.count)
					}
					continue
				}
				if len(es) != int(ranges) {
					t.Fatalf("%d entries for %d ranges", len(es), ranges)
				}
				for i, e := range es {
					if e.addr == 0 || e.addr+n+uint64(i) < e.addr {
						t.Fatalf("range %d of %d bytes accepted at 0x%x", i, n+uint64(i), e.addr)
					}
				}
			}
		}
	})
}

// fuzzLens yields the lengths of a request of ranges ranges, the i-th
// n+i bytes, as the grant decoders take them.
func fuzzLens(ranges uint8, n uint64) func(func(uint64) bool) {
	return func(yield func(uint64) bool) {
		for i := range int(ranges) {
			if !yield(n + uint64(i)) {
				return
			}
		}
	}
}
