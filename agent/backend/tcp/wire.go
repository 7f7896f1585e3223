package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/framehdr"
	"github.com/goxfer/goxfer/internal/hostid"
)

// The wire protocol. Every connection starts with a handshake (the dialer
// names itself and the agent it expects; the listener answers with its own
// identity), then carries frames: a fixed header, for READ and WRITE a table
// of (address, length) pieces, then payload. All integers are little-endian.
//
//	header (40 bytes)
//	  0  type    u8
//	  1  status  u8   (answers: 0 ok, else a status code; message follows;
//	                   a WRITE: stTrailer if a notification trails it)
//	  2  -       u16
//	  4  count   u32  pieces in the table
//	  8  id      u64  request sequence number, echoed in the answer
//	 16  length  u64  payload bytes after the table
//	 24  key     [16]byte
//
// A WRITE whose status is stTrailer, sent only to an agent whose handshake
// announced that it takes them, carries its transfer's notification after
// the payload: length is the payload, then the message, then one byte, 1
// if the frame is whole (0 if its sender, cancelled, padded the rest with
// zeros). The exposing agent delivers the message after the payload
// landed, before it acknowledges: one message fewer, and no second
// connection to wake.
//
// A data connection's answers come in request order; the id is a check.
// A ping's id is the bytes its sender has received on the connection so
// far, handshake included: a peer waiting for an answer can tell a request
// still arriving from a claim.
const (
	hdrSize   = framehdr.HeaderSize
	pieceSize = 16
	hsSize    = 64

	tRead     = 1 // active→passive: read the pieces; answered by tReadResp
	tReadResp = 2 // passive→active: status, then the pieces' bytes in order
	tWrite    = 3 // active→passive: pieces, then their bytes; answered by tWriteAck
	tWriteAck = 4
	tNotify   = 5 // either way: length bytes of message for key
	tPing     = 6 // keepalive, no payload
	tBye      = 7 // orderly close: the sender is going away on purpose

	stOK     = 0
	stDenied = 1 // access refused by the exposing agent
	stLimit  = 2 // handshake: too many connections from this peer
	stBusy   = 3 // ping: bytes of a request arrived since the last ping
	stIdle   = 4 // goodbye: an idle connection closed, the sender is not leaving

	stTrailer = 1 // WRITE: its notification trails the payload

	hsTrailers = 1 // handshake flag: this agent takes WRITEs with stTrailer

	maxNotify = 64 << 10 // largest notification accepted
	maxErrMsg = 1 << 10  // largest error message accepted in an answer

	protoVersion = 2 // 2: the session in the handshake, bytes received in pings, idle goodbyes

	infoVersion = 1 // of connInfo
)

var magic = [4]byte{'G', 'X', 'T', 'P'}

// errProtocol marks a peer that broke the wire protocol; the connection is
// dropped and the refusal counted.
var errProtocol = errors.New("tcp: protocol violation")

// errLimit marks a peer that went over one of this agent's limits; it wraps
// errProtocol, and is counted apart.
var errLimit = fmt.Errorf("%w: over a limit", errProtocol)

type header struct {
	typ    uint8
	status uint8
	count  uint32
	id     uint64
	length uint64
	key    agent.Key
}

// put encodes h as a [framehdr.Header].
func (h *header) put(b []byte) {
	f := framehdr.Header{Type: h.typ, Status: h.status, Count: h.count, ID: h.id, Length: h.length, Key: h.key}
	f.Put(b)
}

// get decodes a [framehdr.Header] into h.
func (h *header) get(b []byte) {
	var f framehdr.Header
	f.Get(b)
	*h = header{typ: f.Type, status: f.Status, count: f.Count, id: f.ID, length: f.Length, key: f.Key}
}

// handshake: magic[4] version u8 stream u8 flags u8 status u8 self[16]
// expect[16] timeout u32 (the sender's keepalive timeout in milliseconds)
// pieces u16 frame u16 (the most pieces and payload bytes, in units of
// frameUnit, the sender accepts in one request; zero from agents that
// predate them: unknown) session[16] (the dialler's session: random, shared
// by all the connections of one dialling peer, so that the listener groups
// them into one agent.Link by something only that peer knows). The answer
// has the same shape, with expect and session zero. Flags: hsTrailers;
// zero from agents that predate them.
type handshake struct {
	stream, status uint8
	trailers       bool // takes WRITEs with their notification (stTrailer)
	self, expect   uuid.UUID
	session        [16]byte
	timeout        time.Duration
	maxPieces      int // 0: not announced
	maxFrame       int // bytes, a multiple of frameUnit; 0: not announced
}

// frameUnit is the unit in which a handshake announces the max frame size.
// Announcements round down, so a peer never takes more than allowed.
const frameUnit = 4 << 10

func (h *handshake) put(b []byte) {
	_ = b[hsSize-1]
	copy(b[0:4], magic[:])
	var flags uint8
	if h.trailers {
		flags |= hsTrailers
	}
	b[4], b[5], b[6], b[7] = protoVersion, h.stream, flags, h.status
	copy(b[8:24], h.self[:])
	copy(b[24:40], h.expect[:])
	binary.LittleEndian.PutUint32(b[40:], uint32(min(h.timeout.Milliseconds(), math.MaxUint32)))
	binary.LittleEndian.PutUint16(b[44:], uint16(min(max(h.maxPieces, 0), math.MaxUint16)))
	binary.LittleEndian.PutUint16(b[46:], uint16(min(max(h.maxFrame/frameUnit, 0), math.MaxUint16)))
	copy(b[48:64], h.session[:])
}

func getHandshake(b []byte) (handshake, error) {
	var h handshake
	if [4]byte(b[0:4]) != magic {
		return h, fmt.Errorf("%w: handshake magic %x, want %x", errProtocol, b[0:4], magic)
	}
	if b[4] != protoVersion {
		return h, fmt.Errorf("%w: protocol version %d, want %d", errProtocol, b[4], protoVersion)
	}
	h.stream, h.status = b[5], b[7]
	h.trailers = b[6]&hsTrailers != 0
	copy(h.self[:], b[8:24])
	copy(h.expect[:], b[24:40])
	h.timeout = time.Duration(binary.LittleEndian.Uint32(b[40:])) * time.Millisecond
	h.maxPieces = int(binary.LittleEndian.Uint16(b[44:]))
	h.maxFrame = int(binary.LittleEndian.Uint16(b[46:])) * frameUnit
	copy(h.session[:], b[48:64])
	return h, nil
}

// peerLimits returns the frame bytes and pieces to use towards a peer that
// announced maxFrame and maxPieces: ours, lowered to the peer's where it
// announced lower ones.
func peerLimits(chunk, pieces int, in handshake) (int, int) {
	if in.maxFrame > 0 {
		chunk = min(chunk, in.maxFrame)
	}
	if in.maxPieces > 0 {
		pieces = min(pieces, in.maxPieces)
	}
	return chunk, pieces
}

// pingEvery is how often a connection pings when idle: often enough for its
// own keepalive interval and for the peer's timeout, whichever asks more, so
// agents configured differently never declare each other lost.
func pingEvery(interval, peerTimeout time.Duration) time.Duration {
	every := interval
	if peerTimeout > 0 {
		every = min(every, peerTimeout/3)
	}
	return max(every, 10*time.Millisecond) // a hostile peer gets no ping storm
}

// connInfo is what the backend publishes: version u8, host identity [8],
// then the advertised host:port.
type connInfo struct {
	host [8]byte
	addr string
}

func (c connInfo) marshal() []byte {
	b := make([]byte, 0, 9+len(c.addr))
	b = append(b, infoVersion)
	b = append(b, c.host[:]...)
	return append(b, c.addr...)
}

func parseConnInfo(b []byte) (connInfo, error) {
	var c connInfo
	if len(b) < 10 || len(b) > 9+255 {
		return c, fmt.Errorf("tcp connection info of %d bytes, want 10 to 264", len(b))
	}
	if b[0] != infoVersion {
		return c, fmt.Errorf("tcp connection info version %d, want %d", b[0], infoVersion)
	}
	copy(c.host[:], b[1:9])
	c.addr = string(b[9:])
	if _, _, err := net.SplitHostPort(c.addr); err != nil {
		return c, fmt.Errorf("tcp connection info address %q: %v", c.addr, err)
	}
	return c, nil
}

// hostIdentity names this boot of this host and its network namespace: two
// agents with the same identity share a loopback interface.
func hostIdentity() [8]byte { return hostid.Of("net") }

func isLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// cursor is a position in a transfer's segments (agent.Cursor).
type cursor = agent.Cursor
