package connect

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// realisticInfo is an agent with the default backends: mem publishes a
// 16-byte process identity, tcp about 30 bytes (version, host identity,
// address).
func realisticInfo() agent.Info {
	return agent.Info{ID: uuid.New(), Conns: []agent.ConnInfo{
		{Backend: "mem", Data: bytes.Repeat([]byte{0xa5}, 16)},
		{Backend: "tcp", Data: append([]byte{1, 1, 2, 3, 4, 5, 6, 7, 8}, "192.168.100.200:40123"...)},
	}}
}

// testMetadata describes n regions of 64 KiB at realistic addresses; every
// eighth one lives on a GPU.
func testMetadata(kind OperationKind, n int) Metadata {
	host, gpu := uint64(0x7f3a_1c00_0000), uint64(0x7f00_0000_0000)
	ls := make([]agent.Local, n)
	for i := range ls {
		off := uint64(i) * 65536
		ls[i] = agent.Device(uintptr(host+off), 65536, agent.KindDRAM, 0)
		if i%8 == 7 {
			ls[i] = agent.Device(uintptr(gpu+off), 65536, agent.KindVRAM, uint32(i%5))
		}
	}
	return newMetadata(kind, agent.NewKey(), realisticInfo(), ls)
}

func TestMetadataRoundTrip(t *testing.T) {
	for _, n := range []int{1, 9, 4096} {
		for _, kind := range []OperationKind{KindRead, KindWrite} {
			md := testMetadata(kind, n)
			bin, err := md.MarshalBinary()
			require.NoError(t, err)
			assert.Len(t, bin, md.EncodedLen())

			var fromBin Metadata
			require.NoError(t, fromBin.UnmarshalBinary(bin))
			assert.Equal(t, md, fromBin)

			s := md.Text()
			assert.Equal(t, base64.RawURLEncoding.EncodeToString(bin), s)
			fromText, err := ParseMetadata(s)
			require.NoError(t, err)
			assert.Equal(t, md, fromText)
			assert.Equal(t, kind, fromText.Kind())
			assert.Equal(t, n, fromText.Len())
			assert.Equal(t, uniform(n, 65536), fromText.Sizes())

			text, err := md.MarshalText()
			require.NoError(t, err)
			assert.Equal(t, s, string(text))

			type request struct {
				Token Metadata `json:"token"`
			}
			js, err := json.Marshal(request{md})
			require.NoError(t, err)
			assert.Equal(t, `{"token":"`+s+`"}`, string(js))
			var back request
			require.NoError(t, json.Unmarshal(js, &back))
			assert.Equal(t, md, back.Token)
		}
	}
}

func TestMetadataDoesNotAliasInput(t *testing.T) {
	bin, err := testMetadata(KindRead, 2).MarshalBinary()
	require.NoError(t, err)
	var md Metadata
	require.NoError(t, md.UnmarshalBinary(bin))
	want := md.Text()
	clear(bin)
	assert.Equal(t, want, md.Text())
}

func TestMetadataSize(t *testing.T) {
	for _, n := range []int{1, 4096} {
		md := testMetadata(KindRead, n)
		limit := 96 + 40*n
		assert.LessOrEqual(t, md.EncodedLen(), limit, "%d descriptors", n)
		t.Logf("%d descriptors: %d bytes binary, %d text (limit %d)", n, md.EncodedLen(), len(md.Text()), limit)
	}

	// A real Connector's token stays in the same bounds.
	c := newConnector(t)
	op, err := c.CreateReadable(t.Context(), descriptors(buffers(uniform(4096, 64), 0))...)
	require.NoError(t, err)
	defer func() { require.NoError(t, op.Close()) }()
	assert.LessOrEqual(t, op.Metadata().EncodedLen(), 96+40*4096)
}

func TestZeroMetadata(t *testing.T) {
	var md Metadata
	assert.Equal(t, "", md.Text())
	assert.Equal(t, "token{zero}", md.String())
	assert.Zero(t, md.EncodedLen())
	assert.Zero(t, md.Len())
	_, err := md.MarshalBinary()
	require.ErrorIs(t, err, ErrInvalidMetadata)
	_, err = md.MarshalText()
	require.ErrorIs(t, err, ErrInvalidMetadata)
	_, err = json.Marshal(md)
	require.ErrorIs(t, err, ErrInvalidMetadata)
}

// rawToken spells a binary token field by field, so tests can damage any
// field and still give it a valid checksum.
type rawToken struct {
	magic   string
	version byte
	kind    byte
	id      uuid.UUID
	conns   []agent.ConnInfo
	nconns  *uint64 // overrides len(conns)
	regions [][3]uint64
	nregs   *uint64 // overrides len(regions)
	extra   []byte  // after the regions
}

func validRaw() rawToken {
	return rawToken{
		magic: "gx", version: 1, kind: 1, id: uuid.MustParse("6ba7b810-9dad-11d1-80b4-00c04fd430c8"),
		conns:   []agent.ConnInfo{{Backend: "mem", Data: []byte("0123456789abcdef")}},
		regions: [][3]uint64{{0x1000, 4096, 0}, {0x8000, 100, 3<<1 | 1}},
	}
}

func (r rawToken) body() []byte {
	b := append([]byte(r.magic), r.version, r.kind)
	b = append(b, bytes.Repeat([]byte{0x42}, 16)...)
	b = append(b, r.id[:]...)
	n := uint64(len(r.conns))
	if r.nconns != nil {
		n = *r.nconns
	}
	b = binary.AppendUvarint(b, n)
	for _, c := range r.conns {
		b = append(b, byte(len(c.Backend)))
		b = append(b, c.Backend...)
		b = binary.AppendUvarint(b, uint64(len(c.Data)))
		b = append(b, c.Data...)
	}
	n = uint64(len(r.regions))
	if r.nregs != nil {
		n = *r.nregs
	}
	b = binary.AppendUvarint(b, n)
	for _, reg := range r.regions {
		b = binary.LittleEndian.AppendUint64(b, reg[0])
		b = binary.AppendUvarint(b, reg[1])
		b = binary.AppendUvarint(b, reg[2])
	}
	return append(b, r.extra...)
}

func withCRC(body []byte) []byte {
	return binary.LittleEndian.AppendUint32(bytes.Clone(body), crc32.Checksum(body, castagnoli))
}

func (r rawToken) token() []byte { return withCRC(r.body()) }

func u64(v uint64) *uint64 { return &v }

func TestMetadataRaw(t *testing.T) {
	md, err := decodeMetadata(validRaw().token())
	require.NoError(t, err, "the hand-built token is valid")
	assert.Equal(t, []int{4096, 100}, md.Sizes())
	assert.Equal(t, agent.Region{Addr: 0x8000, Len: 100, Kind: agent.KindVRAM, Device: 3}, md.regions[1])
	again, err := md.MarshalBinary()
	require.NoError(t, err)
	assert.Equal(t, validRaw().token(), again, "the binary form is canonical")
}

func TestCorruptMetadata(t *testing.T) {
	valid := validRaw().token()
	flipped := bytes.Clone(valid)
	flipped[40] ^= 0x10
	tests := []struct {
		name string
		in   []byte
		want string
	}{
		{"empty", nil, `want magic "gx" and a version, found ""`},
		{"wrong magic", append([]byte("GX"), valid[2:]...), `want magic "gx" and a version, found "GX\x01"`},
		{"json", []byte(`{"a":1}`), `want magic "gx" and a version, found "{\"a"`},
		{"wrong version", func() []byte { r := validRaw(); r.version = 2; return r.token() }(), "want version 1, found version 2"},
		{"truncated header", valid[:20], "want at least 52 bytes, found 20 (truncated)"},
		{"truncated", valid[:len(valid)-1], "want at least 84 bytes, found 83 (truncated)"},
		{"bit flip", flipped, "computed"},
		{"no checksum", validRaw().body(), "want at least 84 bytes, found 80 (truncated)"},
		{"kind", func() []byte { r := validRaw(); r.kind = 3; return r.token() }(), "offset 3: want kind 1 (READ) or 2 (WRITE), found 3"},
		{"nil agent", func() []byte { r := validRaw(); r.id = uuid.Nil; return r.token() }(), "offset 20: want an agent ID, found the nil UUID"},
		{"many backends", func() []byte { r := validRaw(); r.nconns = u64(1 << 40); return r.token() }(), "offset 36: want 0 to 16 backends, found 1099511627776"},
		{"backend count past end", func() []byte { r := validRaw(); r.nconns = u64(3); return r.token() }(), "want"},
		{"bad name", func() []byte {
			r := validRaw()
			r.conns[0].Backend = "Mem"
			return r.token()
		}(), `offset 37: backend 0: backend name "Mem": want [a-z0-9._-], found 'M'`},
		{"empty name", func() []byte {
			r := validRaw()
			r.conns[0].Backend = ""
			return r.token()
		}(), `backend name "": want 1 to 32 bytes, found 0`},
		{"duplicate backend", func() []byte {
			r := validRaw()
			r.conns = append(r.conns, r.conns[0])
			return r.token()
		}(), `backend 1: "mem" given twice`},
		{"huge connection data", func() []byte {
			r := validRaw()
			r.conns[0].Data = make([]byte, 5000)
			return r.token()
		}(), `backend "mem": want at most 4096 bytes of connection data, found 5000`},
		{"no descriptors", func() []byte { r := validRaw(); r.nregs = u64(0); r.regions = nil; return r.token() }(), "want 1 to 0 descriptors"},
		{"descriptor count past end", func() []byte { r := validRaw(); r.nregs = u64(1 << 50); return r.token() }(), "offset 58: want 1 to 2 descriptors (21 bytes left, 10 or more each), found 1125899906842624"},
		{"zero size", func() []byte { r := validRaw(); r.regions[1][1] = 0; return r.token() }(), "offset 70: descriptor 1: want a size of at least 1, found 0"},
		{"overflow", func() []byte { r := validRaw(); r.regions[0] = [3]uint64{1<<64 - 10, 10, 0}; return r.token() }(), "offset 59: descriptor 0: address 0xfffffffffffffff6 + size 10 overflows"},
		{"size beyond int", func() []byte { r := validRaw(); r.regions[0] = [3]uint64{4096, 1<<63 + 4096, 0}; return r.token() }(), "descriptor 0: want a size of at most 9223372036854775807, found 9223372036854779904"},
		{"host device", func() []byte { r := validRaw(); r.regions[0][2] = 2 << 1; return r.token() }(), "want device 0 for host memory, found 2"},
		{"huge device", func() []byte { r := validRaw(); r.regions[1][2] = 1<<34 | 1; return r.token() }(), "want a device below 2^32, found 8589934592"},
		{"trailing bytes", func() []byte { r := validRaw(); r.extra = []byte{0, 0}; return r.token() }(), "want the checksum next, found 2 extra bytes"},
		{"overlong varint", func() []byte {
			b := validRaw().body()
			// The size of the last region, 100, spelled in two bytes.
			b = append(b[:len(b)-2], 100|0x80, 0, 3<<1|1)
			return withCRC(b)
		}(), "size: overlong varint"},
		{"short region", func() []byte {
			b := validRaw().body()
			return withCRC(b[:len(b)-1])
		}(), "memory kind: want a varint, found 0 bytes"},
	}
	// A text cut short counts characters.
	texts := map[string]string{
		"truncated header": "want at least 70 characters of base64url (52 bytes), found 27 (truncated)",
		"truncated":        "want at least 112 characters of base64url (84 bytes), found 111 (truncated)",
		"no checksum":      "want at least 112 characters of base64url (84 bytes), found 107 (truncated)",
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var md Metadata
			err := md.UnmarshalBinary(tt.in)
			require.ErrorIs(t, err, ErrInvalidMetadata)
			assert.ErrorContains(t, err, tt.want)
			assert.True(t, strings.HasPrefix(err.Error(), "connect: invalid metadata: "), err.Error())
			assert.Zero(t, md.Kind(), "a failed decode leaves the value alone")

			_, err = ParseMetadata(base64.RawURLEncoding.EncodeToString(tt.in))
			require.ErrorIs(t, err, ErrInvalidMetadata)
			want, ok := texts[tt.name]
			if !ok {
				want = tt.want
			}
			assert.ErrorContains(t, err, want)
		})
	}
}

func TestCorruptMetadataText(t *testing.T) {
	s := testMetadata(KindRead, 3).Text()
	tests := []struct {
		name string
		in   string
		want string
	}{
		{"empty", "", `want magic "gx" and a version, found ""`},
		{"not base64", "not a token!", "want unpadded base64url: illegal base64 data at input byte 3"},
		{"standard alphabet", strings.NewReplacer("-", "+", "_", "/").Replace(s) + "+/", "want unpadded base64url"},
		{"padded", s + "==", "want unpadded base64url"},
		{"line break", s[:10] + "\n" + s[10:], "want unpadded base64url, found a line break at offset 10"},
		{"truncated", s[:len(s)-3], "(truncated)"},
		{"edited", s[:30] + map[bool]string{true: "B", false: "A"}[s[30] == 'A'] + s[31:], "CRC-32C"},
		{"non-canonical trailing bits", s[:len(s)-1] + string(rune(s[len(s)-1])+1), "want"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseMetadata(tt.in)
			require.ErrorIs(t, err, ErrInvalidMetadata)
			assert.ErrorContains(t, err, tt.want)
			var md Metadata
			require.ErrorIs(t, md.UnmarshalText([]byte(tt.in)), ErrInvalidMetadata)
			js, err := json.Marshal(tt.in)
			require.NoError(t, err)
			require.ErrorIs(t, json.Unmarshal(js, &md), ErrInvalidMetadata)
		})
	}
}

// A decoder must not let an input make it allocate more than a small multiple
// of the input's length, whatever counts the input claims.
func TestMetadataDecodeAllocationBound(t *testing.T) {
	huge := validRaw()
	huge.nregs = u64(1 << 50)
	full := validRaw()
	full.regions = nil
	for i := range 10000 {
		full.regions = append(full.regions, [3]uint64{uint64(i) << 20, 1, 0})
	}
	for _, in := range [][]byte{huge.token(), full.token()} {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		const runs = 20
		for range runs {
			_, _ = decodeMetadata(in)
		}
		runtime.ReadMemStats(&after)
		perRun := (after.TotalAlloc - before.TotalAlloc) / runs
		assert.LessOrEqual(t, perRun, uint64(4*len(in)+1024), "decoding %d bytes", len(in))
	}
}

// Every token cut short, in binary or in text, says so, with how much it
// wanted and how much it found; and a token damaged, not cut, does not.
func TestTruncatedMetadata(t *testing.T) {
	for _, md := range []Metadata{testMetadata(KindRead, 9), testMetadata(KindWrite, 1).Compact()} {
		bin, err := md.MarshalBinary()
		require.NoError(t, err)
		for n := 3; n < len(bin); n++ {
			_, err := decodeMetadata(bin[:n])
			require.ErrorIs(t, err, ErrInvalidMetadata)
			require.ErrorContains(t, err, fmt.Sprintf(", found %d (truncated)", n), "%d of %d bytes", n, len(bin))
			require.ErrorContains(t, err, "want at least ", "%d of %d bytes", n, len(bin))
		}
		text := md.Text()
		for n := 4; n < len(text); n++ {
			_, err := ParseMetadata(text[:n])
			require.ErrorIs(t, err, ErrInvalidMetadata)
			require.ErrorContains(t, err, "(truncated)", "%d of %d characters", n, len(text))
			require.ErrorContains(t, err, fmt.Sprintf("found %d", n), "%d of %d characters", n, len(text))
		}
		// The checksum is what is wrong: damaged, not truncated.
		bin[len(bin)-1] ^= 1
		_, err = decodeMetadata(bin)
		require.ErrorContains(t, err, "want CRC-32C")
		assert.NotContains(t, err.Error(), "found "+strconv.Itoa(len(bin)-1))
	}
	// The message a cut text gives names characters and bytes.
	text := testMetadata(KindRead, 1).Text()
	_, err := ParseMetadata(text[:len(text)-5])
	assert.ErrorContains(t, err, fmt.Sprintf("want at least %d characters of base64url", len(text)))
}

// Text pasted from a terminal, an editor or JSON parses: whitespace and
// line breaks around it, then one pair of matching quotes.
func TestParsePastedMetadata(t *testing.T) {
	md := testMetadata(KindRead, 3)
	s := md.Text()
	for _, in := range []string{
		" " + s, s + "\n", "\t" + s + "\r\n", "\n\n  " + s + "  \n",
		`"` + s + `"`, "'" + s + "'", "`" + s + "`",
		"  \"" + s + "\"\n", "' " + s + " '", "\"\n" + s + "\n\"",
	} {
		got, err := ParseMetadata(in)
		require.NoError(t, err, "%q", in)
		assert.Equal(t, md, got, "%q", in)
		var viaJSON Metadata
		require.NoError(t, viaJSON.UnmarshalText([]byte(in)), "%q", in)
		assert.Equal(t, md, viaJSON)
	}
	tests := []struct {
		name, in, want string
	}{
		{"unmatched quotes", `"` + s + `'`, "want unpadded base64url: illegal base64 data at input byte 0"},
		{"two pairs of quotes", `""` + s + `""`, "want unpadded base64url: illegal base64 data at input byte 1"},
		{"only quotes", `""`, `want magic "gx" and a version, found ""`},
		{"only space", " \n ", `want magic "gx" and a version, found ""`},
		{"line break inside", "  " + s[:10] + "\n" + s[10:], "found a line break at offset 12"},
		{"space inside", s[:10] + " " + s[10:], "illegal base64 data at input byte 10"},
		{"bad byte after space", "   " + s[:5] + "!" + s[5:], "illegal base64 data at input byte 8"},
		{"two tokens", s + " " + s, "illegal base64 data at input byte " + strconv.Itoa(len(s))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseMetadata(tt.in)
			require.ErrorIs(t, err, ErrInvalidMetadata)
			assert.ErrorContains(t, err, tt.want)
		})
	}
}
