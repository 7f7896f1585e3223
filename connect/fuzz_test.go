package connect

import (
	"bytes"
	"encoding/base64"
	"errors"
	"testing"
)

// The seed corpus lives in testdata/fuzz: valid tokens of both kinds, with
// host and GPU regions, and damaged ones (truncated, bit-flipped, of another
// version, padded, with line breaks). Run with
//
//	go test -fuzz FuzzParseMetadata ./connect
//	go test -fuzz FuzzUnmarshalMetadata ./connect

func FuzzParseMetadata(f *testing.F) {
	// Pasted and cut forms of a valid token, besides the corpus.
	s := base64.RawURLEncoding.EncodeToString(validRaw().token())
	for _, in := range []string{" " + s + "\n", `"` + s + `"`, "'\t" + s + " '", "`" + s + "\"", s[:len(s)-1], s[:len(s)-2], s[:40]} {
		f.Add(in)
	}
	f.Fuzz(func(t *testing.T, s string) {
		md, err := ParseMetadata(s)
		if err != nil {
			if !errors.Is(err, ErrInvalidMetadata) {
				t.Fatalf("error does not wrap ErrInvalidMetadata: %v", err)
			}
			return
		}
		checkDecoded(t, md)
		// Pasted text is trimmed of whitespace and quotes around it; what
		// is left is the one text form of the token.
		if got, want := md.Text(), trimmed(s); got != want {
			t.Fatalf("a valid token must have one text form:\n in: %q\nout: %q", want, got)
		}
	})
}

// trimmed is s without what ParseMetadata ignores around a token.
func trimmed(s string) string {
	t, _ := trimPasted(s)
	return t
}

func FuzzUnmarshalMetadata(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzBinary(t, b)
		// With a valid checksum appended the decoder goes on to the fields,
		// which random bytes alone would almost never reach.
		fuzzBinary(t, withCRC(b))
	})
}

func fuzzBinary(t *testing.T, b []byte) {
	var md Metadata
	if err := md.UnmarshalBinary(b); err != nil {
		if !errors.Is(err, ErrInvalidMetadata) {
			t.Fatalf("error does not wrap ErrInvalidMetadata: %v", err)
		}
		return
	}
	checkDecoded(t, md)
	out, err := md.MarshalBinary()
	if err != nil {
		t.Fatalf("a decoded token does not encode: %v", err)
	}
	if !bytes.Equal(out, b) {
		t.Fatalf("a valid token must have one binary form:\n in: %x\nout: %x", b, out)
	}
}

func checkDecoded(t *testing.T, md Metadata) {
	t.Helper()
	if md.Len() < 1 || len(md.Sizes()) != md.Len() {
		t.Fatalf("decoded %d descriptors, %d sizes", md.Len(), len(md.Sizes()))
	}
	if err := md.check(); err != nil {
		t.Fatalf("decoded an invalid token: %v", err)
	}
	again, err := ParseMetadata(md.Text())
	if err != nil || again.EncodedLen() != md.EncodedLen() {
		t.Fatalf("text round trip: %v (size %d != %d)", err, again.EncodedLen(), md.EncodedLen())
	}
}

// FuzzAgentInfo decodes agent descriptions, which presence registries carry
// between services:
//
//	go test -fuzz FuzzAgentInfo ./connect
func FuzzAgentInfo(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzInfo(t, b)
		fuzzInfo(t, withCRC(b))
	})
}

func fuzzInfo(t *testing.T, b []byte) {
	var ai AgentInfo
	if err := ai.UnmarshalBinary(b); err != nil {
		if !errors.Is(err, ErrInvalidMetadata) {
			t.Fatalf("error does not wrap ErrInvalidMetadata: %v", err)
		}
		return
	}
	out, err := ai.MarshalBinary()
	if err != nil {
		t.Fatalf("a decoded agent info does not encode: %v", err)
	}
	if !bytes.Equal(out, b) {
		t.Fatalf("a valid agent info must have one binary form:\n in: %x\nout: %x", b, out)
	}
}
