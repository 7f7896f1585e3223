package connect

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/wire"
)

// OperationKind is the access a token grants: READ tokens come from
// [Connector.CreateReadable] and go to [Connector.BeginRead], WRITE tokens
// come from [Connector.CreateWritable] and go to [Connector.BeginWrite].
type OperationKind uint8

const (
	// KindRead grants reading the exposed memory.
	KindRead OperationKind = 1
	// KindWrite grants writing the exposed memory.
	KindWrite OperationKind = 2
)

// String returns "READ" or "WRITE".
func (k OperationKind) String() string {
	switch k {
	case KindRead:
		return "READ"
	case KindWrite:
		return "WRITE"
	}
	return fmt.Sprintf("OperationKind(%d)", uint8(k))
}

// Metadata is the token a passive operation hands out: who exposes memory
// (the agent's identity and how to reach it), under which capability key,
// for which kind of access, and where (the address, size and device of every
// descriptor). It grants access until the passive operation is closed, so
// treat it as a secret for that long.
//
// Printing or logging a Metadata shows a redacted form that grants nothing
// ([Metadata.String]): fmt with any verb, [log/slog] (it is a
// [slog.LogValuer]) and errors that format it. The text that grants access
// is asked for explicitly: [Metadata.Text], [Metadata.MarshalText] (which
// [encoding/json] uses) or [Metadata.MarshalBinary]. So a struct, slice or
// map holding a Metadata that goes through encoding/json carries the
// capability, also when slog's JSON handler logs it: log the Metadata
// itself.
//
// A Metadata is an immutable value, safe to copy and to use from several
// goroutines. The zero Metadata is invalid: its text is "" and no
// operation accepts it.
//
// Its binary form ([Metadata.MarshalBinary]), version 1, is little-endian throughout,
// with varints as in encoding/binary:
//
//	magic    "gx"
//	version  u8 (1)
//	kind     u8 (1 READ, 2 WRITE)
//	key      [16]byte
//	agent    [16]byte, the agent's UUID
//	backends uvarint count (0..16), each: u8 name length (1..32), name
//	         ([a-z0-9._-]), uvarint data length (<= 4096), data; none in
//	         a compact token (see [Metadata.Compact])
//	regions  uvarint count (>= 1), each: u64 address, uvarint size (>= 1),
//	         uvarint device<<1 | memory kind (0 host, 1 GPU)
//	crc      u32, CRC-32C (Castagnoli) of every byte before it
//
// Its text form ([Metadata.Text], [Metadata.MarshalText], JSON) is the
// binary form in unpadded base64url. [Metadata.EncodedLen] gives the binary
// length: with the default backends (mem, cma and tcp publish endpoints) a
// token with one descriptor takes about 190 bytes, and 54 when compact;
// each further descriptor takes at most 23 more (12 for host memory under
// 2 MiB).
type Metadata struct {
	kind    OperationKind
	key     sealedKey
	peer    agent.Info
	regions []agent.Region
}

// Limits of the binary form, which bound what a decoder accepts.
const (
	metaVersion    = 1
	maxConns       = 16
	maxNameLen     = 32
	maxConnDataLen = 4096
	// headerLen is magic, version, kind, key and agent ID.
	headerLen = 2 + 1 + 1 + 16 + 16
	crcLen    = 4
	// minRegionLen is the fewest bytes one region takes, which bounds the
	// count a decoder believes before allocating.
	minRegionLen = 8 + 1 + 1
	// minLen is the shortest valid token: compact (no backends), one region.
	minLen = headerLen + 1 + 1 + minRegionLen + crcLen
	// maxRegions bounds the descriptor count truncatedLen believes: more
	// than a token of 64 MiB holds.
	maxRegions = 64 << 20 / minRegionLen
)

var (
	metaMagic  = [2]byte{'g', 'x'}
	castagnoli = crc32.MakeTable(crc32.Castagnoli)
	// tokenEncoding is strict so that every token has exactly one text form.
	tokenEncoding = base64.RawURLEncoding.Strict()
)

// newMetadata describes an exposure; check validates it before it is
// handed out.
func newMetadata(kind OperationKind, key agent.Key, info agent.Info, ls []agent.Local) Metadata {
	regions := make([]agent.Region, len(ls))
	for i, l := range ls {
		regions[i] = l.Region
	}
	return Metadata{kind: kind, key: seal(key), peer: info, regions: regions}
}

// sealedKey is a key as a Metadata holds it: XORed with a random mask of
// this process, so that fmt printing a value that holds a Metadata where
// it cannot call Format (an unexported field) prints bytes that are not
// the key.
type sealedKey agent.Key

var keyMask = agent.NewKey()

func seal(k agent.Key) sealedKey {
	for i := range k {
		k[i] ^= keyMask[i]
	}
	return sealedKey(k)
}

// open returns the key.
func (s sealedKey) open() agent.Key { return agent.Key(seal(agent.Key(s))) }

// Agent returns the ID of the agent that made the token: the Connector
// whose memory it names ([Connector.AgentInfo], [AgentInfo.ID]).
func (m Metadata) Agent() uuid.UUID { return m.peer.ID }

// Compact returns the token without the endpoints of the agent that made
// it, which saves their bytes (about 140 with the default backends). A
// Connector given a compact token looks the agent up with its [Resolver]
// ([WithResolver]), such as a presence registry the agent joined; without
// one, BeginRead and BeginWrite fail with [ErrNoBackend]. A compact token
// grants the same access as the full one.
func (m Metadata) Compact() Metadata {
	m.peer.Conns = nil
	return m
}

// IsCompact reports whether the token names its agent without endpoints.
func (m Metadata) IsCompact() bool { return m.kind != 0 && len(m.peer.Conns) == 0 }

// Kind returns the access the token grants.
func (m Metadata) Kind() OperationKind { return m.kind }

// Len returns the number of descriptors the token names.
func (m Metadata) Len() int { return len(m.regions) }

// Sizes returns the size in bytes of every descriptor the token names, in
// order, in a fresh slice: the sizes local descriptors must have. A token is
// untrusted input: decoding bounds each size by math.MaxInt, not by what
// this process can allocate, so check them before allocating buffers.
func (m Metadata) Sizes() []int {
	s := make([]int, len(m.regions))
	for i, r := range m.regions {
		s[i] = int(r.Len)
	}
	return s
}

// EncodedLen returns the length of the binary form in bytes (the text form
// is 4/3 of that): what the token costs in a message. It returns 0 for the
// zero Metadata.
func (m Metadata) EncodedLen() int {
	if m.kind == 0 {
		return 0
	}
	n := headerLen + connsLen(m.peer.Conns)
	n += wire.UvarintLen(uint64(len(m.regions)))
	for _, r := range m.regions {
		n += 8 + wire.UvarintLen(r.Len) + wire.UvarintLen(where(r))
	}
	return n + crcLen
}

// where packs a region's memory kind and device into one varint.
func where(r agent.Region) uint64 { return uint64(r.Device)<<1 | uint64(r.Kind) }

// Text returns the token's text form, the capability itself: unpadded
// base64url, safe in URLs, JSON and NATS headers, which [ParseMetadata]
// reads back. It returns "" for the zero Metadata. It is the one way to get
// the text besides [Metadata.MarshalText], and named for what it returns,
// the counterpart of ParseMetadata, so that every place a token leaves the
// process in text is a call that says so: String, which fmt and loggers
// call on their own, gives a redacted form instead.
func (m Metadata) Text() string {
	b, err := m.MarshalBinary()
	if err != nil {
		return ""
	}
	return tokenEncoding.EncodeToString(b)
}

// String returns a redacted description of the token, for logs and
// errors: its kind, the exposing agent's ID, the number of descriptors and
// their total size, whether it is compact, and a fingerprint of its key
// (the first 4 bytes of its SHA-256, which tell tokens apart and give
// nothing of the key away), as in
//
//	token{READ agent=6ba7b810-9dad-11d1-80b4-00c04fd430c8 descriptors=3 bytes=196608 full key=sha256:1a2b3c4d}
//
// It is "token{zero}" for the zero Metadata. The text that grants access is
// [Metadata.Text].
func (m Metadata) String() string {
	if m.kind == 0 {
		return "token{zero}"
	}
	form := "full"
	if m.IsCompact() {
		form = "compact"
	}
	return "token{" + m.kind.String() + " agent=" + m.peer.ID.String() +
		" descriptors=" + strconv.Itoa(len(m.regions)) +
		" bytes=" + strconv.FormatUint(m.bytes(), 10) +
		" " + form + " key=" + m.fingerprint() + "}"
}

// Format implements [fmt.Formatter], so that every verb prints the redacted
// form of [Metadata.String], never the key: %v, %+v and %s print it, %q
// quotes it, %x and %X print it in hex, %#v prints its fields Go-style,
// and any other verb prints it as fmt prints a bad verb ("%!d(...)").
// Width and flags apply as for a string.
func (m Metadata) Format(f fmt.State, verb rune) {
	switch {
	case verb == 'v' && f.Flag('#'):
		_, _ = fmt.Fprint(f, m.goString())
	case verb == 'v', verb == 's', verb == 'q', verb == 'x', verb == 'X':
		_, _ = fmt.Fprintf(f, fmt.FormatString(f, verb), m.String())
	default:
		_, _ = fmt.Fprintf(f, "%%!%c(connect.Metadata=%s)", verb, m.String())
	}
}

// goString is %#v's form: the fields String shows, Go-style.
func (m Metadata) goString() string {
	if m.kind == 0 {
		return "connect.Metadata{}"
	}
	return fmt.Sprintf("connect.Metadata{Kind: %v, Agent: %q, Descriptors: %d, Bytes: %d, Compact: %t, Key: %q}",
		m.kind, m.peer.ID.String(), len(m.regions), m.bytes(), m.IsCompact(), m.fingerprint())
}

// LogValue implements [slog.LogValuer]: a logged Metadata is a group of
// the fields [Metadata.String] shows (kind, agent, descriptors, bytes,
// compact, key: the fingerprint), whatever the handler, instead of the
// text MarshalText would give slog's JSON and text handlers.
func (m Metadata) LogValue() slog.Value {
	if m.kind == 0 {
		return slog.StringValue(m.String())
	}
	return slog.GroupValue(
		slog.String("kind", m.kind.String()),
		slog.String("agent", m.peer.ID.String()),
		slog.Int("descriptors", len(m.regions)),
		slog.Uint64("bytes", m.bytes()),
		slog.Bool("compact", m.IsCompact()),
		slog.String("key", m.fingerprint()),
	)
}

// fingerprint names the key in logs without revealing it, as the agent
// does in its errors ([agent.Key.String]): "sha256:" and the first 4 bytes
// of its SHA-256 in hex.
func (m Metadata) fingerprint() string { return m.key.open().String() }

// bytes is the total size of the descriptors, saturated at 2^64-1 (a
// decoded token's sizes are each below 2^63, not their sum).
func (m Metadata) bytes() uint64 {
	var n uint64
	for _, r := range m.regions {
		if n+r.Len < n {
			return math.MaxUint64
		}
		n += r.Len
	}
	return n
}

// ParseMetadata decodes a token's text form ([Metadata.Text]). Text pasted
// from elsewhere is accepted: surrounding whitespace, and then one pair of
// matching quotes (", ' or `) around the token, are ignored. s is
// untrusted: errors wrap [ErrInvalidMetadata] and say what was expected and
// what was found ("truncated" for a token cut short), with offsets into s;
// it never panics, and it allocates at most a small multiple of len(s).
func ParseMetadata(s string) (Metadata, error) {
	t, at := trimPasted(s)
	if i := strings.IndexAny(t, "\r\n"); i >= 0 {
		return Metadata{}, fmt.Errorf("%w: want unpadded base64url, found a line break at offset %d", ErrInvalidMetadata, at+i)
	}
	b, err := tokenEncoding.DecodeString(t)
	if err == nil {
		md, need, err := decode(b)
		if need > 0 {
			return Metadata{}, cutShort(t, need)
		}
		return md, err
	}
	if b, lerr := lenient(t); lerr == nil {
		if _, need, _ := decode(b); need > 0 {
			return Metadata{}, cutShort(t, need)
		}
	}
	var pos base64.CorruptInputError
	if errors.As(err, &pos) {
		err = base64.CorruptInputError(int64(pos) + int64(at))
	}
	return Metadata{}, fmt.Errorf("%w: want unpadded base64url: %v", ErrInvalidMetadata, err)
}

// cutShort is the error for the text t of a token cut short, whose fields
// call for need bytes or more.
func cutShort(t string, need int) error {
	return fmt.Errorf("%w: want at least %d characters of base64url (%d bytes), found %d (truncated)",
		ErrInvalidMetadata, tokenEncoding.EncodedLen(need), need, len(t))
}

// trimPasted strips what pasting a token tends to bring along: surrounding
// whitespace, then one pair of matching quotes and whitespace inside them.
// It returns the rest and its offset in s.
func trimPasted(s string) (string, int) {
	t := strings.TrimLeftFunc(s, isSpace)
	at := len(s) - len(t)
	t = strings.TrimRightFunc(t, isSpace)
	if n := len(t); n >= 2 && t[0] == t[n-1] && (t[0] == '"' || t[0] == '\'' || t[0] == '`') {
		inner := strings.TrimLeftFunc(t[1:n-1], isSpace)
		at += n - 1 - len(inner)
		t = strings.TrimRightFunc(inner, isSpace)
	}
	return t, at
}

// isSpace is the whitespace trimPasted strips: ASCII spaces, tabs and line
// breaks, which is what copying from a terminal or an editor adds.
func isSpace(r rune) bool { return r == ' ' || r == '\t' || r == '\n' || r == '\r' }

// lenient decodes what it can of t, a text the strict decoder refused: a
// token's text cut short may end mid-byte, with a lone last character or
// with bits set that the strict decoder wants clear.
func lenient(t string) ([]byte, error) {
	if len(t)%4 == 1 {
		t = t[:len(t)-1]
	}
	return base64.RawURLEncoding.DecodeString(t)
}

// MarshalText implements [encoding.TextMarshaler]; JSON encodes a Metadata as
// this string. It fails only for the zero Metadata.
func (m Metadata) MarshalText() ([]byte, error) {
	b, err := m.MarshalBinary()
	if err != nil {
		return nil, err
	}
	return tokenEncoding.AppendEncode(nil, b), nil
}

// UnmarshalText implements [encoding.TextUnmarshaler], as [ParseMetadata].
// It does not retain text, and leaves m unchanged on error.
func (m *Metadata) UnmarshalText(text []byte) error {
	md, err := ParseMetadata(string(text))
	if err != nil {
		return err
	}
	*m = md
	return nil
}

// MarshalBinary implements [encoding.BinaryMarshaler]. It fails only for the
// zero Metadata.
func (m Metadata) MarshalBinary() ([]byte, error) {
	if err := m.check(); err != nil {
		return nil, err
	}
	b := make([]byte, 0, m.EncodedLen())
	b = append(b, metaMagic[:]...)
	b = append(b, metaVersion, byte(m.kind))
	key := m.key.open()
	b = append(b, key[:]...)
	b = append(b, m.peer.ID[:]...)
	b = appendConns(b, m.peer.Conns)
	b = binary.AppendUvarint(b, uint64(len(m.regions)))
	for _, r := range m.regions {
		b = binary.LittleEndian.AppendUint64(b, r.Addr)
		b = binary.AppendUvarint(b, r.Len)
		b = binary.AppendUvarint(b, where(r))
	}
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli)), nil
}

// UnmarshalBinary implements [encoding.BinaryUnmarshaler] with the
// guarantees of [ParseMetadata]. It does not retain data, and leaves m
// unchanged on error.
func (m *Metadata) UnmarshalBinary(data []byte) error {
	md, err := decodeMetadata(data)
	if err != nil {
		return err
	}
	*m = md
	return nil
}

// check reports whether m can be encoded, so that passive operations refuse
// up front an agent whose connection information no token can carry.
func (m Metadata) check() error {
	if m.kind == 0 {
		return fmt.Errorf("%w: zero Metadata", ErrInvalidMetadata)
	}
	if m.kind != KindRead && m.kind != KindWrite {
		return fmt.Errorf("%w: kind %v", ErrInvalidMetadata, m.kind)
	}
	if err := checkConns(m.peer.Conns, 0); err != nil {
		return err
	}
	if len(m.regions) == 0 {
		return fmt.Errorf("%w: no descriptors", ErrInvalidMetadata)
	}
	return nil
}

// checkConns checks connection information for encoding: at least least
// and at most maxConns backends, with valid names and bounded data.
func checkConns(cs []agent.ConnInfo, least int) error {
	if n := len(cs); n < least || n > maxConns {
		return fmt.Errorf("%w: want %d to %d backends, found %d", ErrInvalidMetadata, least, maxConns, n)
	}
	for _, c := range cs {
		if err := checkName(c.Backend); err != nil {
			return fmt.Errorf("%w: %v", ErrInvalidMetadata, err)
		}
		if len(c.Data) > maxConnDataLen {
			return fmt.Errorf("%w: backend %q: want at most %d bytes of connection data, found %d", ErrInvalidMetadata, c.Backend, maxConnDataLen, len(c.Data))
		}
	}
	return nil
}

// appendConns appends the backends section of the binary forms.
func appendConns(b []byte, cs []agent.ConnInfo) []byte {
	b = binary.AppendUvarint(b, uint64(len(cs)))
	for _, c := range cs {
		b = append(b, byte(len(c.Backend)))
		b = append(b, c.Backend...)
		b = binary.AppendUvarint(b, uint64(len(c.Data)))
		b = append(b, c.Data...)
	}
	return b
}

// connsLen is the length of appendConns' output.
func connsLen(cs []agent.ConnInfo) int {
	n := wire.UvarintLen(uint64(len(cs)))
	for _, c := range cs {
		n += 1 + len(c.Backend) + wire.UvarintLen(uint64(len(c.Data))) + len(c.Data)
	}
	return n
}

// readConns decodes a backends section of least to maxConns backends; on
// failure r holds the error. The data is copied.
func readConns(r *wire.Reader, least uint64) []agent.ConnInfo {
	at := r.Offset()
	n := r.Uvarint("backend count")
	if r.Err() == nil && (n < least || n > maxConns) {
		r.FailAtf(at, "want %d to %d backends, found %d", least, maxConns, n)
	}
	if r.Err() != nil {
		return nil
	}
	if n == 0 {
		return nil
	}
	cs := make([]agent.ConnInfo, 0, n)
	for i := uint64(0); i < n && r.Err() == nil; i++ {
		at = r.Offset()
		name := string(r.Bytes(int(r.Byte("backend name length")), "backend name"))
		if r.Err() != nil {
			break
		}
		if err := checkName(name); err != nil {
			r.FailAtf(at, "backend %d: %v", i, err)
			break
		}
		if slices.ContainsFunc(cs, func(c agent.ConnInfo) bool { return c.Backend == name }) {
			r.FailAtf(at, "backend %d: %q given twice", i, name)
			break
		}
		at = r.Offset()
		dlen := r.Uvarint("connection data length")
		if r.Err() == nil && dlen > maxConnDataLen {
			r.FailAtf(at, "backend %q: want at most %d bytes of connection data, found %d", name, maxConnDataLen, dlen)
		}
		data := bytes.Clone(r.Bytes(int(dlen), "connection data"))
		cs = append(cs, agent.ConnInfo{Backend: name, Data: data})
	}
	return cs
}

func checkName(s string) error {
	if len(s) < 1 || len(s) > maxNameLen {
		return fmt.Errorf("backend name %q: want 1 to %d bytes, found %d", s, maxNameLen, len(s))
	}
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case 'a' <= c && c <= 'z', '0' <= c && c <= '9', c == '.', c == '_', c == '-':
		default:
			return fmt.Errorf("backend name %q: want [a-z0-9._-], found %q", s, c)
		}
	}
	return nil
}

// unframe checks the frame both binary forms share (magic, version, at
// least minLen bytes, and a CRC-32C of every byte before it in the last
// crcLen) and returns the bytes the CRC covers. The error says what was
// expected and what was found, quoting the input's bytes.
func unframe(b, magic []byte, version byte, minLen int) ([]byte, error) {
	hl := len(magic) + 1
	if len(b) < hl || !bytes.Equal(b[:len(magic)], magic) {
		return nil, fmt.Errorf("want magic %q and a version, found %q", magic, b[:min(len(b), hl)])
	}
	if b[hl-1] != version {
		return nil, fmt.Errorf("want version %d, found version %d", version, b[hl-1])
	}
	if len(b) < minLen {
		return nil, fmt.Errorf("want at least %d bytes, found %d (truncated)", minLen, len(b))
	}
	body := b[:len(b)-crcLen]
	if want, got := binary.LittleEndian.Uint32(b[len(body):]), crc32.Checksum(body, castagnoli); want != got {
		return nil, fmt.Errorf("want CRC-32C 0x%08x, computed 0x%08x (damaged or truncated)", want, got)
	}
	return body, nil
}

// decodeMetadata parses a binary token. It checks every count against the
// bytes that remain before allocating for it, so a short input cannot make
// it allocate much.
func decodeMetadata(b []byte) (Metadata, error) {
	m, _, err := decode(b)
	return m, err
}

// decode is decodeMetadata, which also returns, for b cut short (too short
// for a token, or failing its checksum where its fields run past its end),
// how many bytes its fields call for, at least; else 0.
func decode(b []byte) (m Metadata, need int, err error) {
	body, err := unframe(b, metaMagic[:], metaVersion, minLen)
	if err != nil {
		if need = truncatedLen(b); need > len(b) {
			err = fmt.Errorf("want at least %d bytes, found %d (truncated)", need, len(b))
		} else {
			need = 0
		}
		return Metadata{}, need, fmt.Errorf("%w: %w", ErrInvalidMetadata, err)
	}

	r := wire.NewReader(body[3:], 3)
	m.kind = OperationKind(r.Byte("kind"))
	if m.kind != KindRead && m.kind != KindWrite {
		r.FailAtf(3, "want kind %d (READ) or %d (WRITE), found %d", KindRead, KindWrite, m.kind)
	}
	var key agent.Key
	copy(key[:], r.Bytes(len(key), "key"))
	m.key = seal(key)
	at := r.Offset()
	copy(m.peer.ID[:], r.Bytes(len(m.peer.ID), "agent ID"))
	if r.Err() == nil && m.peer.ID == uuid.Nil {
		r.FailAtf(at, "want an agent ID, found the nil UUID")
	}

	m.peer.Conns = readConns(r, 0)

	at = r.Offset()
	n := r.Uvarint("descriptor count")
	if left := r.Remaining(); r.Err() == nil && (n < 1 || n > uint64(left/minRegionLen)) {
		r.FailAtf(at, "want 1 to %d descriptors (%d bytes left, %d or more each), found %d", left/minRegionLen, left, minRegionLen, n)
	}
	if r.Err() == nil {
		m.regions = make([]agent.Region, n)
	}
	for i := range m.regions {
		at = r.Offset()
		reg := agent.Region{Addr: r.U64("address"), Len: r.Uvarint("size")}
		w := r.Uvarint("memory kind")
		if r.Err() != nil {
			break
		}
		reg.Kind, reg.Device = agent.MemKind(w&1), uint32(w>>1)
		switch {
		case reg.Len == 0:
			r.FailAtf(at, "descriptor %d: want a size of at least 1, found 0", i)
		case reg.Len > math.MaxInt:
			// Sizes reach callers as int (Sizes); one that does not fit is
			// no region any process can expose.
			r.FailAtf(at, "descriptor %d: want a size of at most %d, found %d", i, math.MaxInt, reg.Len)
		case reg.Addr+reg.Len < reg.Addr:
			r.FailAtf(at, "descriptor %d: address 0x%x + size %d overflows", i, reg.Addr, reg.Len)
		case w>>1 > math.MaxUint32:
			r.FailAtf(at, "descriptor %d: want a device below 2^32, found %d", i, w>>1)
		case reg.Kind == agent.KindDRAM && reg.Device != 0:
			r.FailAtf(at, "descriptor %d: want device 0 for host memory, found %d", i, reg.Device)
		}
		m.regions[i] = reg
	}
	if r.Err() == nil && r.Remaining() > 0 {
		r.Failf("want the checksum next, found %d extra bytes", r.Remaining())
	}
	if err := r.Err(); err != nil {
		return Metadata{}, 0, fmt.Errorf("%w: %w", ErrInvalidMetadata, err)
	}
	return m, 0, nil
}

// truncatedLen tells a token cut short from a damaged one: for b that
// starts as a token does (magic and version), it walks the fields, checking
// nothing but their lengths, and returns how many bytes they call for with
// the checksum, at least. More than len(b) means b was cut short. It
// returns 0 for b that is no token's start, or whose fields no token has.
func truncatedLen(b []byte) int {
	head := append(metaMagic[:], metaVersion)
	if len(b) < len(head) || !bytes.Equal(b[:len(head)], head) {
		return 0
	}
	p := headerLen
	// short is the fewest bytes of a token whose fields run out at p (or
	// past b), with at least more bytes and regions more descriptors to
	// come before the checksum.
	short := func(more int, regions uint64) int {
		return max(p, len(b)+1) + more + int(regions)*minRegionLen + crcLen
	}
	// uvarint reads the varint at p; out when b ends first, bad when it
	// overflows.
	uvarint := func() (v uint64, out, bad bool) {
		if p >= len(b) {
			return 0, true, false
		}
		v, n := binary.Uvarint(b[p:])
		switch {
		case n == 0:
			return 0, true, false
		case n < 0:
			return 0, false, true
		}
		p += n
		return v, false, false
	}
	if p > len(b) {
		return short(2, 1) // the counts of backends and descriptors
	}
	nc, out, bad := uvarint()
	switch {
	case bad || nc > maxConns:
		return 0
	case out:
		return short(1, 1)
	}
	for range nc {
		if p >= len(b) {
			return short(1, 1)
		}
		p += 1 + int(b[p]) // the name's length and the name
		dlen, out, bad := uvarint()
		switch {
		case bad || dlen > maxConnDataLen:
			return 0
		case out:
			return short(1, 1)
		}
		p += int(dlen)
	}
	n, out, bad := uvarint()
	switch {
	case bad || n > maxRegions:
		return 0
	case out:
		return short(0, 1)
	}
	for i := range n {
		if p += 8; p > len(b) {
			return short(2, n-i-1)
		}
		if _, out, bad := uvarint(); bad {
			return 0
		} else if out {
			return short(1, n-i-1)
		}
		if _, out, bad := uvarint(); bad {
			return 0
		} else if out {
			return short(0, n-i-1)
		}
	}
	return p + crcLen
}
