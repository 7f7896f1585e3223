package cma

import (
	"encoding/binary"
	"fmt"
)

// Shared host memory (capShm): the frames and the lease table.
//
// When both agents agree capShm, the exposing side creates a lease table
// for the connection (a memory file both processes map) and sends it right
// after the handshake (tTable). It then publishes in the table every
// exposure of its memory that lies in shared segments (package shm), when
// the exposure is created or, for those that exist, when the connection
// is made: a slot per exposure, found by hashing its key, holding the key,
// the access, the span of its regions and a stamp. Each segment such an
// exposure lies in is sent to the copier once per connection (tSeg), with
// where it lies in the exposing process. A copier that holds a key finds
// the slot, checks every range against the slot's span and the segments it
// mapped, and copies through its mapping with no round trip; anything it
// does not find goes to leases. An exposure of ordinary host memory (the
// Go heap, anything outside shared segments) is published too, when it
// has a single region (flags = slotWhole, no segments, span = the region):
// a copier whose every range lies inside that span enters the slot and
// copies with process_vm_readv/writev on the exposing process, with no
// round trip either (WithLeaseFree; transfers of up to shmInline bytes,
// larger ones go to leases). A copier
// that uses a slot writes the key itself into it (proof): the exposing
// side binds the exposure to the connection only for a proof that hashes
// to the slot's hash, so that the exposure hears of the loss of a copier
// that used it, and of no other.
//
//	tTable:   id = the table's size in bytes; the file by SCM_RIGHTS
//	tSeg:     id = the segment (nonzero); payload: its size u64, its
//	          address in the exposing process u64; the file by SCM_RIGHTS
//	tSegDrop: id = the segment: no exposure published on the connection
//	          lies in it any more; the copier unmaps it once its copies
//	          through it returned
//	tUse:     copier → exposing: key, status = access: a transfer of more
//	          than shmInline bytes through the exposure begins; the
//	          exposing side binds the exposure to the connection (the key
//	          checked as for a lease), so that it hears of the copier's
//	          loss in the middle of it
//
// The lease table: a header, then slots. Every integer is little-endian,
// every word naturally aligned.
//
//	header (tableHeader bytes)
//	  0  magic    "GXLT"
//	  4  version  u16 (tableVersion)
//	  6  slotSize u16 (slotSize)
//	  8  slots    u32 (a power of two, 1 to maxSlots)
//	 12  -        zeros to the end of the header
//	slot i, at tableHeader + i*slotSize
//	  0  readers  u32  copies in progress through the slot (a futex word)
//	  4  waiting  u32  nonzero while the exposing side waits for readers
//	  8  stamp    u64  generation<<2 | state (0 free, slotLive,
//	                   slotRevoked, slotClosed: revoked because the agent
//	                   is closing)
//	 16  hash     [16]byte  SHA-256 of the key, first 16 bytes
//	 32  lo       u64  the lowest address of the exposure's regions
//	 40  hi       u64  the end of its highest
//	 48  access   u32
//	 52  segs     u32  segments the exposure lies in
//	 56  flags    u32  slotWhole: no segments; [lo, hi) is the
//	                   exposure's one region, host memory (cross-memory
//	                   attach); zero otherwise (older peers wrote zeros
//	                   here, and read a slot with no segments as one no
//	                   range lies in)
//	 60  -        zeros
//	 64  proof    [16]byte  written by the copier: the key
//	 80  seg IDs  4 × u64   the first four of them (0: none)
//	112  -        zeros
//
// An exposure's slot is the first free one from its home (the hash's
// first 8 bytes, little-endian, & (slots-1)) on,
// at most maxProbe slots (none free: not published on the connection).
// A copy enters the slot (readers += 1), checks that the stamp is the one
// it found with the key (same generation, live), copies, and leaves
// (readers -= 1, waking the futex if waiting is set and readers reached 0);
// any other stamp means the exposure was revoked: the copy leaves without
// touching the memory. Revocation stores the revoked stamp, then waits
// until readers is 0, at most WithTimeout (at once if the copier's end of
// the connection closed); only then may the slot be reused, with the next
// generation. All accesses are atomic and sequentially consistent, so a
// copy either sees the revoked stamp or is counted by the revocation's
// wait.
const (
	tUse     = 9  // copier→exposing: a large transfer through shared memory begins
	tTable   = 11 // exposing→copier: the connection's lease table (fd)
	tSeg     = 12 // exposing→copier: a shared segment (fd)
	tSegDrop = 14 // exposing→copier: unmap a segment

	// capShm, in the handshake's caps: the dialler maps the exposing
	// side's lease table and segments; in the answer, the exposing side
	// publishes them.
	capShm = 1 << 3

	segInfoSize = 16

	tableHeader  = 64
	slotSize     = 128
	slotSegs     = 4 // segment IDs a slot names
	tableVersion = 1
	maxSlots     = 8192
	maxProbe     = 32

	slotLive    = 1
	slotRevoked = 2
	slotClosed  = 3

	// slotWhole, in a slot's flags: the exposure lies in no segment and
	// is one region, [lo, hi); a copier copies any range inside it with
	// cross-memory attach.
	slotWhole = 1
)

var tableMagic = [4]byte{'G', 'X', 'L', 'T'}

// tableSize is the size of a lease table of n slots.
func tableSize(n int) int { return tableHeader + n*slotSize }

// putTable writes the header of a table of n slots into b.
func putTable(b []byte, n int) {
	copy(b[0:4], tableMagic[:])
	binary.LittleEndian.PutUint16(b[4:], tableVersion)
	binary.LittleEndian.PutUint16(b[6:], slotSize)
	binary.LittleEndian.PutUint32(b[8:], uint32(n))
}

// parseTable checks the header of a lease table of size bytes the peer
// sent (b, at least tableHeader bytes of it) and returns its slot count.
// The header is read once: the copier never reads it again, so a peer
// that changes it later changes nothing.
func parseTable(b []byte, size uint64) (int, error) {
	if len(b) < tableHeader {
		return 0, fmt.Errorf("%w: lease table of %d bytes, want at least %d", errProtocol, len(b), tableHeader)
	}
	if [4]byte(b[0:4]) != tableMagic {
		return 0, fmt.Errorf("%w: lease table magic %x, want %x", errProtocol, b[0:4], tableMagic)
	}
	if v := binary.LittleEndian.Uint16(b[4:]); v != tableVersion {
		return 0, fmt.Errorf("%w: lease table version %d, want %d", errProtocol, v, tableVersion)
	}
	if s := binary.LittleEndian.Uint16(b[6:]); s != slotSize {
		return 0, fmt.Errorf("%w: lease table slots of %d bytes, want %d", errProtocol, s, slotSize)
	}
	n := binary.LittleEndian.Uint32(b[8:])
	if n == 0 || n > maxSlots || n&(n-1) != 0 {
		return 0, fmt.Errorf("%w: lease table of %d slots, want a power of two from 1 to %d", errProtocol, n, maxSlots)
	}
	if uint64(tableSize(int(n))) > size {
		return 0, fmt.Errorf("%w: lease table of %d slots in %d bytes, want %d", errProtocol, n, size, tableSize(int(n)))
	}
	return int(n), nil
}

// segInfo is a decoded tSeg: a segment of the exposing process.
type segInfo struct {
	id, size, base uint64
}

// getSeg decodes a tSeg (f), already checked by readFrame. An empty
// segment, or one whose span wraps, is a protocol violation.
func getSeg(f *frame) (segInfo, error) {
	s := segInfo{id: f.id, size: binary.LittleEndian.Uint64(f.payload), base: binary.LittleEndian.Uint64(f.payload[8:])}
	if s.size == 0 || s.base == 0 || s.base+s.size < s.base {
		return s, fmt.Errorf("%w: segment %d spans [0x%x, +%d)", errProtocol, s.id, s.base, s.size)
	}
	return s, nil
}

// putSeg appends a tSeg's payload to b.
func putSeg(b []byte, size, base uint64) []byte {
	b = binary.LittleEndian.AppendUint64(b, size)
	return binary.LittleEndian.AppendUint64(b, base)
}
