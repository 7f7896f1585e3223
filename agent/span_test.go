package agent

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestSpan(t *testing.T) {
	seg := func(n uint64) Segment { return Segment{Local: Local{Region: Region{Len: n}}, Remote: Region{Len: n}} }
	segs := []Segment{seg(10), seg(3), seg(20)}
	cases := []struct {
		name      string
		from      Cursor
		maxBytes  uint64
		maxPieces int
		end       Cursor
		n         uint64
		pieces    int
	}{
		{"all at once", Cursor{}, 100, 100, Cursor{Seg: 3}, 33, 3},
		{"cut inside a segment", Cursor{}, 12, 100, Cursor{Seg: 1, Off: 2}, 12, 2},
		{"resume mid-segment", Cursor{Seg: 1, Off: 2}, 100, 100, Cursor{Seg: 3}, 21, 2},
		{"piece limit", Cursor{}, 100, 2, Cursor{Seg: 2}, 13, 2},
		{"ends exactly on a segment", Cursor{}, 10, 100, Cursor{Seg: 1}, 10, 1},
		{"already at the end", Cursor{Seg: 3}, 100, 100, Cursor{Seg: 3}, 0, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			end, n, pieces := Span(segs, tc.from, tc.maxBytes, tc.maxPieces)
			assert.Equal(t, tc.end, end)
			assert.Equal(t, tc.n, n)
			assert.Equal(t, tc.pieces, pieces)
		})
	}
}

func TestPiecesWalkASpan(t *testing.T) {
	mem := make([]byte, 33)
	for i := range mem {
		mem[i] = byte(i)
	}
	seg := func(from, n uint64) Segment {
		return Segment{Local: DRAM(mem[from : from+n]), Remote: Region{Addr: 0x1000 + 2*from, Len: n}}
	}
	segs := []Segment{seg(0, 10), seg(10, 3), seg(13, 20)}
	for _, tc := range []struct {
		name     string
		from     Cursor
		maxBytes uint64
	}{
		{"all at once", Cursor{}, 100},
		{"cut inside a segment", Cursor{}, 12},
		{"resume mid-segment", Cursor{Seg: 1, Off: 2}, 100},
		{"ends exactly on a segment", Cursor{}, 10},
		{"already at the end", Cursor{Seg: 3}, 100},
	} {
		t.Run(tc.name, func(t *testing.T) {
			end, n, pieces := Span(segs, tc.from, tc.maxBytes, 100)
			var got []Piece
			var bytes []byte
			total := uint64(0)
			for p := range Pieces(segs, tc.from, n) {
				got = append(got, p)
				bytes = append(bytes, p.Local()...)
				assert.Equal(t, p.Seg.Remote.Addr+p.Off, p.RemoteAddr())
				assert.Equal(t, p.Seg.Local.Addr+p.Off, p.LocalAddr())
				total += p.Len
			}
			assert.Len(t, got, pieces, "Pieces yields the pieces Span counted")
			assert.Equal(t, n, total)
			if len(got) > 0 {
				first := got[0]
				assert.Equal(t, &segs[tc.from.Seg], first.Seg)
				assert.Equal(t, tc.from.Off, first.Off)
				start := first.LocalAddr() - segs[0].Local.Addr
				assert.Equal(t, mem[start:start+n], bytes, "the pieces are the span's bytes, in order")
				last := got[len(got)-1]
				if end.Seg < len(segs) && end.Off > 0 {
					assert.Equal(t, &segs[end.Seg], last.Seg)
					assert.Equal(t, end.Off, last.Off+last.Len)
				}
			}
		})
	}
	t.Run("break stops the walk", func(t *testing.T) {
		seen := 0
		for range Pieces(segs, Cursor{}, 33) {
			seen++
			break
		}
		assert.Equal(t, 1, seen)
	})
	t.Run("device memory has no local bytes", func(t *testing.T) {
		dev := []Segment{{Local: Device(0x9000, 64, KindVRAM, 0), Remote: Region{Addr: 0x2000, Len: 64}}}
		for p := range Pieces(dev, Cursor{Off: 8}, 16) {
			assert.Nil(t, p.Local())
			assert.Equal(t, uint64(0x9008), p.LocalAddr())
			assert.Equal(t, uint64(0x2008), p.RemoteAddr())
		}
	})
}
