package nats

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"sync/atomic"
	"time"

	"github.com/goxfer/goxfer/connect"
)

// A presence registry entry, keyed by the agent's UUID string:
//
//	magic     "gxr"
//	version   u8 (1 or 2)
//	heartbeat uvarint, the member's interval in milliseconds
//	sequence  uvarint, nonzero (version 2 only): this put's number
//	info      connect.AgentInfo binary form
//	crc       u32 little-endian, CRC-32C of every byte before it
//
// The sequence tells the registry which of its own puts the watch delivers
// back, and a departed agent's last put replayed by a re-watch from a new
// one. It grows with every put of the process (seeded from the wall clock),
// so an agent's puts, even across a restart with the same agent ID, number
// upwards. Version 1 entries (no sequence) are still read.
const (
	entryVersion1 = 1
	entryVersion  = 2
)

var (
	entryMagic = []byte("gxr")
	castagnoli = crc32.MakeTable(crc32.Castagnoli)
)

// putSeq numbers this process's puts; never 0.
var putSeq atomic.Uint64

func init() { putSeq.Store(uint64(max(time.Now().UnixNano(), 1))) }

// nextSeq returns the sequence number of a new put.
func nextSeq() uint64 { return putSeq.Add(1) }

// entry is a decoded registry entry.
type entry struct {
	hb   time.Duration
	seq  uint64 // 0: a version 1 entry
	info connect.AgentInfo
}

// encodeEntry encodes e: version 2, or version 1 when e.seq is 0.
func encodeEntry(e entry) ([]byte, error) {
	ib, err := e.info.MarshalBinary()
	if err != nil {
		return nil, err
	}
	return appendEntry(make([]byte, 0, len(entryMagic)+1+2*binary.MaxVarintLen64+len(ib)+4), e.hb, e.seq, ib), nil
}

// appendEntry appends an entry holding info's binary form ib.
func appendEntry(b []byte, hb time.Duration, seq uint64, ib []byte) []byte {
	start := len(b)
	b = append(b, entryMagic...)
	if seq == 0 {
		b = append(b, entryVersion1)
		b = binary.AppendUvarint(b, uint64(hb/time.Millisecond))
	} else {
		b = append(b, entryVersion)
		b = binary.AppendUvarint(b, uint64(hb/time.Millisecond))
		b = binary.AppendUvarint(b, seq)
	}
	b = append(b, ib...)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b[start:], castagnoli))
}

// decodeEntry parses an entry. b is untrusted: errors match
// connect.ErrInvalidMetadata and say what was expected and what was found;
// it never panics and does not retain b.
func decodeEntry(b []byte) (entry, error) {
	bad := func(format string, args ...any) (entry, error) {
		return entry{}, fmt.Errorf("%w: registry entry: %s", connect.ErrInvalidMetadata, fmt.Sprintf(format, args...))
	}
	head := len(entryMagic) + 1
	if len(b) < head || !bytes.Equal(b[:len(entryMagic)], entryMagic) {
		return bad("want magic %q and a version, found %q", entryMagic, b[:min(len(b), head)])
	}
	version := b[len(entryMagic)]
	if version != entryVersion1 && version != entryVersion {
		return bad("want version %d or %d, found version %d", entryVersion1, entryVersion, version)
	}
	if len(b) < head+1+4 {
		return bad("want at least %d bytes, found %d (truncated)", head+1+4, len(b))
	}
	body := b[:len(b)-4]
	if want, got := binary.LittleEndian.Uint32(b[len(body):]), crc32.Checksum(body, castagnoli); want != got {
		return bad("want CRC-32C 0x%08x, computed 0x%08x (damaged or truncated)", want, got)
	}
	at := head
	ms, k := binary.Uvarint(body[at:])
	if k <= 0 {
		return bad("want a heartbeat varint at offset %d, found a truncated or overlong one", at)
	}
	at += k
	var e entry
	e.hb = time.Duration(ms) * time.Millisecond
	if ms < uint64(minHeartbeat/time.Millisecond) || ms > uint64(maxHeartbeat/time.Millisecond) {
		return bad("want a heartbeat of %v to %v, found %d ms", minHeartbeat, maxHeartbeat, ms)
	}
	if version == entryVersion {
		seq, k := binary.Uvarint(body[at:])
		if k <= 0 {
			return bad("want a sequence varint at offset %d, found a truncated or overlong one", at)
		}
		if seq == 0 {
			return bad("want a nonzero sequence at offset %d, found 0", at)
		}
		at += k
		e.seq = seq
	}
	if err := e.info.UnmarshalBinary(body[at:]); err != nil {
		return entry{}, fmt.Errorf("registry entry: %w", err)
	}
	return e, nil
}
