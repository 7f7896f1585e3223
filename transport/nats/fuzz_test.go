package nats

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/connect"
)

// Seed corpora live in testdata/fuzz/<FuzzName>/; these add valid inputs
// built from a real token and agent.

func FuzzDecodeMessage(f *testing.F) {
	md := testToken(f)
	for _, payload := range [][]byte{nil, []byte("payload")} {
		b, err := encodeMessage(md, payload)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		md, payload, err := decodeMessage(b)
		if err != nil {
			if !errors.Is(err, connect.ErrInvalidMetadata) {
				t.Fatalf("error %v does not match ErrInvalidMetadata", err)
			}
			return
		}
		// What decodes re-encodes to the same bytes.
		again, err := encodeMessage(md, payload)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(again, b) {
			t.Fatalf("re-encoded %x, decoded from %x", again, b)
		}
	})
}

func FuzzDecodeEntry(f *testing.F) {
	c := newConnector(f)
	for _, hb := range []time.Duration{minHeartbeat, time.Second, maxHeartbeat} {
		for _, seq := range []uint64{0, 1, nextSeq()} { // 0: version 1
			b, err := encodeEntry(entry{hb: hb, seq: seq, info: c.AgentInfo()})
			if err != nil {
				f.Fatal(err)
			}
			f.Add(b)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := decodeEntry(b)
		if err != nil {
			if !errors.Is(err, connect.ErrInvalidMetadata) {
				t.Fatalf("error %v does not match ErrInvalidMetadata", err)
			}
			return
		}
		if e.hb < minHeartbeat || e.hb > maxHeartbeat || e.info.ID() == uuid.Nil {
			t.Fatalf("accepted heartbeat %v, agent %v", e.hb, e.info.ID())
		}
		if (b[len(entryMagic)] == entryVersion) != (e.seq != 0) {
			t.Fatalf("version %d decoded with sequence %d", b[len(entryMagic)], e.seq)
		}
		again, err := encodeEntry(e)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(again, b) {
			t.Fatalf("re-encoded %x, decoded from %x", again, b)
		}
	})
}
