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
