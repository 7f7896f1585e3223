package ucx

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/wire"
)

// The control protocol: active messages on one UCX active-message id, each
// a fixed header and a body. Every message names the connection it belongs
// to by the receiver's connection ID (dst), a random 128-bit value the
// receiver chose, so a message is matched to its connection without
// trusting the sender's word; hello, which opens a connection, names none.
// All integers are little-endian.
//
//	header (24 bytes)
//	  0  version u8
//	  1  type    u8
//	  2  status  u8   (open: the access asked for; welcome, grant: 0 ok, else refused)
//	  3  -       u8
//	  4  count   u32  (open: ranges; grant: remote keys)
//	  8  dst     [16]byte
//
//	hello   active→passive  from [16], expect [16], src [16], worker address (the rest)
//	welcome passive→active  src [16], from [16]
//	open    active→passive  lease u64, key [16], count × (address u64, length u64);
//	                        a READ the exposing side pushes (header byte 3 = 1) then
//	                        has count × local address u64, a key count u32, and the
//	                        reader's keys and key indices as in a grant; an inline
//	                        open (header byte 3 = 2; at most maxInline bytes in all)
//	                        is answered at once: a WRITE's bytes follow the ranges, in
//	                        order, and the exposing side copies them in; a READ's come
//	                        back in the grant
//	grant   passive→active  lease u64; ok: count × (registration u64, length u16, packed
//	                        remote key), then one u16 key index per range; inline: count
//	                        0, and a READ's bytes; else error text
//	release active→passive  lease u64
//	notify  active→passive  key [16], message (the rest)
//	ping, pong, bye         nothing
const (
	hdrSize      = 24
	protoVersion = 1

	tHello   = 1
	tWelcome = 2
	tOpen    = 3
	tGrant   = 4
	tRelease = 5
	tNotify  = 6
	tPing    = 7
	tPong    = 8
	tBye     = 9

	stOK     = 0
	stDenied = 1 // refused by the exposing agent
	stLost   = 2 // the exposing agent is closing

	maxAddr    = 64 << 10 // largest worker address accepted in a hello
	maxErrMsg  = 1 << 10
	maxRkey    = 64 << 10 // largest packed remote key
	rangeBytes = 16
	// maxInline is the most bytes an inline open moves: small transfers
	// travel in the control messages themselves, one round trip, and the
	// exposing side copies every byte after checking its range.
	maxInline = 16 << 10
)

// cid is a connection ID.
type cid [16]byte

// errProtocol marks a message that breaks the protocol; it is dropped and
// counted as refused.
var errProtocol = errors.New("ucx: protocol violation")

// errLimit marks a message over one of this agent's limits (ranges in a
// lease request, a notification's size); it wraps errProtocol, and is
// counted apart.
var errLimit = fmt.Errorf("%w: over a limit", errProtocol)

// msg is a decoded message. Its slices alias the input.
type msg struct {
	typ, status uint8
	count       uint32
	dst         cid
	from, peer  uuid.UUID // hello: from, expect; welcome: from
	src         cid       // hello, welcome
	addr        []byte    // hello
	lease       uint64    // open, grant, release
	push        bool      // open: the exposing side writes into the reader's memory
	inline      bool      // open: the bytes travel in the open (WRITE) or the grant (READ)
	data        []byte    // inline WRITE open: the bytes, range after range
	local       []byte    // push open: the reader's addresses
	nkeys       uint32    // push open: the reader's keys
	keys        []byte    // push open: keys and indices, as in a grant
	key         agent.Key // open, notify
	body        []byte    // open: ranges; grant: keys and indices, or error text; notify: message
}

func header(b []byte, typ, status uint8, count uint32, dst cid) []byte {
	b = append(b, protoVersion, typ, status, 0)
	b = binary.LittleEndian.AppendUint32(b, count)
	return append(b, dst[:]...)
}

// limits bound what a message may carry.
type limits struct {
	maxRanges int
	maxNotify int
}

// parseMsg decodes and checks one message from an untrusted peer. It never
// panics and allocates nothing but its error.
func parseMsg(b []byte, lim limits) (msg, error) {
	var m msg
	if len(b) < hdrSize {
		return m, fmt.Errorf("%w: message of %d bytes, header is %d", errProtocol, len(b), hdrSize)
	}
	if b[0] != protoVersion {
		return m, fmt.Errorf("%w: version %d, want %d", errProtocol, b[0], protoVersion)
	}
	m.typ, m.status = b[1], b[2]
	m.count = binary.LittleEndian.Uint32(b[4:])
	copy(m.dst[:], b[8:24])
	r := wire.NewReader(b[hdrSize:], hdrSize)
	switch m.typ {
	case tHello:
		m.from = uuid.UUID(arr16(r.Bytes(16, "from")))
		m.peer = uuid.UUID(arr16(r.Bytes(16, "expect")))
		m.src = cid(arr16(r.Bytes(16, "src")))
		m.addr = r.Bytes(r.Remaining(), "address")
		if r.Err() == nil && (len(m.addr) == 0 || len(m.addr) > maxAddr) {
			return m, fmt.Errorf("%w: hello with a worker address of %d bytes, want 1 to %d", errProtocol, len(m.addr), maxAddr)
		}
	case tWelcome:
		m.src = cid(arr16(r.Bytes(16, "src")))
		m.from = uuid.UUID(arr16(r.Bytes(16, "from")))
	case tOpen:
		if m.count == 0 || uint64(m.count) > uint64(lim.maxRanges) {
			if m.count == 0 {
				return m, fmt.Errorf("%w: open of 0 ranges", errProtocol)
			}
			return m, fmt.Errorf("%w: open of %d ranges, at most %d", errLimit, m.count, lim.maxRanges)
		}
		if m.status != uint8(agent.AccessRead) && m.status != uint8(agent.AccessWrite) {
			return m, fmt.Errorf("%w: open for access %d", errProtocol, m.status)
		}
		m.lease = r.U64("lease")
		m.key = agent.Key(arr16(r.Bytes(16, "key")))
		m.body = r.Bytes(int(m.count)*rangeBytes, "ranges")
		switch b[3] {
		case 0:
		case 2:
			m.inline = true
			if r.Err() != nil {
				break
			}
			var total uint64
			for i := range int(m.count) {
				_, n := m.rangeAt(i)
				if n > maxInline || total+n > maxInline {
					return m, fmt.Errorf("%w: inline open of more than %d bytes", errProtocol, maxInline)
				}
				total += n
			}
			if m.status == uint8(agent.AccessWrite) {
				m.data = r.Bytes(int(total), "inline bytes")
			}
		case 1:
			if m.status != uint8(agent.AccessRead) {
				return m, fmt.Errorf("%w: push open for access %d", errProtocol, m.status)
			}
			m.push = true
			m.local = r.Bytes(int(m.count)*8, "local addresses")
			if nk := r.Bytes(4, "key count"); nk != nil {
				m.nkeys = binary.LittleEndian.Uint32(nk)
			}
			m.keys = r.Bytes(r.Remaining(), "keys")
		default:
			return m, fmt.Errorf("%w: open flags %d", errProtocol, b[3])
		}
	case tGrant:
		m.lease = r.U64("lease")
		m.body = r.Bytes(r.Remaining(), "grant")
		if m.status != stOK && len(m.body) > maxErrMsg {
			return m, fmt.Errorf("%w: refusal text of %d bytes", errProtocol, len(m.body))
		}
	case tRelease:
		m.lease = r.U64("lease")
	case tNotify:
		m.key = agent.Key(arr16(r.Bytes(16, "key")))
		m.body = r.Bytes(r.Remaining(), "message")
		if len(m.body) > lim.maxNotify {
			return m, fmt.Errorf("%w: notification of %d bytes, at most %d", errLimit, len(m.body), lim.maxNotify)
		}
	case tPing, tPong, tBye:
	default:
		return m, fmt.Errorf("%w: message type %d", errProtocol, m.typ)
	}
	if err := r.Err(); err != nil {
		return m, fmt.Errorf("%w: message type %d: %w", errProtocol, m.typ, err)
	}
	if m.typ != tOpen && m.typ != tGrant && m.count != 0 {
		return m, fmt.Errorf("%w: message type %d with count %d", errProtocol, m.typ, m.count)
	}
	if r.Remaining() != 0 {
		return m, fmt.Errorf("%w: message type %d with %d trailing bytes", errProtocol, m.typ, r.Remaining())
	}
	return m, nil
}

// arr16 copies up to 16 bytes of b into an array: a failed read is nil.
func arr16(b []byte) (a [16]byte) {
	copy(a[:], b)
	return a
}

// rangeAt returns range i of an open's table.
func (m *msg) rangeAt(i int) (addr, n uint64) {
	b := m.body[i*rangeBytes:]
	return binary.LittleEndian.Uint64(b), binary.LittleEndian.Uint64(b[8:])
}

// localAt returns the reader's address for range i of a push open.
func (m *msg) localAt(i int) uint64 { return binary.LittleEndian.Uint64(m.local[i*8:]) }

// grantKey is one remote key of a grant.
type grantKey struct {
	reg    uint64 // the exposing agent's registration it unlocks
	packed []byte // aliases the message
}

// parseGrant decodes an accepted grant's body: count remote keys, then one
// key index per range of the lease (ranges of them). keys and idx are
// reused.
func parseGrant(body []byte, count uint32, ranges int, keys []grantKey, idx []uint16) ([]grantKey, []uint16, error) {
	keys, idx = keys[:0], idx[:0]
	if count == 0 || uint64(count) > uint64(ranges) {
		return keys, idx, fmt.Errorf("%w: grant of %d keys for %d ranges", errProtocol, count, ranges)
	}
	r := wire.NewReader(body, 0)
	for range count {
		reg := r.U64("registration")
		lb := r.Bytes(2, "key length")
		if lb == nil {
			break
		}
		n := int(binary.LittleEndian.Uint16(lb))
		if n == 0 {
			r.Failf("empty remote key")
			break
		}
		keys = append(keys, grantKey{reg: reg, packed: r.Bytes(n, "remote key")})
	}
	tab := r.Bytes(2*ranges, "key indices")
	if err := r.Err(); err != nil {
		return keys, idx, fmt.Errorf("%w: grant: %w", errProtocol, err)
	}
	if r.Remaining() != 0 {
		return keys, idx, fmt.Errorf("%w: grant with %d trailing bytes", errProtocol, r.Remaining())
	}
	for i := range ranges {
		k := binary.LittleEndian.Uint16(tab[2*i:])
		if uint32(k) >= count {
			return keys, idx, fmt.Errorf("%w: range %d names key %d of %d", errProtocol, i, k, count)
		}
		idx = append(idx, k)
	}
	return keys, idx, nil
}

// connInfo is what the backend publishes: version u8, flags u8, host
// identity [8] (boot and network namespace), then the worker address.
type connInfo struct {
	net  bool // the transports reach other hosts
	host [8]byte
	addr []byte
}

const flagNet = 1

func (c connInfo) marshal() []byte {
	b := make([]byte, 0, 10+len(c.addr))
	var flags uint8
	if c.net {
		flags |= flagNet
	}
	b = append(b, protoVersion, flags)
	b = append(b, c.host[:]...)
	return append(b, c.addr...)
}

func parseConnInfo(b []byte) (connInfo, error) {
	var c connInfo
	if len(b) < 11 || len(b) > 10+maxAddr {
		return c, fmt.Errorf("ucx connection info of %d bytes, want 11 to %d", len(b), 10+maxAddr)
	}
	if b[0] != protoVersion {
		return c, fmt.Errorf("ucx connection info version %d, want %d", b[0], protoVersion)
	}
	c.net = b[1]&flagNet != 0
	copy(c.host[:], b[2:10])
	c.addr = b[10:]
	return c, nil
}

// cursor is a position in a transfer's segments (agent.Cursor).
type cursor = agent.Cursor
