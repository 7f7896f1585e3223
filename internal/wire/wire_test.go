package wire

import (
	"encoding/binary"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestReader(t *testing.T) {
	var in []byte
	in = append(in, 7)
	in = binary.LittleEndian.AppendUint64(in, 0x0102030405060708)
	in = binary.AppendUvarint(in, 300)
	in = append(in, "abc"...)

	r := NewReader(in, 10)
	assert.Equal(t, byte(7), r.Byte("b"))
	assert.Equal(t, uint64(0x0102030405060708), r.U64("u"))
	assert.Equal(t, uint64(300), r.Uvarint("v"))
	assert.Equal(t, 3, r.Remaining())
	assert.Equal(t, 10+1+8+2, r.Offset())
	assert.Equal(t, []byte("abc"), r.Bytes(3, "s"))
	require.NoError(t, r.Err())
	assert.Equal(t, 0, r.Remaining())
}

func TestReaderFailures(t *testing.T) {
	tests := []struct {
		name string
		in   []byte
		read func(r *Reader)
		want string
	}{
		{"short u64", []byte{1, 2, 3}, func(r *Reader) { r.U64("addr") }, "offset 4: addr: want 8 bytes, found 3"},
		{"short bytes", []byte{1}, func(r *Reader) { r.Bytes(2, "key") }, "offset 4: key: want 2 bytes, found 1"},
		{"negative length", []byte{1}, func(r *Reader) { r.Bytes(-1, "key") }, "offset 4: key: want -1 bytes, found 1"},
		{"empty byte", nil, func(r *Reader) { r.Byte("kind") }, "offset 4: kind: want 1 bytes, found 0"},
		{"unterminated varint", []byte{0x80, 0x80}, func(r *Reader) { r.Uvarint("n") }, "offset 4: n: want a varint, found 2 bytes ending mid-varint"},
		{"overflowing varint", []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}, func(r *Reader) { r.Uvarint("n") }, "offset 4: n: varint overflows 64 bits"},
		{"overlong varint", []byte{0x81, 0x00}, func(r *Reader) { r.Uvarint("n") }, "offset 4: n: overlong varint"},
		{"fail at", []byte{1, 2}, func(r *Reader) { r.Byte("a"); r.FailAtf(4, "a: want 0, found %d", 1) }, "offset 4: a: want 0, found 1"},
		{"first failure sticks", []byte{1}, func(r *Reader) { r.U64("a"); r.Byte("b"); r.Failf("later") }, "offset 4: a: want 8 bytes, found 1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := NewReader(tt.in, 4)
			tt.read(r)
			require.EqualError(t, r.Err(), tt.want)
			assert.Zero(t, r.Byte("after"), "reads after a failure return zero")
			assert.Zero(t, r.Remaining())
		})
	}
}

func TestUvarintLen(t *testing.T) {
	for _, v := range []uint64{0, 1, 127, 128, 16383, 16384, 1 << 35, math.MaxUint64} {
		assert.Equal(t, len(binary.AppendUvarint(nil, v)), UvarintLen(v), "v=%d", v)
	}
}
