package nats

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TestWriteCorpus regenerates the checked-in seed corpora (run with
// GOXFER_WRITE_CORPUS=1).
func TestWriteCorpus(t *testing.T) {
	if os.Getenv("GOXFER_WRITE_CORPUS") == "" {
		t.Skip("set GOXFER_WRITE_CORPUS=1 to regenerate testdata/fuzz")
	}
	md := testToken(t)
	msg, err := encodeMessage(md, []byte("prompt 17"))
	if err != nil {
		t.Fatal(err)
	}
	info := newConnector(t).AgentInfo()
	entryV1, err := encodeEntry(entry{hb: time.Second, info: info})
	if err != nil {
		t.Fatal(err)
	}
	ent, err := encodeEntry(entry{hb: time.Second, seq: nextSeq(), info: info})
	if err != nil {
		t.Fatal(err)
	}
	ib, err := info.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	write := func(fuzz, name string, b []byte) {
		p := filepath.Join("testdata", "fuzz", fuzz, name)
		if err := os.WriteFile(p, fmt.Appendf(nil, "go test fuzz v1\n[]byte(%s)\n", strconv.Quote(string(b))), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("FuzzDecodeMessage", "valid", msg)
	write("FuzzDecodeMessage", "compact", func() []byte { b, _ := encodeMessage(md.Compact(), nil); return b }())
	write("FuzzDecodeMessage", "truncated", msg[:len(msg)/2])
	write("FuzzDecodeMessage", "bad_magic", []byte("gxx\x01\x00"))
	write("FuzzDecodeMessage", "huge_length", []byte("gxt\x01\xff\xff\xff\xff\x0f"))
	write("FuzzDecodeEntry", "valid", ent)
	write("FuzzDecodeEntry", "valid_v1", entryV1)
	write("FuzzDecodeEntry", "truncated", ent[:len(ent)-5])
	write("FuzzDecodeEntry", "bad_version", append([]byte("gxr\x03"), ent[4:]...))
	// Version 2 with a sequence of 0, its CRC right.
	zero := appendEntry(nil, time.Second, 1, ib)
	zero[len("gxr")+1+2] = 0
	write("FuzzDecodeEntry", "zero_sequence", binary.LittleEndian.AppendUint32(zero[:len(zero)-4:len(zero)-4], crc32.Checksum(zero[:len(zero)-4], castagnoli)))
	write("FuzzDecodeEntry", "zero_heartbeat", []byte("gxr\x01\x00\x00\x00\x00\x00"))
}
