package connect

import (
	"cmp"
	"errors"
	"fmt"
	"slices"

	"github.com/goxfer/goxfer/agent"
)

// ErrInvalidSpan reports a [Span] that [Metadata.Select] cannot take: it
// names a descriptor the token does not have, bytes past a descriptor's
// end, a negative offset or length, or, in a WRITE token, bytes another
// span names too.
var ErrInvalidSpan = errors.New("connect: invalid span")

// Span names bytes of one descriptor of a token, for [Metadata.Select]:
// Length bytes from Offset within descriptor Index (an index into the
// token's descriptors, as in [Metadata.Sizes]). A Length of 0 means up to
// the descriptor's end, so Span{Index: i} is descriptor i whole. A span
// always names at least one byte.
type Span struct {
	Index  int
	Offset int
	Length int
}

// Select returns a token that names only the bytes spans name, one
// descriptor per span, in the order given: a reader holding some blocks
// already (prefix caching) reads the others, a pipelined reader reads
// layer i as soon as it is ready. The narrowed token carries the same key,
// for the same passive operation, and is checked by the exposing side like
// any other: it can never reach past what was exposed, and a token widened
// beyond that by hand is refused ([ErrAccessDenied]). Select narrows what
// an operation moves, not what the key grants: a holder of the narrowed
// token may widen it back to the whole exposure. To grant a peer less,
// expose less.
// [Connector.BeginRead] and [Connector.BeginWrite] take local descriptors
// of the narrowed sizes ([Metadata.Sizes]), and the passive side completes
// as with the whole token: its Wait returns the first outcome a reader or
// writer reports, here that of the first selection to finish. Until the
// passive operation is closed the token, whole or narrowed, may be used
// again, so read the parts in several operations, and close the passive
// side once the last part is done (it learns that from you, not from the
// first part's completion).
//
// Spans may repeat or overlap in a READ token (reading the same bytes
// twice is well defined), not in a WRITE token, where which bytes were
// written last would depend on the backend. Select may narrow a narrowed token
// again; spans then index its descriptors. A compact token stays compact.
//
// A span out of range, or none, fails with [ErrInvalidSpan], naming the
// span, what was expected and what was found; the zero Metadata fails with
// [ErrInvalidMetadata]. m is not modified.
func (m Metadata) Select(spans ...Span) (Metadata, error) {
	if m.kind == 0 {
		return Metadata{}, fmt.Errorf("%w: Select on the zero Metadata", ErrInvalidMetadata)
	}
	if len(spans) == 0 {
		return Metadata{}, fmt.Errorf("%w: want at least one span, found none", ErrInvalidSpan)
	}
	regions := make([]agent.Region, len(spans))
	for i, s := range spans {
		if s.Index < 0 || s.Index >= len(m.regions) {
			return Metadata{}, fmt.Errorf("%w: span %d: want a descriptor index in [0, %d), found %d", ErrInvalidSpan, i, len(m.regions), s.Index)
		}
		r := m.regions[s.Index]
		size := int(r.Len) // decoding bounds each size by math.MaxInt
		switch {
		case s.Offset < 0 || s.Offset >= size:
			return Metadata{}, fmt.Errorf("%w: span %d: descriptor %d has %d bytes: want an offset in [0, %d), found %d", ErrInvalidSpan, i, s.Index, size, size, s.Offset)
		case s.Length < 0:
			return Metadata{}, fmt.Errorf("%w: span %d: want a length of 0 (to the end) or more, found %d", ErrInvalidSpan, i, s.Length)
		case s.Length > size-s.Offset:
			return Metadata{}, fmt.Errorf("%w: span %d: descriptor %d has %d bytes: want at most %d from offset %d, found a length of %d", ErrInvalidSpan, i, s.Index, size, size-s.Offset, s.Offset, s.Length)
		}
		n := s.Length
		if n == 0 {
			n = size - s.Offset
		}
		r.Addr += uint64(s.Offset)
		r.Len = uint64(n)
		regions[i] = r
	}
	if m.kind == KindWrite {
		if err := checkDisjoint(spans, regions); err != nil {
			return Metadata{}, err
		}
	}
	m.regions = regions
	return m, nil
}

// checkDisjoint refuses spans that name a byte of a descriptor twice.
func checkDisjoint(spans []Span, regions []agent.Region) error {
	order := make([]int, len(spans))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		return cmp.Or(cmp.Compare(spans[a].Index, spans[b].Index), cmp.Compare(spans[a].Offset, spans[b].Offset))
	})
	for k := 1; k < len(order); k++ {
		a, b := order[k-1], order[k]
		if spans[a].Index == spans[b].Index && spans[b].Offset < spans[a].Offset+int(regions[a].Len) {
			a, b = min(a, b), max(a, b)
			return fmt.Errorf("%w: spans %d and %d of a WRITE token overlap: want disjoint spans, found %s and %s",
				ErrInvalidSpan, a, b, spanText(spans[a], regions[a]), spanText(spans[b], regions[b]))
		}
	}
	return nil
}

// spanText describes a span by its descriptor and the bytes it covers.
func spanText(s Span, r agent.Region) string {
	return fmt.Sprintf("descriptor %d [%d, %d)", s.Index, s.Offset, s.Offset+int(r.Len))
}
