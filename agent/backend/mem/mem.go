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
	"math"
	"sync"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
)

// Name is the backend's name in metadata and reports.
const Name = "mem"

// chunk bounds how long one copy holds a lease, so revocation and
// cancellation wait at most one chunk (a span, in agent's terms).
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

// Backend is the in-process backend. Create one per agent with [New]; the
// agent calls its methods, which are safe for concurrent use.
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

// Name implements [agent.Backend].
func (b *Backend) Name() string { return Name }

// Supports implements [agent.Backend]: host memory only.
func (b *Backend) Supports(k agent.MemKind) bool { return k == agent.KindDRAM }

// StagesDevice reports true: the mem backend touches a peer's memory only
// through the peer's leases, so the peer's agent stages its device memory
// ([agent.DeviceStager]); local device memory is staged by this agent.
func (b *Backend) StagesDevice() bool { return true }

// Start implements [agent.Backend]. It fails if another agent of this
// process has the same ID.
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

// Reachable implements [agent.Backend]: the peer must live in this process;
// one in another process is out of reach ([agent.ErrOutOfReach]). It never
// blocks.
func (b *Backend) Reachable(_ context.Context, info agent.Info) error {
	ci, ok := info.Conn(Name)
	if !ok {
		return errors.New("peer has no mem backend")
	}
	if !bytes.Equal(ci, process()) {
		return agent.OutOfReach("peer is in another process")
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

// Post implements [agent.Backend]. Transfers of at most 64 KiB complete
// before Post returns; larger ones run on a goroutine the backend owns,
// which Close waits for. The copy goes chunk by chunk, under a lease of
// the peer's exposure per chunk of at most 4 MiB, so that revocation and
// cancellation wait for at most one chunk.
func (b *Backend) Post(w *agent.Work) error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return agent.ErrClosed
	}
	b.wg.Add(1)
	b.mu.Unlock()
	if w.Bytes() <= inline {
		b.run(w)
		return nil
	}
	go b.run(w)
	return nil
}

// run moves w and finishes it through agent.Parts, as every backend does:
// a transfer cancelled while its last bytes were copied reports the
// cancellation, not success, and its notification is not sent.
func (b *Backend) run(w *agent.Work) {
	defer b.wg.Done()
	remote := lookup(w.Peer.ID)
	var p agent.Parts
	p.Init(w, func(key agent.Key, msg []byte) error { return b.notify(remote, key, msg) }, nil)
	p.Done(b.copy(w, remote))
}

func (b *Backend) copy(w *agent.Work, remote *Backend) error {
	if remote == nil {
		return fmt.Errorf("mem: peer %s: %w", w.Peer.ID, agent.ErrRemoteLost)
	}
	b.met(remote)
	var runs []run // one span's copies, reused span after span
	for c := (agent.Cursor{}); c.Seg < len(w.Segments); {
		select {
		case <-w.Cancelled():
			return w.CancelErr()
		default:
		}
		end, n, _ := agent.Span(w.Segments, c, chunk, math.MaxInt)
		var err error
		if runs, err = b.copySpan(remote, w, c, n, runs[:0]); err != nil {
			return err
		}
		c = end
	}
	return nil
}

// run is one copy: neighbouring pieces contiguous on both sides, such as
// the blocks of a KV pool cut from one allocation, are copied as one.
type run struct{ local, remote []byte }

// copySpan copies the n bytes of w that start at c under one lease of the
// peer's exposure, collecting its copies in runs, which it returns for the
// next span to reuse.
func (b *Backend) copySpan(remote *Backend, w *agent.Work, c agent.Cursor, n uint64, runs []run) ([]run, error) {
	lease, err := remote.host.Open(b.link, w.Key, w.Op.Access())
	if err != nil {
		return runs, fmt.Errorf("mem: segment %d: %w", c.Seg, err)
	}
	defer lease.Release()
	// The peer's device memory is staged whole for the span: one buffer,
	// and for a READ one wait for the copies out of the device.
	if err := lease.Prepare(n); err != nil {
		return runs, fmt.Errorf("mem: segment %d: %w", c.Seg, err)
	}
	var cur run
	seg := c.Seg // the index of p.Seg
	for p := range w.Pieces(c, n) {
		// Every piece is checked against the exposure on its own;
		// SliceAfter joins it to the run only after.
		rem, joined, err := lease.SliceAfter(cur.remote, p.RemoteAddr(), p.Len)
		if err == nil && rem == nil {
			err = fmt.Errorf("%w: device memory cannot be copied by the mem backend", agent.ErrAccessDenied)
		}
		if err != nil {
			return runs, fmt.Errorf("mem: segment %d: %w", seg, err)
		}
		loc := p.Local()
		if m := p.Seg.Local.Mem; m != nil {
			loc = m[p.Off : p.Off+p.Len] // capacity kept: the next piece may extend it
		}
		if l, ok := agent.Extend(cur.local, loc); ok && joined {
			cur = run{local: l, remote: rem}
		} else {
			if joined {
				rem = rem[len(cur.remote):] // the piece alone
			}
			if cur.remote != nil {
				runs = append(runs, cur)
			}
			cur = run{local: loc, remote: rem}
		}
		if p.Off+p.Len == p.Seg.Local.Len {
			seg++
		}
	}
	if cur.remote != nil {
		runs = append(runs, cur)
	}
	if w.Op == agent.OpWrite {
		for _, r := range runs {
			copy(r.remote, r.local)
		}
		return runs, lease.Flush() // staged device memory reaches the device before the transfer is done
	}
	if err := lease.Ready(); err != nil {
		return runs, fmt.Errorf("mem: segment %d: %w", c.Seg, err)
	}
	for _, r := range runs {
		copy(r.local, r.remote)
	}
	return runs, nil
}

// met records that this agent has exchanged with remote, which hears of it
// when this agent closes.
func (b *Backend) met(remote *Backend) {
	b.mu.Lock()
	b.peers[remote.id] = remote
	b.mu.Unlock()
}

// Notify implements [agent.Backend]: it hands a copy of msg to the peer
// agent's dispatcher, which queues it without blocking, so Notify never
// blocks and does not consult ctx ([agent.Agent.Notify] checked it before
// choosing the backend). A peer no longer in this process, or closing, is
// [agent.ErrRemoteLost]. Safe for concurrent use.
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

// Close implements [agent.Backend]: it waits for its transfers, leaves the
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
