package cma

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"testing"
)

// FuzzLeaseTable checks the lease table's header decoder against arbitrary
// bytes and sizes: it accepts only headers whose slots fit the file, and
// what it accepts round-trips.
func FuzzLeaseTable(f *testing.F) {
	good := make([]byte, tableSize(4))
	putTable(good, 4)
	f.Add(good, uint64(len(good)))
	f.Add(good[:tableHeader], uint64(tableHeader))
	f.Add([]byte("GXLT"), uint64(4))
	f.Fuzz(func(t *testing.T, b []byte, size uint64) {
		n, err := parseTable(b, size)
		if err != nil {
			if !errors.Is(err, errProtocol) {
				t.Fatalf("error %v does not wrap errProtocol", err)
			}
			return
		}
		if n < 1 || n > maxSlots || uint64(tableSize(n)) > size {
			t.Fatalf("accepted %d slots in a table of %d bytes", n, size)
		}
		again := make([]byte, tableHeader)
		putTable(again, n)
		if m, err := parseTable(again, uint64(tableSize(n))); err != nil || m != n {
			t.Fatalf("round trip of %d slots: %d, %v", n, m, err)
		}
	})
}

// FuzzShmFrames reads arbitrary frames on a connection that agreed shared
// memory: every frame is accepted whole within the limits or refused as a
// protocol violation, and a segment decodes into a span that neither
// wraps nor is empty.
func FuzzShmFrames(f *testing.F) {
	lim := limits{maxRanges: 64, maxNotify: 1 << 10, shm: true}
	f.Add(frameBytes(header{typ: tSeg, id: 1, length: segInfoSize}, nil, putSeg(nil, 1<<20, 0x7000_0000)))
	f.Add(frameBytes(header{typ: tSeg, id: 1, length: segInfoSize}, nil, putSeg(nil, 1<<20, ^uint64(0)-10)))
	f.Add(frameBytes(header{typ: tTable, id: uint64(tableSize(maxSlots))}, nil, nil))
	f.Add(frameBytes(header{typ: tSegDrop, id: 1}, nil, nil))
	f.Add(frameBytes(header{typ: tUse, status: 1, key: [16]byte{1}}, nil, nil))
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
				return
			}
			if cap(buf) > lim.maxRanges*rangeSize+maxErrMsg+lim.maxNotify {
				t.Fatalf("buffer of %d bytes", cap(buf))
			}
			if fr.typ != tSeg {
				continue
			}
			s, err := getSeg(&fr)
			if err != nil {
				if !errors.Is(err, errProtocol) {
					t.Fatalf("error %v does not wrap errProtocol", err)
				}
				continue
			}
			if s.id == 0 || s.size == 0 || s.base == 0 || s.base+s.size < s.base {
				t.Fatalf("accepted segment %+v", s)
			}
		}
	})
}

// frameBytes encodes a frame: its header, a table of ranges, a payload.
func frameBytes(h header, table [][2]uint64, payload []byte) []byte {
	b := make([]byte, hdrSize)
	h.put(b)
	for _, r := range table {
		b = binary.LittleEndian.AppendUint64(b, r[0])
		b = binary.LittleEndian.AppendUint64(b, r[1])
	}
	return append(b, payload...)
}
