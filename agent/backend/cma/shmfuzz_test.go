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
// protocol violation, and a granted mapping answer decodes into entries
// that neither wrap nor are empty.
func FuzzShmFrames(f *testing.F) {
	lim := limits{maxRanges: 64, maxNotify: 1 << 10, shm: true}
	ans := putMapAnswer(nil, mapAnswer{slot: 3, gen: 9, entries: []mapEntry{{addr: 0x1000, n: 4096, seg: 1, off: 0}}})
	f.Add(frameBytes(header{typ: tMapped, status: stOK, count: 1, id: 7, length: mapAnswerSize}, nil, ans))
	f.Add(frameBytes(header{typ: tMapped, status: stNone, id: 7}, nil, nil))
	f.Add(frameBytes(header{typ: tMapped, status: stDenied, id: 7, length: 2}, nil, []byte("no")))
	seg := binary.LittleEndian.AppendUint64(nil, 1<<20)
	f.Add(frameBytes(header{typ: tSeg, id: 1, length: segInfoSize}, nil, seg))
	f.Add(frameBytes(header{typ: tTable, id: uint64(tableSize(maxSlots))}, nil, nil))
	f.Add(frameBytes(header{typ: tUnmap, id: 2, status: 1}, nil, nil))
	f.Add(frameBytes(header{typ: tSegDrop, id: 1}, nil, nil))
	f.Add(frameBytes(header{typ: tMap, status: 1, id: 1}, nil, nil))
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
			if cap(buf) > maxMapEntries*mapEntrySize+maxErrMsg+lim.maxNotify {
				t.Fatalf("buffer of %d bytes", cap(buf))
			}
			if fr.typ != tMapped || fr.status != stOK {
				continue
			}
			a, err := getMapAnswer(&fr)
			if err != nil {
				if !errors.Is(err, errProtocol) {
					t.Fatalf("error %v does not wrap errProtocol", err)
				}
				continue
			}
			if len(a.entries) != int(fr.count) {
				t.Fatalf("%d entries decoded of %d", len(a.entries), fr.count)
			}
			for _, e := range a.entries {
				if e.n == 0 || e.addr+e.n < e.addr || e.off+e.n < e.off {
					t.Fatalf("accepted entry %+v", e)
				}
			}
		}
	})
}
