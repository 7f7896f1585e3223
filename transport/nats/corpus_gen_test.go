package nats

import (
	"fmt"
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
	entry, err := encodeEntry(time.Second, newConnector(t).AgentInfo())
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
	write("FuzzDecodeEntry", "valid", entry)
	write("FuzzDecodeEntry", "truncated", entry[:len(entry)-5])
	write("FuzzDecodeEntry", "bad_version", append([]byte("gxr\x02"), entry[4:]...))
	write("FuzzDecodeEntry", "zero_heartbeat", []byte("gxr\x01\x00\x00\x00\x00\x00"))
}
