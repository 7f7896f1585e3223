// Package wire holds the bounded little-endian decoding that goxfer's binary
// formats (tokens, notifications) share. Everything it reads is treated as
// untrusted: reads never run past the input, never panic, and allocate
// nothing but the error; the first failure sticks and names the field and
// offset.
package wire

import (
	"encoding/binary"
	"fmt"
)

// Reader reads fields from a byte slice. The zero Reader reads nothing.
// Once a read fails, every later read returns zero values and Err keeps the
// first failure. A Reader is not safe for concurrent use.
type Reader struct {
	b   []byte
	off int // offset of b[0] in the caller's input, for error messages
	err error
}

// NewReader returns a Reader over b. base is the offset of b[0] within the
// larger input the caller is decoding; errors report offsets relative to it.
func NewReader(b []byte, base int) *Reader { return &Reader{b: b, off: base} }

// Err returns the first failure, or nil.
func (r *Reader) Err() error { return r.err }

// Remaining returns how many bytes are left unread.
func (r *Reader) Remaining() int { return len(r.b) }

// Offset returns the input offset of the next byte to read.
func (r *Reader) Offset() int { return r.off }

// Failf records a failure at the current offset, unless one is already
// recorded, so that callers validating a field they just read report it the
// same way as a short read. Later reads fail.
func (r *Reader) Failf(format string, args ...any) { r.FailAtf(r.off, format, args...) }

// FailAtf is Failf for a failure found at input offset off, typically the
// start of a field already read.
func (r *Reader) FailAtf(off int, format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("offset %d: %s", off, fmt.Sprintf(format, args...))
	}
	r.b = nil
}

// Bytes returns the next n bytes without copying them: the result aliases
// the input.
func (r *Reader) Bytes(n int, field string) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || n > len(r.b) {
		r.Failf("%s: want %d bytes, found %d", field, n, len(r.b))
		return nil
	}
	v := r.b[:n:n]
	r.b, r.off = r.b[n:], r.off+n
	return v
}

// Byte returns the next byte.
func (r *Reader) Byte(field string) byte {
	if b := r.Bytes(1, field); b != nil {
		return b[0]
	}
	return 0
}

// U64 returns the next 8 bytes as a little-endian uint64.
func (r *Reader) U64(field string) uint64 {
	if b := r.Bytes(8, field); b != nil {
		return binary.LittleEndian.Uint64(b)
	}
	return 0
}

// Uvarint returns the next unsigned varint (encoding/binary's format). It
// refuses overlong and overflowing encodings, so every value has exactly one
// encoding.
func (r *Reader) Uvarint(field string) uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	switch {
	case n == 0:
		r.Failf("%s: want a varint, found %d bytes ending mid-varint", field, len(r.b))
		return 0
	case n < 0:
		r.Failf("%s: varint overflows 64 bits", field)
		return 0
	case n > 1 && r.b[n-1] == 0:
		r.Failf("%s: overlong varint", field)
		return 0
	}
	r.b, r.off = r.b[n:], r.off+n
	return v
}

// UvarintLen returns how many bytes binary.AppendUvarint uses for v.
func UvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}
