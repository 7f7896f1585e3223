//go:build linux

package cma

import (
	"bytes"
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
)

func frameBytes(h header, table [][2]uint64, payload []byte) []byte {
	b := make([]byte, hdrSize)
	h.put(b)
	for _, r := range table {
		b = binary.LittleEndian.AppendUint64(b, r[0])
		b = binary.LittleEndian.AppendUint64(b, r[1])
	}
	return append(b, payload...)
}

func frameSeeds() [][]byte {
	key := agent.Key{1, 2, 3}
	return [][]byte{
		frameBytes(header{typ: tBegin, status: 1, count: 1, id: 1, key: key}, [][2]uint64{{0x1000, 16}}, nil),
		frameBytes(header{typ: tBegin, status: 2, count: 2, id: 2, key: key}, [][2]uint64{{0x1000, 16}, {0x2000, 1}}, nil),
		frameBytes(header{typ: tGrant, status: stDenied, id: 1, length: 4}, nil, []byte("nope")),
		frameBytes(header{typ: tEnd, id: 1}, nil, nil),
		frameBytes(header{typ: tNotify, length: 3, key: key}, nil, []byte("hey")),
		frameBytes(header{typ: tBye}, nil, nil),
		[]byte("GXCM garbage"),
	}
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
			if len(fr.table) != int(fr.count)*rangeSize || int(fr.count) > lim.maxRanges {
				t.Fatalf("frame with %d ranges and a table of %d bytes", fr.count, len(fr.table))
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
