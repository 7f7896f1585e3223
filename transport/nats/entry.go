package nats

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"time"

	"github.com/goxfer/goxfer/connect"
)

// A presence registry entry, keyed by the agent's UUID string, version 1:
//
//	magic     "gxr"
//	version   u8 (1)
//	heartbeat uvarint, the member's interval in milliseconds
//	info      connect.AgentInfo binary form
//	crc       u32 little-endian, CRC-32C of every byte before it
const entryVersion = 1

var (
	entryMagic = []byte("gxr")
	castagnoli = crc32.MakeTable(crc32.Castagnoli)
)

func encodeEntry(hb time.Duration, info connect.AgentInfo) ([]byte, error) {
	ib, err := info.MarshalBinary()
	if err != nil {
		return nil, err
	}
	b := make([]byte, 0, len(entryMagic)+1+binary.MaxVarintLen64+len(ib)+4)
	b = append(b, entryMagic...)
	b = append(b, entryVersion)
	b = binary.AppendUvarint(b, uint64(hb/time.Millisecond))
	b = append(b, ib...)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli)), nil
}

// decodeEntry parses an entry. b is untrusted: errors match
// connect.ErrInvalidMetadata and say what was expected and what was found;
// it never panics and does not retain b.
func decodeEntry(b []byte) (time.Duration, connect.AgentInfo, error) {
	bad := func(format string, args ...any) (time.Duration, connect.AgentInfo, error) {
		return 0, connect.AgentInfo{}, fmt.Errorf("%w: registry entry: %s", connect.ErrInvalidMetadata, fmt.Sprintf(format, args...))
	}
	head := len(entryMagic) + 1
	if len(b) < head || !bytes.Equal(b[:len(entryMagic)], entryMagic) {
		return bad("want magic %q and a version, found %q", entryMagic, b[:min(len(b), head)])
	}
	if b[len(entryMagic)] != entryVersion {
		return bad("want version %d, found version %d", entryVersion, b[len(entryMagic)])
	}
	if len(b) < head+1+4 {
		return bad("want at least %d bytes, found %d (truncated)", head+1+4, len(b))
	}
	body := b[:len(b)-4]
	if want, got := binary.LittleEndian.Uint32(b[len(body):]), crc32.Checksum(body, castagnoli); want != got {
		return bad("want CRC-32C 0x%08x, computed 0x%08x (damaged or truncated)", want, got)
	}
	ms, k := binary.Uvarint(body[head:])
	if k <= 0 {
		return bad("want a heartbeat varint at offset %d, found a truncated or overlong one", head)
	}
	hb := time.Duration(ms) * time.Millisecond
	if ms < uint64(minHeartbeat/time.Millisecond) || ms > uint64(maxHeartbeat/time.Millisecond) {
		return bad("want a heartbeat of %v to %v, found %d ms", minHeartbeat, maxHeartbeat, ms)
	}
	var info connect.AgentInfo
	if err := info.UnmarshalBinary(body[head+k:]); err != nil {
		return 0, connect.AgentInfo{}, fmt.Errorf("registry entry: %w", err)
	}
	return hb, info, nil
}
