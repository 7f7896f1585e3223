package agent

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent/shm"
)

// Access is what a remote agent may do with exposed memory.
type Access uint8

const (
	// AccessRead lets the remote READ the memory.
	AccessRead Access = 1
	// AccessWrite lets the remote WRITE the memory.
	AccessWrite Access = 2
)

// String returns "read" or "write".
func (a Access) String() string {
	switch a {
	case AccessRead:
		return "read"
	case AccessWrite:
		return "write"
	}
	return fmt.Sprintf("Access(%d)", uint8(a))
}

// EventKind tells what an Event reports.
type EventKind uint8

const (
	// EventNotify is a notification sent to the exposure's key.
	EventNotify EventKind = iota + 1
	// EventPeerLost reports that the peer using the exposure was lost.
	EventPeerLost
)

// Event is delivered on [Exposure.Events].
type Event struct {
	Kind EventKind
	From uuid.UUID // the sending or lost peer
	Msg  []byte    // the notification, for EventNotify; owned by the receiver
	// Err is the cause, for EventPeerLost. For EventNotify it is nil,
	// unless a peer's WRITE into the exposure's device memory could not be
	// copied from its staging buffer into the device (it wraps
	// [ErrStaging]): the notification then vouches for bytes that are not
	// all in place.
	Err error
}

// Exposure is registered memory made accessible to remote agents under a
// Key, for one kind of access. It receives the notifications sent to its key.
// Revoke ends access. Methods are safe for concurrent use.
type Exposure struct {
	a      *Agent
	key    Key
	access Access
	set    regionSet
	devs   bool          // some regions are VRAM
	gone   chan struct{} // closed by Revoke: waits for staging buffers end
	events chan Event

	mu      sync.Mutex
	drained sync.Cond // signalled when leases drops to zero
	leases  int
	revoked bool
	// unpins release the shared-memory segments (package shm) the
	// regions lie in, so they cannot be freed while exposed; Revoke calls
	// them.
	unpins []func()
	// published are the backends that published the exposure
	// (Publisher), once pubDone is closed; the first Revoke unpublishes
	// it from them, and every Revoke waits for unpubDone.
	published []Publisher
	pubDone   chan struct{}
	unpubDone chan struct{}
	// stageErr is the first failure to copy a peer's staged WRITE into
	// device memory; notifications delivered afterwards carry it.
	stageErr error
	peer     uuid.UUID // first peer that opened a lease or sent a notification
	// links are the channels through which peer (or, shared, any peer)
	// presented the key: only their loss is the loss of a peer using this
	// exposure. A channel that never presented the key, whatever agent ID
	// it claims, is not among them.
	links  []Link
	shared bool      // ExposeShared: every peer's links bind
	used   time.Time // when a lease last ended or a notification arrived
}

// eventBuffer bounds the events queued per exposure; a passive operation
// needs only its first terminal event, and further ones are counted dropped.
const eventBuffer = 8

// Expose makes regions accessible to any remote agent that presents the
// returned exposure's key, for access acc. The regions stay owned by the
// caller, who keeps them alive (and registered, for backends that want it:
// see [Agent.Register]) until [Exposure.Revoke] returns. Invalid regions
// fail with [ErrInvalid], a closed agent with [ErrClosed]. Safe for
// concurrent use.
func (a *Agent) Expose(acc Access, regions []Local) (*Exposure, error) {
	return a.expose(acc, regions, eventBuffer, false)
}

// ExposeShared is [Agent.Expose] for an exposure that many peers use, each
// reporting its own outcome: [Exposure.Events] has room for queue events
// (at least 1) instead of 8, and the links of every peer that presents the
// key bind, so the loss of any of them is reported ([EventPeerLost], From
// that peer), not only the first's.
func (a *Agent) ExposeShared(acc Access, regions []Local, queue int) (*Exposure, error) {
	return a.expose(acc, regions, queue, true)
}

func (a *Agent) expose(acc Access, regions []Local, queue int, shared bool) (*Exposure, error) {
	if queue < 1 {
		return nil, fmt.Errorf("%w: event queue of %d", ErrInvalid, queue)
	}
	if acc != AccessRead && acc != AccessWrite {
		return nil, fmt.Errorf("%w: access %v", ErrInvalid, acc)
	}
	devs := false
	for i, r := range regions {
		if err := r.check(); err != nil {
			return nil, fmt.Errorf("region %d: %w", i, err)
		}
		devs = devs || r.Kind == KindVRAM
	}
	if devs {
		if err := a.checkDevice(regions); err != nil {
			return nil, err
		}
	}
	e := &Exposure{a: a, key: NewKey(), access: acc, set: newRegionSet(regions), devs: devs, gone: make(chan struct{}), events: make(chan Event, queue), shared: shared,
		pubDone: make(chan struct{}), unpubDone: make(chan struct{})}
	e.drained.L = &e.mu
	for _, r := range regions {
		if r.Kind == KindDRAM {
			if unpin := shm.Pin(r.Addr, r.Len); unpin != nil {
				e.unpins = append(e.unpins, unpin)
			}
		}
	}
	a.expMu.Lock()
	if a.isClosed() {
		a.expMu.Unlock()
		e.unpin()
		return nil, ErrClosed
	}
	a.exps[e.key] = e
	a.expMu.Unlock()
	// Memory in shared segments, and exposures of one region (cma copies
	// host memory by cross-memory attach): a Publisher picks what it can
	// serve. Other exposures (a pool of many blocks) cost nothing more.
	if len(e.unpins) > 0 || len(regions) == 1 {
		for _, b := range a.backends {
			if p, ok := b.(Publisher); ok {
				p.Publish(Published{e})
				e.published = append(e.published, p)
			}
		}
	}
	close(e.pubDone)
	return e, nil
}

// regions returns the exposure's regions.
func (e *Exposure) regions() []Region {
	rs := make([]Region, len(e.set.regs))
	for i, r := range e.set.regs {
		rs[i] = r.Region
	}
	return rs
}

// Key returns the capability that grants access to the exposure.
func (e *Exposure) Key() Key { return e.key }

// Access returns the kind of access the exposure grants.
func (e *Exposure) Access() Access { return e.access }

// Events delivers the notifications sent to the exposure's key and the loss
// of the peer using it. The channel is never closed; select on it together
// with your own context.
func (e *Exposure) Events() <-chan Event { return e.events }

// Peer returns the first remote agent that accessed or notified the
// exposure, or the zero UUID if none has yet.
func (e *Exposure) Peer() uuid.UUID {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.peer
}

// Use reports how many leases peers hold on the exposure now, and when one
// last ended or a notification last arrived (the zero Time if never): an
// exposure with no lease whose last use is old enough is unused. A lease
// granted counts as a use too. A copy made through what a [Publisher]
// handed out (cma: a peer's mapping of shared memory, or its lease-free
// cross-memory attach) holds no lease: it is seen by the notification
// that follows it.
func (e *Exposure) Use() (leases int, last time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.leases, e.used
}

// Revoke ends access: no new lease is granted, and Revoke returns once every
// outstanding lease has been released, so no remote agent can touch the
// memory afterwards. How long that takes is bounded by the backends, which
// hold a lease for one frame, copy or chunk. Notifications sent to the key
// afterwards are dropped; Events stays readable. It is idempotent.
func (e *Exposure) Revoke() {
	e.a.expMu.Lock()
	if e.a.exps[e.key] == e {
		delete(e.a.exps, e.key)
	}
	e.a.expMu.Unlock()

	e.mu.Lock()
	first := !e.revoked
	if first {
		close(e.gone)
	}
	e.revoked = true
	e.mu.Unlock()
	if first {
		<-e.pubDone
		closing := e.a.isClosed()
		for _, p := range e.published {
			p.Unpublish(Published{e}, closing)
		}
		close(e.unpubDone)
	}
	<-e.unpubDone
	e.mu.Lock()
	for e.leases > 0 {
		e.drained.Wait()
	}
	e.mu.Unlock()
	e.unpin()
}

// unpin releases the exposure's shared-memory segments: once revoked, they
// may be freed.
func (e *Exposure) unpin() {
	for _, f := range e.unpins {
		f()
	}
}

// bind records that l presented the exposure's key. The first peer to do
// so becomes the exposure's peer; the links of that peer (of every peer,
// shared) are remembered so that their loss, and no other, reaches the
// exposure. It marks the exposure used. Callers hold e.mu.
func (e *Exposure) bind(l Link) {
	e.used = time.Now()
	if l.Peer == uuid.Nil || l.id == 0 {
		return // not made by NewLink: binds nothing
	}
	if e.peer == uuid.Nil {
		e.peer = l.Peer
	}
	if l.Peer != e.peer && !e.shared {
		return
	}
	for i := len(e.links) - 1; i >= 0; i-- {
		if e.links[i].id == l.id {
			return
		}
	}
	e.links = append(e.links, l)
}

// boundTo reports whether peer is the exposure's peer or, shared, one of
// the peers whose links bound. Callers hold e.mu.
func (e *Exposure) boundTo(peer uuid.UUID) bool {
	if !e.shared {
		return e.peer == peer
	}
	return slices.ContainsFunc(e.links, func(l Link) bool { return l.Peer == peer })
}

// unbind forgets l and reports whether l was bound. Callers hold e.mu.
func (e *Exposure) unbind(l Link) bool {
	i := slices.IndexFunc(e.links, func(b Link) bool { return b.id == l.id })
	if i < 0 {
		return false
	}
	e.links = slices.Delete(e.links, i, i+1)
	return true
}

// Link names one channel through which a remote agent reaches this one:
// a backend's connection, session or endpoint. Peer is the agent the
// channel's handshake named; it is a claim, not a proof, since agent IDs
// are public. Backends make one Link per channel with [NewLink], pass it to
// [Host.Open] and [Host.Deliver] for everything that arrives on the channel,
// and report the channel's end with [Host.LinkLost]. An exposure hears of a
// lost peer only through the links that presented its key, so a stranger
// claiming a peer's ID cannot fail that peer's operations by hanging up.
// The zero Link binds nothing. Links are comparable values.
type Link struct {
	Peer uuid.UUID
	id   uint64
}

var linkIDs atomic.Uint64

// NewLink returns a Link, distinct from every other in the process, for a
// channel whose handshake named peer.
func NewLink(peer uuid.UUID) Link { return Link{Peer: peer, id: linkIDs.Add(1)} }

// Lease is a short-lived grant to touch an exposure's memory. Backends hold
// one around each remote access (a frame, a copy) and release it promptly.
// A Lease is a value with one owner: it is not safe for concurrent use;
// copies of it share what it staged. The zero Lease holds nothing.
type Lease struct {
	e    *Exposure
	st   *leaseStage // for a DeviceStager's lease on an exposure with VRAM
	done bool
	next int    // the region Slice found last: where it looks first
	run  []byte // what Slice returned last, its capacity not cut: SliceAfter extends it
}

// Access returns the access kind the lease grants.
func (l *Lease) Access() Access { return l.e.access }

// Slice returns the exposed bytes at [addr, addr+n), or an error wrapping
// [ErrAccessDenied] if they do not lie within one exposed region. The
// refusal is counted. The bytes may be touched only until
// [Lease.Release].
//
// For VRAM regions: a backend that stages device memory ([DeviceStager])
// gets a pinned host buffer standing in for the device bytes: for a READ
// lease it holds a copy of them when Slice returns (after [Lease.Ready]
// once [Lease.Prepare] was called); for a WRITE lease the backend fills it
// and [Lease.Flush] copies it into the device. Staging failures wrap
// [ErrStaging]. Other backends get a nil slice and no error.
func (l *Lease) Slice(addr, n uint64) ([]byte, error) {
	l.run = nil
	r, ok := l.e.set.findFrom(addr, n, &l.next)
	if !ok {
		l.e.a.refused.Add(1)
		return nil, fmt.Errorf("%w: [0x%x, +%d) lies outside the exposed regions", ErrAccessDenied, addr, n)
	}
	if r.Mem == nil {
		if l.st == nil {
			return nil, nil
		}
		return l.stage(addr, n, int(r.Device))
	}
	off := addr - r.Addr
	l.run = r.Mem[off : off+n]
	return r.Mem[off : off+n : off+n], nil
}

// SliceAfter is [Lease.Slice] for a backend that copies neighbouring
// pieces at once. prev is the slice this lease returned last; when the
// exposed bytes at [addr, addr+n) follow prev's last byte in the same
// allocation of Go memory, it returns prev and them as one slice and
// joined true; otherwise what Slice returns. [addr, addr+n) is checked,
// and refused, as by Slice: a joined slice is only ever the union of
// ranges that were each checked, never a range across regions that a peer
// asked for.
func (l *Lease) SliceAfter(prev []byte, addr, n uint64) (b []byte, joined bool, err error) {
	run := l.run
	if b, err = l.Slice(addr, n); err != nil || l.run == nil {
		return b, false, err
	}
	k := len(prev)
	if k == 0 || len(run) != k || &run[0] != &prev[0] {
		return b, false, nil
	}
	if j, ok := Extend(run, l.run); ok {
		l.run = j
		return j[:len(j):len(j)], true, nil
	}
	return b, false, nil
}

// Extend returns run and next as one slice when next's bytes directly
// follow run's within run's capacity (so within one allocation): the same
// memory, reached through one slice header, for one copy instead of two.
func Extend(run, next []byte) ([]byte, bool) {
	k := len(run)
	if k == 0 || len(next) == 0 || cap(run)-k < len(next) || &run[:k+1][k] != &next[0] {
		return nil, false
	}
	return run[:k+len(next)], true
}

// Gone is closed once the exposure is revoked (its [Exposure.Revoke]
// began, or its agent is closing): a backend that handed a peer something
// that outlives a lease, such as a mapping of device memory, watches it to
// take that back.
func (l *Lease) Gone() <-chan struct{} { return l.e.gone }

// Region returns the exposed region containing [addr, addr+n).
func (l *Lease) Region(addr, n uint64) (Region, bool) {
	r, ok := l.e.set.find(addr, n)
	return r.Region, ok
}

// Renew checks a lease held for long against revocation, as a fresh
// [Host.Open] would: nil while the exposure is open; once it is revoked,
// or the agent is closing, the lease is released and the error says why
// ([ErrAccessDenied], or [ErrRemoteLost] when closing). Backends renew a
// lease they hold across a slow peer (a frame trickling in) so that a
// revocation waits for at most one renewal period. Unlike opening a new
// lease and releasing the old one, Renew keeps what the lease staged: the
// staging buffers a backend is filling stay the lease's.
func (l *Lease) Renew() error {
	e := l.e
	if e == nil || l.done {
		return fmt.Errorf("%w: lease already released", ErrAccessDenied)
	}
	e.mu.Lock()
	revoked := e.revoked
	e.mu.Unlock()
	if !revoked {
		return nil
	}
	l.Release()
	if e.a.isClosed() {
		return fmt.Errorf("%w: agent %s is closing", ErrRemoteLost, e.a.id)
	}
	return fmt.Errorf("%w: exposure %v revoked", ErrAccessDenied, e.key)
}

// Release ends the lease. Releasing it again, or releasing the zero Lease,
// does nothing.
func (l *Lease) Release() {
	if l.done || l.e == nil {
		return
	}
	l.done = true
	e := l.e
	if l.st != nil {
		l.st.unstage(func(err error) {
			e.a.log.Warn("goxfer: staging GPU memory for a peer failed", "err", err)
		})
	}
	e.mu.Lock()
	e.used = time.Now()
	if e.leases--; e.leases == 0 && e.revoked {
		e.drained.Broadcast()
	}
	e.mu.Unlock()
}

// open is [Host.Open].
func (a *Agent) open(l Link, key Key, acc Access, stages bool) (Lease, error) {
	a.expMu.RLock()
	e := a.exps[key]
	a.expMu.RUnlock()
	var refusal error
	switch {
	case e == nil:
		refusal = fmt.Errorf("%w: no exposure for key %v (never issued, or revoked)", ErrAccessDenied, key)
	case e.access != acc:
		refusal = fmt.Errorf("%w: %s access to memory exposed for %s", ErrAccessDenied, acc, e.access)
	default:
		e.mu.Lock()
		if !e.revoked {
			e.leases++
			e.bind(l)
			e.mu.Unlock()
			lease := Lease{e: e}
			if stages && e.devs {
				ds, err := a.staging()
				if err != nil {
					lease.Release()
					return Lease{}, err
				}
				lease.st = &leaseStage{ds: ds, peer: l.Peer, stop: e.gone, acc: e.access, ss: streams{a: a}}
			}
			return lease, nil
		}
		e.mu.Unlock()
		refusal = fmt.Errorf("%w: exposure %v revoked", ErrAccessDenied, key)
	}
	// Close revokes every exposure: a peer reaching an agent that is going
	// away has lost it, and is no abuser.
	if a.isClosed() {
		return Lease{}, fmt.Errorf("%w: agent %s is closing", ErrRemoteLost, a.id)
	}
	a.refused.Add(1)
	return Lease{}, refusal
}
