// Package framehdr encodes the fixed 40-byte header that starts every frame of
// goxfer's socket backends, tcp and cma: written once, so that both read
// and write it the same way. What follows the header (piece tables,
// payloads, error texts) and the handshakes stay each backend's own.
//
// The layout, all integers little-endian:
//
//	 0  type    u8
//	 1  status  u8
//	 2  -       u16  zero
//	 4  count   u32  entries in the table that follows
//	 8  id      u64  request number
//	16  length  u64  payload bytes after the table
//	24  key     [16]byte
//
// cma's wire format documents length as u32 followed by four zero bytes:
// for its lengths, which fit in 32 bits, the two layouts are the same
// bytes, and cma reads only the low half, as it always has.
package framehdr

import "encoding/binary"

// HeaderSize is the length of an encoded Header.
const HeaderSize = 40

// Header is a frame header, decoded. The zero value is a valid header of
// type 0.
type Header struct {
	Type   uint8
	Status uint8
	Count  uint32
	ID     uint64
	Length uint64
	Key    [16]byte
}

// Put encodes h into b[:HeaderSize]; b must be at least that long. The
// reserved bytes are written as zeros.
func (h *Header) Put(b []byte) {
	_ = b[HeaderSize-1]
	b[0], b[1], b[2], b[3] = h.Type, h.Status, 0, 0
	binary.LittleEndian.PutUint32(b[4:], h.Count)
	binary.LittleEndian.PutUint64(b[8:], h.ID)
	binary.LittleEndian.PutUint64(b[16:], h.Length)
	copy(b[24:HeaderSize], h.Key[:])
}

// Get decodes b[:HeaderSize] into h; b must be at least that long. The
// reserved bytes are ignored: checking them is the caller's choice.
func (h *Header) Get(b []byte) {
	_ = b[HeaderSize-1]
	h.Type, h.Status = b[0], b[1]
	h.Count = binary.LittleEndian.Uint32(b[4:])
	h.ID = binary.LittleEndian.Uint64(b[8:])
	h.Length = binary.LittleEndian.Uint64(b[16:])
	copy(h.Key[:], b[24:HeaderSize])
}
