package framehdr

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestHeaderRoundTrip(t *testing.T) {
	h := Header{Type: 3, Status: 7, Count: 0x01020304, ID: 0x1122334455667788, Length: 0x0a0b0c0d0e0f1011}
	copy(h.Key[:], "0123456789abcdef")
	b := bytes.Repeat([]byte{0xff}, HeaderSize)
	h.Put(b)
	assert.Equal(t, []byte{3, 7, 0, 0, 4, 3, 2, 1}, b[:8], "type, status, zeros, count")
	var got Header
	got.Get(b)
	assert.Equal(t, h, got)
}

// A 32-bit length followed by four zero bytes, as cma documents it, is the
// same bytes as the 64-bit length.
func TestHeaderLengthIsCMACompatible(t *testing.T) {
	b := make([]byte, HeaderSize)
	(&Header{Length: 0xdeadbeef}).Put(b)
	assert.Equal(t, []byte{0xef, 0xbe, 0xad, 0xde, 0, 0, 0, 0}, b[16:24])
}

func FuzzHeader(f *testing.F) {
	f.Add(make([]byte, HeaderSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) < HeaderSize {
			return
		}
		var h Header
		h.Get(b)
		out := make([]byte, HeaderSize)
		h.Put(out)
		var again Header
		again.Get(out)
		assert.Equal(t, h, again)
		assert.Equal(t, b[4:HeaderSize], out[4:HeaderSize], "only the type, status and reserved bytes may differ")
		assert.Equal(t, b[:2], out[:2])
	})
}
