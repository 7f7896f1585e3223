package cma

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"iter"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/framehdr"
	"github.com/goxfer/goxfer/agent/devmem"
)

// The control protocol, over one Unix-domain stream socket per pair of
// agents, dialled by the agent that copies (the active side). It starts with
// a handshake each way, then carries frames: a fixed header, for a lease
// request a table of (address, length) ranges, for a staged grant a table
// of addresses, then a payload. All integers are little-endian.
//
//	handshake (72 bytes)
//	  0  magic   "GXCM"
//	  4  version u8
//	  5  status  u8   (hello: the access of the key presented, 0 for none;
//	                   answer: 0 ok, else refused)
//	  6  scope   u8   (answer: the host's Yama ptrace_scope, 0xff if none)
//	  7  ptracer u8   (answer: whether the dialler was named ptracer, ptr*)
//	  8  self    [16]byte  the sender's agent ID
//	 24  expect  [16]byte  the agent the dialler expects (hello only)
//	 40  pid     u32       the sender's process ID
//	 44  leases  u16       answer: the most lease requests the dialler may
//	                       have unended on the connection (0: maxLeases,
//	                       from an agent that predates the field)
//	 46  caps    u16       hello: what the dialler understands (capStaged);
//	                       answer: those of them the exposing side uses, and
//	                       0 to a dialler that announced none (agents that
//	                       predate the field read 44 as a u32 and send 0)
//	 48  probe   u64       address of the probe bytes (answer only)
//	 56  nonce   [16]byte  hello: a key of the expected agent's exposures
//	                       the dialler holds, or zeros; answer: what the
//	                       probe bytes hold
//
//	frame header (40 bytes)
//	  0  type    u8
//	  1  status  u8   (tBegin: the access asked for; tGrant: 0 ok, else
//	                  refused; tEnd: endWritten|endAck; tFlushed: 0 ok,
//	                  stFailed)
//	  2  -       u16
//	  4  count   u32  entries in the table: tBegin's ranges; a granted
//	                  tGrant's staged addresses, or with capDevice its
//	                  (address, share) pairs (0: none); else 0
//	  8  id      u64  lease number, chosen by the requester
//	 16  length  u32  payload bytes after the table
//	 20  -       u32
//	 24  key     [16]byte
//
// Staged grants. The exposing agent stages its device memory (VRAM) for
// cma as for tcp ([agent.DeviceStager]): a lease's [agent.Lease.Slice] on a
// VRAM range returns a pinned host buffer of the exposing process standing
// in for it, filled from the device for a READ, copied into the device
// (flushed) for a WRITE. The copying side must then copy at the buffer, not
// at the range's address. A grant whose ranges were all copied from where they
// were asked for has count 0; otherwise (only to a dialler that announced
// capStaged) count equals the request's and the table holds, per range in
// the request's order, the address u64 to copy at instead: the buffer's
// for a staged range, the range's own for the others. The copying side
// drops a connection whose grant names another count, or an address whose
// range would wrap. The exposing side keeps the lease, and so its buffers,
// until tEnd. A WRITE's tEnd says whether every byte of the lease was
// written (endWritten): only then are the buffers copied into the device
// (the others are given back unflushed, as far as the agent allows), before
// the next frame is read, so a tNotify sent after the tEnd is delivered
// after that copy. For a WRITE lease that staged, the copying side also
// asks (endAck) to hear the outcome: the exposing side answers tFlushed,
// status 0 once the bytes are in the device, or stFailed with an error
// text, and the copying side ends the transfer only then, with that
// outcome. A lease request with staged ranges is staged off the
// connection's reader (the buffers may take a while to come free): its
// grant may follow grants and tFlushed answers of later frames. At most
// maxPending requests may wait for staging, ended ones included.
const (
	hsSize    = 72
	hdrSize   = framehdr.HeaderSize
	rangeSize = 16
	addrSize  = 8 // a staged grant's table entry

	tBegin   = 1 // active→passive: lease the ranges for access; answered by tGrant
	tGrant   = 2 // passive→active: status; staged addresses, or on refusal an error text
	tEnd     = 3 // active→passive: the lease is over; answered by tFlushed if endAck
	tNotify  = 4 // active→passive: length bytes of message for key
	tBye     = 5 // either way: orderly close
	tFlushed = 6 // passive→active: a staged WRITE reached the device, or stFailed and why
	tShare   = 7 // passive→active: a device allocation the copier may map (capDevice)
	tUnshare = 8 // passive→active: unmap that allocation: no exposure it served lives

	// tEnd's status bits.
	endWritten = 1 << 0 // every byte of the WRITE lease was written: copy it into the device
	endAck     = 1 << 1 // answer with tFlushed

	stOK     = 0
	stDenied = 1 // access refused by the exposing agent
	stLost   = 2 // the exposing agent is closing
	stWrong  = 3 // handshake: this is not the agent expected
	stFailed = 4 // tFlushed: the staged bytes did not reach the device

	maxErrMsg = 1 << 10 // largest error text in a tGrant or tFlushed

	protoVersion = 1
	noScope      = 0xff

	// capStaged, in the handshake's caps: grants may name staged
	// addresses (count > 0), for ranges of device memory, and tEnd may ask
	// for tFlushed.
	capStaged = 1 << 0
	// capDevice, in the handshake's caps: the dialler maps device
	// allocations the exposing side shares (tShare) and copies them on its
	// GPU; in the answer, the exposing side shares them, and its grants'
	// tables hold two words per range (address, share). capSim names the
	// simulated device (devmem.Sim) on both sides: a simulated allocation
	// means nothing to the CUDA driver, nor the reverse, so the answer
	// grants capDevice only to a dialler of the same kind.
	capDevice = 1 << 1
	capSim    = 1 << 2
	localCaps = capStaged | capDevice | capSim // what this agent understands

	// shareSize is a tShare's payload: GPU UUID [16], base u64, size u64,
	// CUDA IPC handle [64] (zeros for a share by file descriptor, which
	// rides on the frame's first byte as SCM_RIGHTS).
	shareSize = 16 + 8 + 8 + devmem.HandleSize
	// devEntrySize is a grant's table entry once capDevice is agreed: the
	// address to copy at u64, and the share it lies in u64 (0: the
	// exposing process's host memory, copied with process_vm_readv/writev).
	devEntrySize = 16

	// The handshake answer's ptracer field, under Yama mode 1.
	ptrNone    = 0 // not asked for: no Yama mode 1, or the handshake was refused
	ptrNamed   = 1 // the dialler is this process's ptracer while connected
	ptrNoKey   = 2 // the dialler presented no key
	ptrRefused = 3 // the key presented names no live exposure of that access
	ptrHeld    = 4 // another process holds the exception: one at a time
	ptrOff     = 5 // the exposing agent runs with WithPtracer(false)
)

var magic = [4]byte{'G', 'X', 'C', 'M'}

// maxLeases bounds the leases one connection may hold at once. The exposing
// side announces it in its handshake answer, and the copying side keeps at
// most that many lease requests unended per connection, queueing the rest,
// so that any number of transfers share a connection within it.
const maxLeases = 1024

// errProtocol marks a peer that broke the protocol; the connection is
// dropped and the refusal counted.
var errProtocol = errors.New("cma: protocol violation")

type header struct {
	typ    uint8
	status uint8
	count  uint32
	id     uint64
	length uint32
	key    agent.Key
}

// put encodes h as a [framehdr.Header].
func (h *header) put(b []byte) {
	f := framehdr.Header{Type: h.typ, Status: h.status, Count: h.count, ID: h.id, Length: uint64(h.length), Key: h.key}
	f.Put(b)
}

// get decodes a [framehdr.Header] into h.
func (h *header) get(b []byte) {
	var f framehdr.Header
	f.Get(b)
	*h = header{typ: f.Type, status: f.Status, count: f.Count, id: f.ID, length: uint32(f.Length), key: f.Key}
}

// limits bound what a frame may carry.
type limits struct {
	maxRanges int // ranges in one tBegin
	maxNotify int // bytes in one tNotify
	// entry is the size of a granted tGrant's table entry: addrSize, or
	// devEntrySize on a connection that agreed capDevice.
	entry int
	// shm: the connection agreed capShm (shared host memory frames).
	shm bool
}

// frame is a decoded frame. table and payload alias the reader's buffer and
// are valid until the next read.
type frame struct {
	header
	table   []byte // count × (address u64, length u64)
	payload []byte
}

// rangeAt returns range i of a tBegin's table.
func (f *frame) rangeAt(i int) (addr, n uint64) { return rangeAt(f.table, i) }

// rangeAt returns range i of a table of ranges.
func rangeAt(table []byte, i int) (addr, n uint64) {
	b := table[i*rangeSize:]
	return binary.LittleEndian.Uint64(b), binary.LittleEndian.Uint64(b[8:])
}

// stagedAddrs decodes the table of a granted tGrant, f, which answers a
// request of the ranges whose lengths lens yields, in order: nil if the
// grant names no staged address (copy at the ranges' own), else the
// address to copy each range at. f comes from the peer: a table whose
// count is not the request's, or an address whose range would wrap or
// start at 0, is a protocol violation. The addresses are used only in
// process_vm_readv/writev on the peer's own process, which refuses what is
// not mapped there.
func stagedAddrs(f *frame, ranges int, lens iter.Seq[uint64]) ([]uint64, error) {
	if f.count == 0 {
		return nil, nil
	}
	if int(f.count) != ranges || len(f.table) != ranges*addrSize {
		return nil, fmt.Errorf("%w: grant of lease %d names %d staged addresses for the %d ranges requested", errProtocol, f.id, f.count, ranges)
	}
	addrs := make([]uint64, ranges)
	i := 0
	for n := range lens {
		if i == ranges {
			return nil, fmt.Errorf("%w: lease %d requested more than the %d ranges its grant answers", errProtocol, f.id, ranges)
		}
		a := binary.LittleEndian.Uint64(f.table[i*addrSize:])
		if a == 0 || a+n < a {
			return nil, fmt.Errorf("%w: grant of lease %d stages range %d (%d bytes) at 0x%x", errProtocol, f.id, i, n, a)
		}
		addrs[i] = a
		i++
	}
	if i != ranges {
		return nil, fmt.Errorf("%w: lease %d requested %d ranges, its grant names %d staged addresses", errProtocol, f.id, i, ranges)
	}
	return addrs, nil
}

// readFrame reads and checks one frame from r, an untrusted peer: it never
// allocates more than the limits allow and returns an error wrapping
// errProtocol for any frame that breaks them. buf is reused for the table
// and payload.
func readFrame(r io.Reader, hdr []byte, buf *[]byte, lim limits, f *frame) error {
	if _, err := io.ReadFull(r, hdr[:hdrSize]); err != nil {
		return err
	}
	f.header.get(hdr)
	var tableLen, maxLen int
	switch f.typ {
	case tBegin:
		if f.count == 0 || uint64(f.count) > uint64(lim.maxRanges) {
			err := errProtocol
			if f.count != 0 {
				err = errLimit
			}
			return fmt.Errorf("%w: lease request of %d ranges, want 1 to %d", err, f.count, lim.maxRanges)
		}
		if f.status != uint8(agent.AccessRead) && f.status != uint8(agent.AccessWrite) {
			return fmt.Errorf("%w: lease request for access %d", errProtocol, f.status)
		}
		tableLen = int(f.count) * rangeSize
	case tGrant:
		maxLen = maxErrMsg
		if f.count != 0 {
			if f.status != stOK || uint64(f.count) > uint64(lim.maxRanges) {
				return fmt.Errorf("%w: grant with status %d and %d staged addresses, want status %d and at most %d", errProtocol, f.status, f.count, stOK, lim.maxRanges)
			}
			entry := lim.entry
			if entry == 0 {
				entry = addrSize
			}
			tableLen = int(f.count) * entry
		}
	case tShare:
		if lim.entry != devEntrySize {
			return fmt.Errorf("%w: a device share on a connection that agreed none", errProtocol)
		}
		if f.status != uint8(devmem.ShareHandle) && f.status != uint8(devmem.ShareFD) {
			return fmt.Errorf("%w: device share of kind %d, want %d or %d", errProtocol, f.status, devmem.ShareHandle, devmem.ShareFD)
		}
		if f.id == 0 || f.length != shareSize {
			return fmt.Errorf("%w: device share %d of %d bytes, want a nonzero id and %d bytes", errProtocol, f.id, f.length, shareSize)
		}
		maxLen = shareSize
	case tUnshare:
		if lim.entry != devEntrySize || f.id == 0 {
			return fmt.Errorf("%w: unshare of device share %d on a connection that agreed none", errProtocol, f.id)
		}
	case tUse:
		if !lim.shm {
			return fmt.Errorf("%w: a shared-memory use on a connection that agreed none", errProtocol)
		}
		if f.status != uint8(agent.AccessRead) && f.status != uint8(agent.AccessWrite) {
			return fmt.Errorf("%w: shared-memory use for access %d", errProtocol, f.status)
		}
	case tTable, tSeg, tSegDrop:
		if !lim.shm {
			return fmt.Errorf("%w: shared-memory frame type %d on a connection that agreed none", errProtocol, f.typ)
		}
		if f.typ == tSeg {
			maxLen = segInfoSize
			if f.id == 0 || f.length != segInfoSize {
				return fmt.Errorf("%w: segment %d with %d payload bytes, want a nonzero id and %d", errProtocol, f.id, f.length, segInfoSize)
			}
		}
	case tNotify:
		maxLen = lim.maxNotify
	case tFlushed:
		maxLen = maxErrMsg
		if f.status != stOK && f.status != stFailed {
			return fmt.Errorf("%w: flush answer with status %d", errProtocol, f.status)
		}
	case tEnd:
		if f.status&^(endWritten|endAck) != 0 {
			return fmt.Errorf("%w: lease end with status %#x", errProtocol, f.status)
		}
	case tBye:
	default:
		return fmt.Errorf("%w: frame type %d", errProtocol, f.typ)
	}
	if f.typ != tBegin && f.typ != tGrant && f.count != 0 {
		return fmt.Errorf("%w: frame type %d with %d ranges", errProtocol, f.typ, f.count)
	}
	if uint64(f.length) > uint64(maxLen) {
		err := errLimit
		if maxLen == 0 {
			err = errProtocol // a frame type that carries no payload
		}
		return fmt.Errorf("%w: frame type %d with %d payload bytes, at most %d", err, f.typ, f.length, maxLen)
	}
	n := tableLen + int(f.length)
	if cap(*buf) < n {
		*buf = make([]byte, n)
	}
	b := (*buf)[:n]
	if _, err := io.ReadFull(r, b); err != nil {
		return err
	}
	f.table, f.payload = b[:tableLen], b[tableLen:]
	return nil
}

// handshake is the first message each way.
type handshake struct {
	status, scope uint8
	ptracer       uint8
	self, expect  uuid.UUID
	pid           uint32
	leases        uint16
	caps          uint16
	probe         uint64
	nonce         [16]byte
}

func (h *handshake) put(b []byte) {
	_ = b[hsSize-1]
	copy(b[0:4], magic[:])
	b[4], b[5], b[6], b[7] = protoVersion, h.status, h.scope, h.ptracer
	copy(b[8:24], h.self[:])
	copy(b[24:40], h.expect[:])
	binary.LittleEndian.PutUint32(b[40:], h.pid)
	binary.LittleEndian.PutUint16(b[44:], h.leases)
	binary.LittleEndian.PutUint16(b[46:], h.caps)
	binary.LittleEndian.PutUint64(b[48:], h.probe)
	copy(b[56:72], h.nonce[:])
}

func getHandshake(b []byte) (handshake, error) {
	var h handshake
	_ = b[hsSize-1]
	if [4]byte(b[0:4]) != magic {
		return h, fmt.Errorf("%w: handshake magic %x, want %x", errProtocol, b[0:4], magic)
	}
	if b[4] != protoVersion {
		return h, fmt.Errorf("%w: protocol version %d, want %d", errProtocol, b[4], protoVersion)
	}
	h.status, h.scope, h.ptracer = b[5], b[6], b[7]
	copy(h.self[:], b[8:24])
	copy(h.expect[:], b[24:40])
	h.pid = binary.LittleEndian.Uint32(b[40:])
	h.leases = binary.LittleEndian.Uint16(b[44:])
	h.caps = binary.LittleEndian.Uint16(b[46:])
	h.probe = binary.LittleEndian.Uint64(b[48:])
	copy(h.nonce[:], b[56:72])
	return h, nil
}

// connInfo is what the backend publishes: version u8, host identity [8]
// (boot, PID and network namespaces), process ID u32, then the name of its
// socket in the abstract namespace.
type connInfo struct {
	host [8]byte
	pid  uint32
	sock string
}

const maxSockName = 107 // sun_path less the abstract namespace's leading NUL

func (c connInfo) marshal() []byte {
	b := make([]byte, 0, 13+len(c.sock))
	b = append(b, protoVersion)
	b = append(b, c.host[:]...)
	b = binary.LittleEndian.AppendUint32(b, c.pid)
	return append(b, c.sock...)
}

func parseConnInfo(b []byte) (connInfo, error) {
	var c connInfo
	if len(b) < 14 || len(b) > 13+maxSockName {
		return c, fmt.Errorf("cma connection info of %d bytes, want 14 to %d", len(b), 13+maxSockName)
	}
	if b[0] != protoVersion {
		return c, fmt.Errorf("cma connection info version %d, want %d", b[0], protoVersion)
	}
	copy(c.host[:], b[1:9])
	c.pid = binary.LittleEndian.Uint32(b[9:13])
	if c.pid == 0 {
		return c, errors.New("cma connection info names process 0")
	}
	c.sock = string(b[13:])
	return c, nil
}

// cursor is a position in a transfer's segments (agent.Cursor).
type cursor = agent.Cursor

// share is a decoded tShare: a device allocation of the exposing process
// the copier may map. Untrusted until [devmem.Sharer.Import] accepts it.
type share struct {
	id   uint64
	kind devmem.ShareKind
	gpu  [16]byte
	base uint64
	size uint64
	hdl  [devmem.HandleSize]byte
}

// getShare decodes a tShare frame, already checked by readFrame. A base
// whose range wraps, or a size of 0, is a protocol violation.
func getShare(f *frame) (share, error) {
	b := f.payload
	sh := share{id: f.id, kind: devmem.ShareKind(f.status)}
	copy(sh.gpu[:], b[0:16])
	sh.base = binary.LittleEndian.Uint64(b[16:])
	sh.size = binary.LittleEndian.Uint64(b[24:])
	copy(sh.hdl[:], b[32:32+devmem.HandleSize])
	if sh.base == 0 || sh.size == 0 || sh.base+sh.size < sh.base {
		return sh, fmt.Errorf("%w: device share %d spans [0x%x, +%d)", errProtocol, sh.id, sh.base, sh.size)
	}
	return sh, nil
}

// putShare appends a tShare's payload for s to b.
func putShare(b []byte, s devmem.Share) []byte {
	b = append(b, s.GPU[:]...)
	b = binary.LittleEndian.AppendUint64(b, uint64(s.Base))
	b = binary.LittleEndian.AppendUint64(b, s.Size)
	if s.Kind == devmem.ShareHandle {
		return append(b, s.Handle[:]...)
	}
	var zero [devmem.HandleSize]byte
	return append(b, zero[:]...)
}

// grantEntry is one range of a grant on a connection that agreed
// capDevice: where to copy, and in which share (0: host memory).
type grantEntry struct {
	addr  uint64
	share uint64
}

// grantEntries decodes the table of a granted tGrant on a connection that
// agreed capDevice, answering a request of the ranges whose lengths lens
// yields: nil if the grant names no table (copy at the ranges' own
// addresses). f comes from the peer: a table whose count is not the
// request's, a host address that would wrap or is 0, is a protocol
// violation; shares are checked by the caller, which knows them.
func grantEntries(f *frame, ranges int, lens iter.Seq[uint64]) ([]grantEntry, error) {
	if f.count == 0 {
		return nil, nil
	}
	if int(f.count) != ranges || len(f.table) != ranges*devEntrySize {
		return nil, fmt.Errorf("%w: grant of lease %d names %d entries for the %d ranges requested", errProtocol, f.id, f.count, ranges)
	}
	es := make([]grantEntry, ranges)
	i := 0
	for n := range lens {
		if i == ranges {
			return nil, fmt.Errorf("%w: lease %d requested more than the %d ranges its grant answers", errProtocol, f.id, ranges)
		}
		b := f.table[i*devEntrySize:]
		e := grantEntry{addr: binary.LittleEndian.Uint64(b), share: binary.LittleEndian.Uint64(b[8:])}
		if e.addr == 0 || e.addr+n < e.addr {
			return nil, fmt.Errorf("%w: grant of lease %d places range %d (%d bytes) at 0x%x", errProtocol, f.id, i, n, e.addr)
		}
		es[i] = e
		i++
	}
	if i != ranges {
		return nil, fmt.Errorf("%w: lease %d requested %d ranges, its grant names %d entries", errProtocol, f.id, i, ranges)
	}
	return es, nil
}
