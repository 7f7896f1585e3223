package nats

import (
	"bytes"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/connect"
)

func TestMessageRoundTrip(t *testing.T) {
	md := testToken(t)
	for _, payload := range [][]byte{nil, {}, []byte("prompt 17"), bytes.Repeat([]byte{0xff}, 1000)} {
		b, err := encodeMessage(md, payload)
		require.NoError(t, err)
		got, rest, err := decodeMessage(b)
		require.NoError(t, err)
		assert.Equal(t, md.Text(), got.Text())
		assert.Equal(t, len(payload), len(rest))
		assert.True(t, bytes.Equal(payload, rest))
	}
}

func TestMessageDecodeRejectsGarbage(t *testing.T) {
	md := testToken(t)
	good, err := encodeMessage(md, []byte("payload"))
	require.NoError(t, err)
	cases := []struct {
		name string
		b    []byte
		want string
	}{
		{"empty", nil, "want magic"},
		{"plain text", []byte("hello world"), "not a goxfer token message"},
		{"version 2", append([]byte("gxt\x02"), good[4:]...), "want version 1, found version 2"},
		{"no length", []byte("gxt\x01"), "truncated or overlong varint"},
		{"overlong varint", []byte("gxt\x01\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"), "truncated or overlong varint"},
		{"length beyond the body", []byte("gxt\x01\x7f abc"), "want a token of 127 bytes, found 4 bytes left"},
		{"huge length", []byte("gxt\x01\xff\xff\xff\xff\x0f"), "found 0 bytes left"},
		{"damaged token", func() []byte { b := bytes.Clone(good); b[10] ^= 1; return b }(), "CRC-32C"},
		{"truncated token", good[:20], "want a token of"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := decodeMessage(tc.b)
			require.ErrorIs(t, err, connect.ErrInvalidMetadata)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestMessageEncodeRejectsZeroMetadata(t *testing.T) {
	_, err := encodeMessage(connect.Metadata{}, nil)
	require.ErrorIs(t, err, connect.ErrInvalidMetadata)
}

// messageSize must count what nats.go sends, or the size check lets
// through messages the server refuses (or refuses ones it would take).
func TestMessageSizeMatchesTheServer(t *testing.T) {
	srv := startServer(t)
	nc := dial(t, srv)
	max := nc.MaxPayload()
	h := nats.Header{"App": []string{"x", "yy"}, "Other": []string{" padded "}}
	body := make([]byte, max-messageSize(h, nil))
	require.Equal(t, max, messageSize(h, body))
	require.NoError(t, nc.PublishMsg(&nats.Msg{Subject: "fits", Header: h, Data: body}))
	require.ErrorIs(t, nc.PublishMsg(&nats.Msg{Subject: "fits", Header: h, Data: append(body, 0)}), nats.ErrMaxPayload)
	require.NoError(t, nc.FlushWithContext(guarded(t)))
}
