// Package mem is goxfer's in-process backend: two agents in one address
// space move bytes with a plain copy, still checked against the exposing
// agent's keys and regions.
package mem

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"sync"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
)

// Name is the backend's name in metadata and reports.
const Name = "mem"

// chunk bounds how long one copy holds a lease, so revocation and
// cancellation wait at most one chunk.
const chunk = 4 << 20

// inline transfers of at most this many bytes run in the caller's goroutine.
const inline = 64 << 10

// process identifies this address space; agents in another process that
// publish mem connection information are unreachable.
var process = sync.OnceValue(func() []byte {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return b
})

// agents in this process, by ID, for the mem backends to find each other.
var (
	regMu    sync.RWMutex
	registry = map[uuid.UUID]*Backend{}
)

// Backend is the in-process backend. Create one per agent with New.
type Backend struct {
	host agent.Host
	id   uuid.UUID
	link agent.Link // how this agent reaches every other: one in-process channel

	mu     sync.Mutex
	closed bool
	peers  map[uuid.UUID]*Backend // agents this one exchanged with
	wg     sync.WaitGroup
}

// New returns an in-process backend for one agent.
func New() *Backend { return &Backend{peers: map[uuid.UUID]*Backend{}} }

// Name implements agent.Backend.
func (b *Backend) Name() string { return Name }

// Supports implements agent.Backend: host memory only.
func (b *Backend) Supports(k agent.MemKind) bool { return k == agent.KindDRAM }

// Start implements agent.Backend.
func (b *Backend) Start(h agent.Host) ([]byte, error) {
	b.host, b.id = h, h.ID()
	b.link = agent.NewLink(b.id)
	regMu.Lock()
	defer regMu.Unlock()
	if _, dup := registry[b.id]; dup {
		return nil, fmt.Errorf("mem: an agent with ID %s is already running in this process", b.id)
	}
	registry[b.id] = b
	return process(), nil
}

// Reachable implements agent.Backend: the peer must live in this process.
func (b *Backend) Reachable(_ context.Context, info agent.Info) error {
	ci, ok := info.Conn(Name)
	if !ok {
		return errors.New("peer has no mem backend")
	}
	if !bytes.Equal(ci, process()) {
		return errors.New("peer is in another process")
	}
	if lookup(info.ID) == nil {
		return fmt.Errorf("peer %s: %w", info.ID, agent.ErrRemoteLost)
	}
	return nil
}

func lookup(id uuid.UUID) *Backend {
	regMu.RLock()
	defer regMu.RUnlock()
	return registry[id]
}

// Post implements agent.Backend. Small transfers complete before Post
// returns; larger ones run on a goroutine the backend owns.
func (b *Backend) Post(x *agent.Work) error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return agent.ErrClosed
	}
	b.wg.Add(1)
	b.mu.Unlock()
	if x.Bytes() <= inline {
		b.run(x)
		return nil
	}
	go b.run(x)
	return nil
}

func (b *Backend) run(x *agent.Work) {
	defer b.wg.Done()
	x.Finish(b.copy(x))
}

func (b *Backend) copy(x *agent.Work) error {
	remote := lookup(x.Peer.ID)
	if remote == nil {
		return fmt.Errorf("mem: peer %s: %w", x.Peer.ID, agent.ErrRemoteLost)
	}
	b.met(remote)
	var lease agent.Lease
	defer func() { lease.Release() }()
	held := chunk // bytes copied under the current lease; a full chunk opens one
	for i, s := range x.Segments {
		for off := uint64(0); off < s.Local.Len; {
			if held >= chunk {
				lease.Release()
				select {
				case <-x.Cancelled():
					return x.CancelErr()
				default:
				}
				l, err := remote.host.Open(b.link, x.Key, x.Op.Access())
				if err != nil {
					return fmt.Errorf("mem: segment %d: %w", i, err)
				}
				lease, held = l, 0
			}
			n := min(s.Local.Len-off, uint64(chunk-held))
			rem, err := lease.Slice(s.Remote.Addr+off, n)
			if err == nil && rem == nil {
				err = fmt.Errorf("%w: device memory cannot be copied by the mem backend", agent.ErrAccessDenied)
			}
			if err != nil {
				return fmt.Errorf("mem: segment %d: %w", i, err)
			}
			loc := s.Local.Mem[off : off+n]
			if x.Op == agent.OpRead {
				copy(loc, rem)
			} else {
				copy(rem, loc)
			}
			off += n
			held += int(n)
		}
	}
	lease.Release()
	if x.Notify != nil {
		return b.notify(remote, x.Key, x.Notify)
	}
	return nil
}

// met records that this agent has exchanged with remote, which hears of it
// when this agent closes.
func (b *Backend) met(remote *Backend) {
	b.mu.Lock()
	b.peers[remote.id] = remote
	b.mu.Unlock()
}

// Notify implements agent.Backend.
func (b *Backend) Notify(_ context.Context, peer agent.Info, key agent.Key, msg []byte) error {
	remote := lookup(peer.ID)
	if remote == nil {
		return fmt.Errorf("mem: peer %s: %w", peer.ID, agent.ErrRemoteLost)
	}
	b.met(remote)
	return b.notify(remote, key, msg)
}

func (b *Backend) notify(remote *Backend, key agent.Key, msg []byte) error {
	if !remote.host.Deliver(b.link, key, bytes.Clone(msg)) {
		return fmt.Errorf("mem: peer %s is closing: %w", remote.id, agent.ErrRemoteLost)
	}
	return nil
}

// Close implements agent.Backend: it waits for its transfers, leaves the
// process registry and tells the agents it exchanged with that this one is
// gone. Its notifications were delivered synchronously, so the news never
// overtakes them.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	b.mu.Unlock()
	if b.host == nil {
		return nil // never started: nothing registered, nobody to tell
	}
	b.wg.Wait()
	regMu.Lock()
	registered := registry[b.id] == b
	if registered {
		delete(registry, b.id)
	}
	regMu.Unlock()
	if !registered { // Start failed: the ID belongs to another live agent
		return nil
	}
	b.mu.Lock()
	peers := make([]*Backend, 0, len(b.peers))
	for _, p := range b.peers {
		peers = append(peers, p)
	}
	b.mu.Unlock()
	for _, p := range peers {
		if lookup(p.id) == p {
			p.host.LinkLost(b.link, fmt.Errorf("mem: agent %s closed: %w", b.id, agent.ErrRemoteLost))
		}
	}
	return nil
}
