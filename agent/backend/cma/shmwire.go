package cma

import (
	"encoding/binary"
	"fmt"
)

// Shared host memory (capShm): the frames and the lease table.
//
// When both agents agree capShm, the copying side asks, once per exposure
// key and access, for a mapping of the exposure's memory that lies in
// shared segments (package shm): tMap, with the key and the access in the
// header's status. The exposing side checks the key and access as for a
// lease, and answers tMapped: stNone if no region of the exposure lies in
// a segment, or no slot is free (the copier then uses leases); stDenied or
// stLost with an error text, as a tGrant; stOK with count entries of
// mapEntrySize bytes, (address u64, length u64, segment u64, offset u64)
// per region that lies in a segment (the region's address in the
// exposing process, where it lies in which segment), and a payload of
// mapAnswerSize bytes: the slot u32, 0 u32, the slot's generation u64.
// Before that answer, on the same connection, come the lease table (tTable,
// once per connection) and every segment the answer names that is new to
// the connection (tSeg), each with its file descriptor attached
// (SCM_RIGHTS) to the frame's first byte.
//
//	tTable: id = the table's size in bytes; no payload
//	tSeg:   id = the segment (nonzero); payload: its size u64
//	tUnmap: id = the slot; key and status (access) name the mapping: the
//	        exposure was revoked and every copy through the slot is over
//	tSegDrop: id = the segment: no mapping on the connection names it
//
// The lease table is a memory file the exposing side creates per
// connection and both sides map: a header, then one slot per mapping.
// Every integer is little-endian, every word naturally aligned.
//
//	header (tableHeader bytes)
//	  0  magic    "GXLT"
//	  4  version  u16 (tableVersion)
//	  6  slotSize u16 (slotSize)
//	  8  slots    u32 (1 to maxSlots)
//	 12  -        zeros to the end of the header
//	slot i, at tableHeader + i*slotSize
//	  0  readers  u32  copies in progress through the slot (a futex word)
//	  4  waiting  u32  nonzero while the exposing side waits for readers
//	  8  stamp    u64  generation<<2 | state (slotLive, slotRevoked,
//	                   slotClosed: revoked because the agent is closing)
//	 16  -        zeros
//
// A copy through a mapping enters its slot (readers += 1), checks that the
// stamp is still the generation it was answered with and live, copies,
// and leaves (readers -= 1, waking the futex if waiting is set and readers
// reached 0); a stamp that does not match means the exposure was revoked:
// the copy leaves without touching the memory. Revocation stores the
// revoked stamp, then waits until readers is 0, at most WithTimeout; only
// then is the exposure's lease released. All accesses are atomic and
// sequentially consistent, so a copy either sees the revoked stamp or is
// counted by the revocation's wait.
const (
	tMap     = 9  // active→passive: map the exposure key for access
	tMapped  = 10 // passive→active: the answer to a tMap
	tTable   = 11 // passive→active: the connection's lease table (fd)
	tSeg     = 12 // passive→active: a shared segment (fd)
	tUnmap   = 13 // passive→active: a mapping is over
	tSegDrop = 14 // passive→active: unmap a segment

	stNone = 5 // tMapped: no shared memory to map; use leases

	// capShm, in the handshake's caps: the dialler maps shared segments
	// (tMap); in the answer, the exposing side serves tMap.
	capShm = 1 << 3

	mapEntrySize  = 32
	mapAnswerSize = 16
	segInfoSize   = 8

	tableHeader  = 64
	slotSize     = 64
	tableVersion = 1
	maxSlots     = 4096

	slotLive    = 1
	slotRevoked = 2
	slotClosed  = 3
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
	if n == 0 || n > maxSlots {
		return 0, fmt.Errorf("%w: lease table of %d slots, want 1 to %d", errProtocol, n, maxSlots)
	}
	if uint64(tableSize(int(n))) > size {
		return 0, fmt.Errorf("%w: lease table of %d slots in %d bytes, want %d", errProtocol, n, size, tableSize(int(n)))
	}
	return int(n), nil
}

// mapEntry is one region of a tMapped answer: where it lies in the
// exposing process, and where in which segment.
type mapEntry struct {
	addr, n  uint64
	seg, off uint64
}

// mapAnswer is a decoded granted tMapped.
type mapAnswer struct {
	slot    uint32
	gen     uint64
	entries []mapEntry
}

// getMapAnswer decodes a granted tMapped (f), already checked by
// readFrame. Entries whose range wraps or is empty are a protocol
// violation; the segments and slot are checked by the caller, which knows
// them.
func getMapAnswer(f *frame) (mapAnswer, error) {
	var a mapAnswer
	if len(f.payload) != mapAnswerSize || len(f.table) != int(f.count)*mapEntrySize || f.count == 0 {
		return a, fmt.Errorf("%w: mapping answer %d with %d entries and %d payload bytes", errProtocol, f.id, f.count, len(f.payload))
	}
	a.slot = binary.LittleEndian.Uint32(f.payload)
	a.gen = binary.LittleEndian.Uint64(f.payload[8:])
	a.entries = make([]mapEntry, f.count)
	for i := range a.entries {
		b := f.table[i*mapEntrySize:]
		e := mapEntry{addr: binary.LittleEndian.Uint64(b), n: binary.LittleEndian.Uint64(b[8:]), seg: binary.LittleEndian.Uint64(b[16:]), off: binary.LittleEndian.Uint64(b[24:])}
		if e.n == 0 || e.addr+e.n < e.addr || e.off+e.n < e.off {
			return a, fmt.Errorf("%w: mapping answer %d: entry %d spans [0x%x, +%d) at offset %d", errProtocol, f.id, i, e.addr, e.n, e.off)
		}
		a.entries[i] = e
	}
	return a, nil
}

// putMapAnswer appends a granted tMapped's table and payload to b.
func putMapAnswer(b []byte, a mapAnswer) []byte {
	for _, e := range a.entries {
		b = binary.LittleEndian.AppendUint64(b, e.addr)
		b = binary.LittleEndian.AppendUint64(b, e.n)
		b = binary.LittleEndian.AppendUint64(b, e.seg)
		b = binary.LittleEndian.AppendUint64(b, e.off)
	}
	b = binary.LittleEndian.AppendUint32(b, a.slot)
	b = binary.LittleEndian.AppendUint32(b, 0)
	return binary.LittleEndian.AppendUint64(b, a.gen)
}
