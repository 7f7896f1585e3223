package nats

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/textproto"
	"strings"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/connect"
)

// A token message body, version 1:
//
//	magic    "gxt"
//	version  u8 (1)
//	length   uvarint, of the token
//	token    connect.Metadata binary form
//	payload  the application's bytes, the rest
const (
	msgVersion = 1
	// maxTokenLen bounds the token length a decoder believes; real tokens
	// are far smaller than any server's max payload (64 MiB at most).
	maxTokenLen = 64 << 20
)

var msgMagic = []byte("gxt")

// goxfer's own headers.
const (
	ownPrefix      = "Goxfer-"
	hdrError       = "Goxfer-Error"
	hdrErrorCode   = "Goxfer-Error-Code"
	hdrDeadline    = "Goxfer-Deadline"
	natsHeaderLine = "NATS/1.0\r\n"
)

func isOwnHeader(k string) bool {
	return len(k) >= len(ownPrefix) && strings.EqualFold(k[:len(ownPrefix)], ownPrefix)
}

// encodeMessage frames md and data as a token message body.
func encodeMessage(md connect.Metadata, data []byte) ([]byte, error) {
	n := md.EncodedLen()
	if n == 0 {
		return nil, fmt.Errorf("%w: zero Metadata", connect.ErrInvalidMetadata)
	}
	b := make([]byte, 0, len(msgMagic)+1+binary.MaxVarintLen64+n+len(data))
	b = append(b, msgMagic...)
	b = append(b, msgVersion)
	b = binary.AppendUvarint(b, uint64(n))
	tok, err := md.MarshalBinary()
	if err != nil {
		return nil, err
	}
	b = append(b, tok...)
	return append(b, data...), nil
}

// decodeMessage parses a token message body. body is untrusted: errors
// match connect.ErrInvalidMetadata and say what was expected and what was
// found. The payload returned aliases body.
func decodeMessage(body []byte) (connect.Metadata, []byte, error) {
	bad := func(format string, args ...any) (connect.Metadata, []byte, error) {
		return connect.Metadata{}, nil, fmt.Errorf("%w: token message: %s", connect.ErrInvalidMetadata, fmt.Sprintf(format, args...))
	}
	if len(body) < len(msgMagic)+1 || !bytes.Equal(body[:len(msgMagic)], msgMagic) {
		return bad("want magic %q and a version, found %q (not a goxfer token message)", msgMagic, body[:min(len(body), len(msgMagic)+1)])
	}
	if v := body[len(msgMagic)]; v != msgVersion {
		return bad("want version %d, found version %d", msgVersion, v)
	}
	rest := body[len(msgMagic)+1:]
	n, k := binary.Uvarint(rest)
	if k <= 0 {
		return bad("want a token length at offset %d, found a truncated or overlong varint", len(msgMagic)+1)
	}
	rest = rest[k:]
	if n > maxTokenLen || n > uint64(len(rest)) {
		return bad("want a token of %d bytes, found %d bytes left", n, len(rest))
	}
	var md connect.Metadata
	if err := md.UnmarshalBinary(rest[:n]); err != nil {
		return connect.Metadata{}, nil, fmt.Errorf("token message: %w", err)
	}
	return md, rest[n:], nil
}

// messageSize is what the server counts against its max payload: the
// encoded headers (as nats.go writes them) plus the body.
func messageSize(h nats.Header, body []byte) int64 {
	n := int64(len(body))
	if len(h) == 0 {
		return n
	}
	n += int64(len(natsHeaderLine)) + 2
	for k, vs := range h {
		for _, v := range vs {
			n += int64(len(k) + len(textproto.TrimString(v)) + 4)
		}
	}
	return n
}

// checkSize returns a *PayloadTooLargeError if the message does not fit the
// connection's max payload. An unknown max payload (0) passes.
func checkSize(nc *nats.Conn, subject string, h nats.Header, body []byte) error {
	max := nc.MaxPayload()
	if size := messageSize(h, body); max > 0 && size > max {
		return &PayloadTooLargeError{Subject: subject, Size: size, Max: max}
	}
	return nil
}

// appHeader returns h without goxfer's own headers, or nil when nothing is
// left.
func appHeader(h nats.Header) nats.Header {
	var out nats.Header
	for k, vs := range h {
		if isOwnHeader(k) {
			continue
		}
		if out == nil {
			out = nats.Header{}
		}
		out[k] = vs
	}
	return out
}

// mergeHeader returns a fresh header with the application's headers of
// every h, goxfer's own dropped.
func mergeHeader(hs ...nats.Header) nats.Header {
	out := nats.Header{}
	for _, h := range hs {
		addAppHeader(out, h)
	}
	return out
}

// addAppHeader adds to dst the application's headers of h, goxfer's own
// dropped.
func addAppHeader(dst, h nats.Header) {
	for k, vs := range h {
		if isOwnHeader(k) {
			continue
		}
		for _, v := range vs {
			dst.Add(k, v)
		}
	}
}
