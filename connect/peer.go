package connect

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/wire"
)

// AgentInfo is the public description of a Connector's agent: its ID and
// how each of its backends is reached. Full tokens embed it; a presence
// registry publishes it so that compact tokens ([Metadata.Compact]) can
// name the agent by ID alone. It grants nothing by itself: every access still
// needs a token's key.
//
// An AgentInfo is an immutable value, safe to copy and to share. The zero
// AgentInfo is invalid.
//
// Its binary form ([AgentInfo.MarshalBinary]), version 1, is:
//
//	magic    "gxa"
//	version  u8 (1)
//	agent    [16]byte, the agent's UUID
//	backends as in Metadata, at least one
//	crc      u32, CRC-32C of every byte before it
type AgentInfo struct{ info agent.Info }

const (
	infoVersion = 1
	// minInfoLen is magic, version, ID, one backend with a one-letter name
	// and no data, and the CRC.
	minInfoLen = 3 + 1 + 16 + 1 + (1 + 1 + 1) + crcLen
)

var infoMagic = [3]byte{'g', 'x', 'a'}

// AgentInfo returns the description of the Connector's agent. It stays the
// same for the Connector's life.
func (c *Connector) AgentInfo() AgentInfo { return AgentInfo{info: c.info} }

// ID returns the agent's ID, the one tokens name ([Metadata.Agent]).
func (i AgentInfo) ID() uuid.UUID { return i.info.ID }

// Backends returns the names of the agent's backends, in its order of
// preference, in a fresh slice.
func (i AgentInfo) Backends() []string {
	names := make([]string, len(i.info.Conns))
	for k, c := range i.info.Conns {
		names[k] = c.Backend
	}
	return names
}

// MarshalBinary implements [encoding.BinaryMarshaler]. It fails only for an
// invalid AgentInfo, such as the zero one.
func (i AgentInfo) MarshalBinary() ([]byte, error) {
	if i.info.ID == uuid.Nil {
		return nil, fmt.Errorf("%w: agent info names no agent", ErrInvalidMetadata)
	}
	if err := checkConns(i.info.Conns, 1); err != nil {
		return nil, err
	}
	b := make([]byte, 0, 4+16+connsLen(i.info.Conns)+crcLen)
	b = append(b, infoMagic[:]...)
	b = append(b, infoVersion)
	b = append(b, i.info.ID[:]...)
	b = appendConns(b, i.info.Conns)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli)), nil
}

// UnmarshalBinary implements [encoding.BinaryUnmarshaler]. data is
// untrusted: errors wrap [ErrInvalidMetadata] and say what was expected and
// what was found, with the input's own text quoted; it never panics, does
// not retain data, and leaves i unchanged on error.
func (i *AgentInfo) UnmarshalBinary(data []byte) error {
	body, err := unframe(data, infoMagic[:], infoVersion, minInfoLen)
	if err != nil {
		return fmt.Errorf("%w: agent info: %w", ErrInvalidMetadata, err)
	}
	var info agent.Info
	r := wire.NewReader(body[4:], 4)
	at := r.Offset()
	copy(info.ID[:], r.Bytes(len(info.ID), "agent ID"))
	if r.Err() == nil && info.ID == uuid.Nil {
		r.FailAtf(at, "want an agent ID, found the nil UUID")
	}
	info.Conns = readConns(r, 1)
	if r.Err() == nil && r.Remaining() > 0 {
		r.Failf("want the checksum next, found %d extra bytes", r.Remaining())
	}
	if err := r.Err(); err != nil {
		return fmt.Errorf("%w: agent info: %w", ErrInvalidMetadata, err)
	}
	i.info = info
	return nil
}

// Resolver finds an agent's description by its ID, for compact tokens (see
// [Metadata.Compact] and [WithResolver]). transport/nats's presence registry
// is one. Resolve must be safe for concurrent use and return once ctx is
// done; it should return an error matching [ErrRemoteLost] for an agent it
// knows has departed.
type Resolver interface {
	Resolve(ctx context.Context, id uuid.UUID) (AgentInfo, error)
}

// resolve returns the peer a token names, looking it up when the token is
// compact.
func (c *Connector) resolve(ctx context.Context, md Metadata) (agent.Info, error) {
	if !md.IsCompact() {
		return md.peer, nil
	}
	if c.resolver == nil {
		return agent.Info{}, fmt.Errorf("%w: the token is compact (it names agent %s without endpoints) and the Connector has no Resolver (WithResolver)", ErrNoBackend, md.peer.ID)
	}
	ai, err := c.resolver.Resolve(ctx, md.peer.ID)
	if err != nil {
		return agent.Info{}, fmt.Errorf("connect: resolve agent %s: %w", md.peer.ID, err)
	}
	if ai.info.ID != md.peer.ID {
		return agent.Info{}, fmt.Errorf("%w: resolving agent %s returned agent %s", ErrInvalidMetadata, md.peer.ID, ai.info.ID)
	}
	if len(ai.info.Conns) == 0 {
		return agent.Info{}, fmt.Errorf("%w: resolving agent %s returned no endpoints", ErrNoBackend, md.peer.ID)
	}
	return ai.info, nil
}

// PeerDeparted declares the agent id gone, on word from outside the
// backends: typically a presence registry that stopped hearing its
// heartbeats, which tells long before transport keepalives would. Active
// operations in flight with that agent fail with a [*TransferError]
// matching [ErrRemoteLost]; passive operations it has used (read, written
// or notified) end their Wait the same way ([agent.Agent.PeerDeparted]). Operations begun afterwards are not refused:
// a peer declared gone by mistake keeps working. Safe for concurrent use.
func (c *Connector) PeerDeparted(id uuid.UUID) {
	c.a.PeerDeparted(id, fmt.Errorf("%w: agent %s departed", ErrRemoteLost, id))
}
