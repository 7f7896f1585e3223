//go:build linux

package cma

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/shm"
)

// Shared host memory: the exposing side's half (shmServe, on the server)
// and the copier's (shmPeer, on the peer). shmwire.go has the protocol.

// slotWords are a lease-table slot's words, in a mapping of the table.
type slotWords struct {
	readers *uint32
	waiting *uint32
	stamp   *uint64
}

func slotAt(table []byte, i int) slotWords {
	b := table[tableHeader+i*slotSize:]
	return slotWords{
		readers: (*uint32)(unsafe.Pointer(&b[0])),
		waiting: (*uint32)(unsafe.Pointer(&b[4])),
		stamp:   (*uint64)(unsafe.Pointer(&b[8])),
	}
}

// try counts a copy in the slot and reports whether the mapping is still
// want (its generation, live), with the stamp it found. On false the copy
// must not touch the memory; it has left already. Why a copy was
// refused must be read from that stamp: once the copy left, the revocation
// it waited for can finish and free the slot, and a later read finds the
// slot free (or reused), no longer saying whether the exposure was revoked
// or its agent closed.
func (w slotWords) try(want uint64) (uint64, bool) {
	atomic.AddUint32(w.readers, 1)
	if seen := atomic.LoadUint64(w.stamp); seen != want {
		w.leave()
		return seen, false
	}
	return want, true
}

// leave ends a copy entered with try, waking a revocation that waits.
func (w slotWords) leave() {
	if atomic.AddUint32(w.readers, ^uint32(0)) == 0 && atomic.LoadUint32(w.waiting) != 0 {
		futexWake(w.readers)
	}
}

// futexWait sleeps while *addr == val, for at most d. The futex is shared
// (the word lies in a memory file two processes map).
func futexWait(addr *uint32, val uint32, d time.Duration) {
	ts := unix.NsecToTimespec(d.Nanoseconds())
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), 0 /* FUTEX_WAIT */, uintptr(val), uintptr(unsafe.Pointer(&ts)), 0, 0)
}

// futexWake wakes every waiter on addr.
func futexWake(addr *uint32) {
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), 1 /* FUTEX_WAKE */, uintptr(1<<31-1), 0, 0, 0)
}

// newTable creates a lease table of n slots: a sealed memory file, mapped.
// The caller closes fd once it has been sent.
func newTable(n int) (mem []byte, fd int, err error) {
	size := tableSize(n)
	fd, err = unix.MemfdCreate("goxfer-leases", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, -1, fmt.Errorf("cma: lease table: memfd_create: %w", err)
	}
	if err = unix.Ftruncate(fd, int64(size)); err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL)
	}
	if err == nil {
		mem, err = unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	}
	if err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("cma: lease table of %d bytes: %w", size, err)
	}
	putTable(mem, n)
	return mem, fd, nil
}

// mapped is a peer's memory file mapped in this process: a segment or a
// lease table, unmapped when the last reference goes.
type mapped struct {
	mem  []byte
	refs atomic.Int32
}

func (m *mapped) ref() *mapped { m.refs.Add(1); return m }

func (m *mapped) unref() {
	if m.refs.Add(-1) == 0 {
		_ = shm.Unmap(m.mem)
	}
}

// keyHash is what a lease table holds of an exposure's key: the first 16
// bytes of its SHA-256. A copier that holds the key finds the slot; one
// that reads the table learns no key.
func keyHash(k agent.Key) (h [16]byte) {
	sum := sha256.Sum256(k[:])
	copy(h[:], sum[:16])
	return h
}

// load16 and store16 read and write 16 bytes of a slot, word by word.
func load16(b []byte) (v [16]byte) {
	binary.LittleEndian.PutUint64(v[0:], atomic.LoadUint64((*uint64)(unsafe.Pointer(&b[0]))))
	binary.LittleEndian.PutUint64(v[8:], atomic.LoadUint64((*uint64)(unsafe.Pointer(&b[8]))))
	return v
}

func store16(b []byte, v [16]byte) {
	atomic.StoreUint64((*uint64)(unsafe.Pointer(&b[0])), binary.LittleEndian.Uint64(v[0:]))
	atomic.StoreUint64((*uint64)(unsafe.Pointer(&b[8])), binary.LittleEndian.Uint64(v[8:]))
}

func load64(b []byte) uint64     { return atomic.LoadUint64((*uint64)(unsafe.Pointer(&b[0]))) }
func store64(b []byte, v uint64) { atomic.StoreUint64((*uint64)(unsafe.Pointer(&b[0])), v) }
func load32(b []byte) uint32     { return atomic.LoadUint32((*uint32)(unsafe.Pointer(&b[0]))) }
func store32(b []byte, v uint32) { atomic.StoreUint32((*uint32)(unsafe.Pointer(&b[0])), v) }

// slot returns slot i's bytes.
func slotBytes(table []byte, i int) []byte {
	return table[tableHeader+i*slotSize : tableHeader+(i+1)*slotSize]
}

// slotView is what a slot publishes.
type slotView struct {
	hash   [16]byte
	lo, hi uint64
	acc    agent.Access
	segs   []uint64 // the segment IDs named, at most slotSegs
	// all: segs names every segment the exposure lies in (it lies in
	// at most slotSegs), so a range in any other is not the exposure's.
	all bool
	// whole: the exposure lies in no segment and is one region of host
	// memory, [lo, hi) (slotWhole): any range inside is its memory.
	whole bool
}

// readSlot reads slot i's publication (a hint until the slot is entered).
func readSlot(table []byte, i int) slotView {
	b := slotBytes(table, i)
	v := slotView{hash: load16(b[16:]), lo: load64(b[32:]), hi: load64(b[40:]), acc: agent.Access(load32(b[48:]))}
	total := load32(b[52:])
	v.whole = total == 0 && load32(b[56:])&slotWhole != 0
	v.all = total <= slotSegs
	n := min(int(total), slotSegs)
	for j := range n {
		if id := load64(b[80+8*j:]); id != 0 {
			v.segs = append(v.segs, id)
		}
	}
	return v
}

// putSlot writes an exposure into slot i, its stamp last. It leaves
// readers alone: a copier holding the stamp of the slot's last exposure
// may be between the two halves of a failing enter, and its leave must
// find its own increment (a count reset under it wraps below zero, and
// the next revocation waits for a copy that does not exist).
func putSlot(table []byte, i int, v slotView, nsegs int, stamp uint64) {
	b := slotBytes(table, i)
	w := slotAt(table, i)
	atomic.StoreUint32(w.waiting, 0)
	store16(b[16:], v.hash)
	store64(b[32:], v.lo)
	store64(b[40:], v.hi)
	store32(b[48:], uint32(v.acc))
	store32(b[52:], uint32(nsegs))
	var flags uint32
	if v.whole {
		flags = slotWhole
	}
	store32(b[56:], flags)
	store16(b[64:], [16]byte{})
	for j := range slotSegs {
		var id uint64
		if j < len(v.segs) {
			id = v.segs[j]
		}
		store64(b[80+8*j:], id)
	}
	atomic.StoreUint64(w.stamp, stamp)
}

// proven reports whether slot i holds the proof of the key whose hash is
// h: a copier that used the slot wrote the key.
func proven(table []byte, i int, h [16]byte) bool {
	p := load16(slotBytes(table, i)[64:])
	return p != [16]byte{} && keyHash(agent.Key(p)) == h
}

// home is the first slot an exposure may take in a table of n, by the
// hash of its key.
func home(h [16]byte, n int) int { return int(binary.LittleEndian.Uint64(h[:8]) & uint64(n-1)) }

// shmPub is the exposing side's shared memory, for the whole backend: the
// exposures published (Publisher) and the connections they are published
// on. Its mutex also guards every connection's shmServe but peerGone.
type shmPub struct {
	mu    sync.Mutex
	exps  map[agent.Key]*pubExp
	conns map[*server]struct{}
}

// pubExp is an exposure published to same-host peers.
type pubExp struct {
	x    agent.Published
	view slotView
	segs []shm.Seg
}

// shmServe is the exposing side's shared memory on one connection.
type shmServe struct {
	table *mapped  // the lease table; nil unless the connection agreed capShm
	fd    int      // the table's file until startShm sends it; -1 when none
	slots []uint64 // per slot: the generation it last held
	used  map[agent.Key]int
	segs  map[uint64]int // segments sent: published exposures lying in them
	// out queues tSeg and tSegDrop frames for the sender (shmSend): a
	// peer that does not read holds up no Expose or Revoke.
	out []shmFrame
	// taken: the sender took frames from out and has not written them
	// all yet; a segment sent at once would overtake them (a segment
	// sent again ahead of its drop).
	taken   bool
	wake    chan struct{}
	sending sync.WaitGroup
	over    bool // the connection ended: publish nothing more
	// peerGone: the copier closed its end (its process exited, or it
	// closed the socket once its copies were over): no copy of its runs.
	peerGone atomic.Bool
}

// shmFrame is a queued frame, with the segment whose descriptor it
// carries (tSeg).
type shmFrame struct {
	typ  uint8
	seg  shm.Seg
	drop uint64
}

// Publish implements [agent.Publisher]: an exposure whose memory lies in
// shared segments is written into the lease table of every connection that
// agreed shared memory, and its segments sent to those that lack them. So
// is one of a single region of other host memory (WithLeaseFree), for
// copies by cross-memory attach. Other exposures are ignored. Safe for
// concurrent use.
func (b *Backend) Publish(x agent.Published) {
	regions := x.Regions()
	if !b.cfg.shm || len(regions) == 0 {
		return
	}
	key := x.Key()
	pe := &pubExp{x: x, view: slotView{hash: keyHash(key), acc: x.Access(), lo: ^uint64(0)}}
	for _, r := range regions {
		pe.view.lo, pe.view.hi = min(pe.view.lo, r.Addr), max(pe.view.hi, r.Addr+r.Len)
		if r.Kind != agent.KindDRAM {
			continue
		}
		if sg, ok := shm.Find(r.Addr, r.Len); ok && !slices.ContainsFunc(pe.segs, func(s shm.Seg) bool { return s.ID == sg.ID }) {
			pe.segs = append(pe.segs, sg)
			if len(pe.view.segs) < slotSegs {
				pe.view.segs = append(pe.view.segs, sg.ID)
			}
		}
	}
	if len(pe.segs) == 0 {
		if !b.cfg.leaseFree || !whole(regions) {
			return
		}
		pe.view.whole = true
	}
	b.pub.mu.Lock()
	defer b.pub.mu.Unlock()
	if b.pub.exps == nil {
		b.pub.exps = map[agent.Key]*pubExp{}
	}
	b.pub.exps[key] = pe
	for s := range b.pub.conns {
		s.publishLocked(key, pe)
	}
}

// whole reports whether an exposure of regions may be published for
// cross-memory attach (slotWhole): one region of host memory, so that a
// copier checking a range against the slot's span checks it exactly as a
// lease would (agent.Lease.Slice: inside one region). Several regions,
// even touching, go to leases: a range across two of them is refused
// there.
func whole(regions []agent.Region) bool {
	return len(regions) == 1 && regions[0].Kind == agent.KindDRAM && regions[0].Len > 0
}

// publishLocked writes pe into the connection's table, if a slot is free
// within maxProbe of its home, after sending (or queueing) the segments
// new to the connection. The caller holds b.pub.mu.
func (s *server) publishLocked(key agent.Key, pe *pubExp) {
	sv := &s.sh
	if sv.over {
		return
	}
	n := len(sv.slots)
	i, h := -1, home(pe.view.hash, n)
	for j := range min(maxProbe, n) {
		k := (h + j) & (n - 1)
		if atomic.LoadUint64(slotAt(sv.table.mem, k).stamp)&3 == 0 {
			i = k
			break
		}
	}
	if i < 0 || len(sv.segs)+len(pe.segs) > maxShares {
		return // not published here: leases serve it
	}
	for _, sg := range pe.segs {
		if sv.segs[sg.ID] == 0 {
			s.queueSeg(sg)
		}
		sv.segs[sg.ID]++
	}
	sv.slots[i]++
	putSlot(sv.table.mem, i, pe.view, len(pe.segs), sv.slots[i]<<2|slotLive)
	sv.used[key] = i
}

// queueSeg sends segment sg at once if the connection is idle and its
// socket has room (an honest copier then has it before it can hold a key
// of the exposure), else queues it for the sender, in order. The caller
// holds b.pub.mu.
func (s *server) queueSeg(sg shm.Seg) {
	sv := &s.sh
	if len(sv.out) == 0 && !sv.taken && s.wmu.TryLock() {
		sent, err := s.trySendSeg(sg)
		s.wmu.Unlock()
		if err != nil {
			s.abort(err)
		}
		if sent || err != nil {
			return
		}
	}
	sv.out = append(sv.out, shmFrame{typ: tSeg, seg: sg})
	s.shmKick()
}

// shmKick wakes the connection's sender.
func (s *server) shmKick() {
	select {
	case s.sh.wake <- struct{}{}:
	default:
	}
}

// retiring is a slot being revoked on one connection.
type retiring struct {
	s    *server
	slot int
	tbl  *mapped // referenced until the wait is over
}

// Unpublish implements [agent.Publisher]: the exposure's slot on every
// connection is marked revoked (closed, if the agent is closing), and it
// returns once no copy is inside any of them: at most WithTimeout in all,
// past which the connections still inside are dropped. A connection whose
// copier proved it used the slot is bound to the exposure. The slots are
// then free for reuse (unless the agent is closing: they stay closed) and
// segments no published exposure lies in any more are dropped.
func (b *Backend) Unpublish(x agent.Published, closing bool) {
	key := x.Key()
	b.pub.mu.Lock()
	pe := b.pub.exps[key]
	if pe == nil {
		b.pub.mu.Unlock()
		return
	}
	delete(b.pub.exps, key)
	state := uint64(slotRevoked)
	if closing {
		state = slotClosed
	}
	var rs []retiring
	for s := range b.pub.conns {
		i, ok := s.sh.used[key]
		if !ok {
			continue
		}
		delete(s.sh.used, key)
		atomic.StoreUint64(slotAt(s.sh.table.mem, i).stamp, s.sh.slots[i]<<2|state)
		rs = append(rs, retiring{s: s, slot: i, tbl: s.sh.table.ref()})
	}
	b.pub.mu.Unlock()
	deadline := time.Now().Add(b.cfg.timeout)
	for _, r := range rs {
		r.s.drainSlot(r.tbl.mem, r.slot, pe.view.hash, deadline)
		if proven(r.tbl.mem, r.slot, pe.view.hash) {
			x.Bind(r.s.link)
		}
	}
	b.pub.mu.Lock()
	for _, r := range rs {
		sv := &r.s.sh
		if sv.over {
			continue // its slots die with it
		}
		// Free for the next exposure, with a stamp no copier holds; but
		// not when the agent is closing: the slot keeps saying so, for a
		// copier that left it between two pieces before it was marked
		// and tries it again only now (freed, it would read as revoked,
		// access denied, instead of the peer lost).
		if !closing {
			atomic.StoreUint64(slotAt(sv.table.mem, r.slot).stamp, sv.slots[r.slot]<<2)
		}
		for _, sg := range pe.segs {
			if sv.segs[sg.ID]--; sv.segs[sg.ID] <= 0 {
				delete(sv.segs, sg.ID)
				sv.out = append(sv.out, shmFrame{typ: tSegDrop, drop: sg.ID})
			}
		}
		r.s.shmKick()
	}
	b.pub.mu.Unlock()
	for _, r := range rs {
		r.tbl.unref()
	}
}

// bindShm binds to the connection the exposures published on it whose
// slot its copier proved it used, before the connection's loss is
// reported: they hear of it, as through a lease.
func (s *server) bindShm() {
	sv := &s.sh
	if sv.table == nil {
		return
	}
	b := s.b
	b.pub.mu.Lock()
	defer b.pub.mu.Unlock()
	for key, i := range sv.used {
		if pe := b.pub.exps[key]; pe != nil && proven(sv.table.mem, i, pe.view.hash) {
			pe.x.Bind(s.link)
		}
	}
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// drainSlot waits until no copy is inside slot i of the connection's table
// (mem), until deadline: at once if the copier's end closed; past it the
// connection is dropped, as for a lease held too long (errRevoking).
func (s *server) drainSlot(mem []byte, i int, hash [16]byte, deadline time.Time) {
	w := slotAt(mem, i)
	// Each connection gets a moment of its own, even once another used up
	// the deadline.
	deadline = later(deadline, time.Now().Add(10*time.Millisecond))
	for {
		r := atomic.LoadUint32(w.readers)
		// A copier writes the key into the slot before it enters: a count
		// without that proof is no copy of the exposure's, only a peer
		// that wrote into its own table (it may not hold the key, and
		// must not hold the revocation up).
		if r == 0 || s.sh.peerGone.Load() || !proven(mem, i, hash) {
			break
		}
		if !time.Now().Before(deadline) {
			s.b.log.Warn("cma: a peer stayed inside a revoked exposure of shared memory past the timeout; its connection is dropped", "peer", s.peer, "readers", r)
			s.abort(fmt.Errorf("%w: %d copies inside a revoked exposure of shared memory", errRevoking, r))
			break
		}
		atomic.StoreUint32(w.waiting, 1)
		futexWait(w.readers, r, time.Millisecond)
	}
	atomic.StoreUint32(w.waiting, 0)
}

// startShm sets the connection up for shared memory, once the handshake
// agreed it: it starts the sender, publishes the exposures published so
// far in the lease table (made by makeTable), and then sends the table.
func (s *server) startShm() error {
	sv := &s.sh
	mem, fd := sv.table.mem, sv.fd
	sv.fd = -1
	sv.slots = make([]uint64, maxSlots)
	sv.used, sv.segs = map[agent.Key]int{}, map[uint64]int{}
	sv.wake = make(chan struct{}, 1)
	sv.sending.Add(1)
	go s.shmSend()
	// The exposures published so far are in the table before the copier
	// sees it: a transfer posted as soon as the connection is made finds
	// them. Their segments may go out first; the copier takes them in any
	// order.
	b := s.b
	b.pub.mu.Lock()
	if b.pub.conns == nil {
		b.pub.conns = map[*server]struct{}{}
	}
	b.pub.conns[s] = struct{}{}
	for key, pe := range b.pub.exps {
		s.publishLocked(key, pe)
	}
	b.pub.mu.Unlock()
	var h [hdrSize]byte
	(&header{typ: tTable, id: uint64(len(mem))}).put(h[:])
	err := s.write(h[:], unix.UnixRights(fd))
	unix.Close(fd)
	return err
}

// makeTable creates the connection's lease table before the handshake's
// answer agrees capShm, so that a process that cannot make one (memfd
// refused, out of memory) does not agree it: the copier then never waits
// for a table that will not come, and leases serve everything. stopShm
// unmaps the table and closeTableFD closes its file, whatever happens
// next.
func (s *server) makeTable() error {
	mem, fd, err := makeLeaseTable(maxSlots)
	if err != nil {
		return err
	}
	s.sh.table = &mapped{mem: mem}
	s.sh.table.refs.Store(1)
	s.sh.fd = fd
	return nil
}

// closeTableFD closes the lease table's file if startShm did not send it.
func (s *server) closeTableFD() {
	if s.sh.fd >= 0 {
		unix.Close(s.sh.fd)
		s.sh.fd = -1
	}
}

// makeLeaseTable is newTable; tests replace it to refuse.
var makeLeaseTable = newTable

// shmSend sends the queued segments and drops, in order, until the
// connection ends. A segment freed before it could be sent is skipped, and
// so is its drop.
func (s *server) shmSend() {
	defer s.sh.sending.Done()
	skipped := map[uint64]bool{}
	for {
		select {
		case <-s.sh.wake:
		case <-s.done:
			return
		}
		s.b.pub.mu.Lock()
		out := s.sh.out
		s.sh.out, s.sh.taken = nil, len(out) > 0
		s.b.pub.mu.Unlock()
		s.wmu.Lock()
		var err error
		for _, f := range out {
			switch f.typ {
			case tSeg:
				var sent bool
				if sent, err = s.sendSegLocked(f.seg); err == nil && !sent {
					skipped[f.seg.ID] = true
				}
			default:
				if skipped[f.drop] {
					delete(skipped, f.drop)
					continue
				}
				var h [hdrSize]byte
				(&header{typ: tSegDrop, id: f.drop}).put(h[:])
				err = s.writeLocked(h[:], nil)
			}
			if err != nil {
				break
			}
		}
		s.wmu.Unlock()
		if err != nil {
			s.abort(err)
			return
		}
		s.b.pub.mu.Lock()
		s.sh.taken = false
		s.b.pub.mu.Unlock()
	}
}

// segFrame builds the tSeg of sg with a new descriptor of it, or reports
// (fd < 0) that it was freed meanwhile.
func segFrame(sg shm.Seg) (b []byte, fd int) {
	fd, err := shm.DupFD(sg.ID)
	if err != nil {
		return nil, -1
	}
	b = make([]byte, hdrSize, hdrSize+segInfoSize)
	(&header{typ: tSeg, id: sg.ID, length: segInfoSize}).put(b)
	return putSeg(b, sg.Size, sg.Base), fd
}

// sendSegLocked sends segment sg with its descriptor, waiting for the
// peer to read as any write does; sent is false if the segment was freed
// before it could be. The caller holds s.wmu.
func (s *server) sendSegLocked(sg shm.Seg) (sent bool, err error) {
	b, fd := segFrame(sg)
	if fd < 0 {
		return false, nil
	}
	defer unix.Close(fd)
	return true, s.writeLocked(b, unix.UnixRights(fd))
}

// trySendSeg sends segment sg now if the socket has room for the whole
// frame without waiting; sent is false if it had not (nothing was sent).
// The caller holds s.wmu.
func (s *server) trySendSeg(sg shm.Seg) (sent bool, err error) {
	b, fd := segFrame(sg)
	if fd < 0 {
		return false, nil // the sender retries, or skips it and its drop
	}
	defer unix.Close(fd)
	rc, err := s.c.SyscallConn()
	if err != nil {
		return false, nil
	}
	var n int
	var serr error
	if err := rc.Write(func(sfd uintptr) bool {
		n, serr = unix.SendmsgN(int(sfd), b, unix.UnixRights(fd), nil, unix.MSG_DONTWAIT)
		return true
	}); err != nil {
		return false, nil
	}
	switch {
	case serr == unix.EAGAIN || serr == unix.EWOULDBLOCK:
		return false, nil
	case serr != nil:
		return false, serr
	case n < len(b):
		// Part of the frame went, with the descriptor: the rest must
		// follow before anything else.
		return true, s.writeLocked(b[n:], nil)
	}
	return true, nil
}

// stopShm ends the connection's shared memory once its reader returned:
// no more publishing; every slot still live is revoked and waited for
// (at once if the copier closed its end, which it does only once no copy
// of its runs), then the table is unmapped, once no Unpublish uses it.
func (s *server) stopShm() {
	sv := &s.sh
	if sv.table == nil {
		return
	}
	b := s.b
	b.pub.mu.Lock()
	delete(b.pub.conns, s)
	sv.over = true
	type used struct {
		slot int
		hash [16]byte
	}
	var slots []used
	for key, i := range sv.used {
		atomic.StoreUint64(slotAt(sv.table.mem, i).stamp, sv.slots[i]<<2|slotRevoked)
		slots = append(slots, used{slot: i, hash: keyHash(key)})
	}
	sv.used = nil
	b.pub.mu.Unlock()
	deadline := time.Now().Add(b.cfg.timeout)
	for _, u := range slots {
		s.drainSlot(sv.table.mem, u.slot, u.hash, deadline)
	}
	sv.sending.Wait() // s.done is closed by now
	sv.table.unref()
}

// segMap is one of the exposing side's segments mapped here.
type segMap struct {
	id, base, size uint64
	m              *mapped
}

// shmPeer is the copier's shared memory for one connection: the lease
// table and the segments mapped, sorted by their address in the exposing
// process.
type shmPeer struct {
	mu    sync.Mutex
	table *mapped
	slots int
	segs  []*segMap
	err   error // the connection failed: nothing more is mapped
	// arrived is closed, and cleared, when the table or a segment
	// arrives: transfers waiting for one retry (resolve).
	arrived chan struct{}
	noTable bool // the table did not come: no transfer waits for it again
	// unmapped lists the segments sent that could not be mapped here
	// (for want of memory or address space): transfers of exposures
	// lying in them go to leases at once, and their drops are honest.
	unmapped map[uint64]bool
}

// table handles a tTable: the connection's lease table, mapped once.
func (p *peer) table(f *frame, rr *rightsReader) error {
	fd := rr.take()
	if fd < 0 {
		return fmt.Errorf("%w: lease table came with no file descriptor", errProtocol)
	}
	defer unix.Close(fd)
	if f.id < tableHeader || f.id > uint64(tableSize(maxSlots)) {
		return fmt.Errorf("%w: lease table of %d bytes, want %d to %d", errProtocol, f.id, tableHeader, tableSize(maxSlots))
	}
	sp := &p.sh
	sp.mu.Lock()
	defer sp.mu.Unlock()
	if sp.table != nil {
		return fmt.Errorf("%w: a second lease table", errProtocol)
	}
	if sp.err != nil {
		return nil
	}
	mem, err := shm.Map(fd, f.id)
	if err != nil {
		return fmt.Errorf("%w: lease table: %w", errProtocol, err)
	}
	n, err := parseTable(mem, f.id)
	if err != nil {
		_ = shm.Unmap(mem)
		return err
	}
	sp.table = &mapped{mem: mem}
	sp.table.refs.Store(1)
	sp.slots = n
	if sp.arrived != nil {
		close(sp.arrived)
		sp.arrived = nil
	}
	return nil
}

// segment handles a tSeg: a segment of the peer's, mapped once. One that
// cannot be mapped for want of memory is logged and left out: transfers
// of it go to leases.
func (p *peer) segment(f *frame, rr *rightsReader) error {
	fd := rr.take()
	if fd < 0 {
		return fmt.Errorf("%w: segment %d came with no file descriptor", errProtocol, f.id)
	}
	defer unix.Close(fd)
	si, err := getSeg(f)
	if err != nil {
		return err
	}
	sp := &p.sh
	sp.mu.Lock()
	defer sp.mu.Unlock()
	if sp.err != nil {
		return nil
	}
	if sp.unmapped[si.id] || slices.ContainsFunc(sp.segs, func(s *segMap) bool { return s.id == si.id }) {
		return fmt.Errorf("%w: segment %d shared twice", errProtocol, si.id)
	}
	if len(sp.segs)+len(sp.unmapped) >= maxShares {
		return fmt.Errorf("%w: more than %d segments shared on one connection", errLimit, maxShares)
	}
	mem, err := shm.Map(fd, si.size)
	if err != nil {
		if errors.Is(err, shm.ErrInvalid) {
			return fmt.Errorf("%w: segment %d: %w", errProtocol, si.id, err)
		}
		p.b.log.Warn("cma: could not map a peer's shared segment; leases serve it", "peer", p.id, "err", err)
		if sp.unmapped == nil {
			sp.unmapped = map[uint64]bool{}
		}
		sp.unmapped[si.id] = true
		if sp.arrived != nil { // transfers waiting for it go to leases
			close(sp.arrived)
			sp.arrived = nil
		}
		return nil
	}
	sm := &segMap{id: si.id, base: si.base, size: si.size, m: &mapped{mem: mem}}
	sm.m.refs.Store(1)
	i, _ := slices.BinarySearchFunc(sp.segs, si.base, func(s *segMap, b uint64) int { return cmp.Compare(s.base, b) })
	sp.segs = slices.Insert(sp.segs, i, sm)
	if sp.arrived != nil {
		close(sp.arrived)
		sp.arrived = nil
	}
	return nil
}

// segDrop handles a tSegDrop: the connection's reference on the segment
// goes; transfers copying through it keep theirs.
func (p *peer) segDrop(id uint64) error {
	sp := &p.sh
	sp.mu.Lock()
	i := slices.IndexFunc(sp.segs, func(s *segMap) bool { return s.id == id })
	var sm *segMap
	if i >= 0 {
		sm = sp.segs[i]
		sp.segs = slices.Delete(sp.segs, i, i+1)
	}
	failed := sp.err != nil || sp.unmapped[id]
	delete(sp.unmapped, id)
	sp.mu.Unlock()
	if sm == nil {
		if failed {
			return nil
		}
		return fmt.Errorf("%w: drop of segment %d, which was not shared", errProtocol, id)
	}
	sm.m.unref()
	return nil
}

// shmFail ends the connection's shared memory: the mappings go once the
// copies using them returned.
func (p *peer) shmFail(err error) {
	sp := &p.sh
	sp.mu.Lock()
	if sp.err != nil {
		sp.mu.Unlock()
		return
	}
	sp.err = err
	segs, table := sp.segs, sp.table
	sp.segs, sp.table = nil, nil
	sp.mu.Unlock()
	for _, s := range segs {
		s.m.unref()
	}
	if table != nil {
		table.unref()
	}
}

// shmXfer is a transfer resolved against the peer's published exposure:
// its slot, the stamp to find there, and the mappings it copies through,
// referenced until it ends.
type shmXfer struct {
	w    slotWords
	want uint64
	held []*mapped
	// vm: the exposure is not in shared memory (slotWhole): copied with
	// cross-memory attach, inside the slot (copyVM).
	vm bool
}

func (t *shmXfer) release() {
	for _, m := range t.held {
		m.unref()
	}
}

// resolve finds x's exposure published in the peer's lease table and
// where each of its ranges lies in the segments mapped here, into ops. It
// reports false (nothing held) if the key is not published for x's access,
// or a range lies outside the exposure's span or outside every segment:
// leases then serve x. The lease table on a new connection, and a segment
// the slot names, that have not arrived yet (sent right after the
// handshake, or as the exposure was made: still in the socket) are waited
// for, until x is cancelled, the peer is lost, or for WithTimeout (at
// least segWait): as long as a lease request may go unanswered. An honest
// peer always sends them, only late when its sender was descheduled on a
// loaded machine (100 ms and more was seen: a fixed short wait sent such
// transfers to leases, which wait on the same socket anyway); a peer that
// names segments it never sends costs each transfer of its exposures that
// bound, as one that never answers a lease request does.
func (p *peer) resolve(x *agent.Work, ops []shmOp) (*shmXfer, bool) {
	h := keyHash(x.Key)
	deadline := time.Time{}
	for {
		t, missing, arrived := p.resolveOnce(x, h, ops)
		if !missing {
			return t, t != nil
		}
		if deadline.IsZero() {
			deadline = time.Now().Add(max(segWait, p.b.cfg.timeout))
		}
		wait := time.Until(deadline)
		if wait <= 0 {
			p.sh.mu.Lock()
			if p.sh.table == nil {
				p.sh.noTable = true // the peer sent none: it had none to send
			}
			p.sh.mu.Unlock()
			return nil, false
		}
		timer := time.NewTimer(wait)
		select {
		case <-arrived:
		case <-p.dead:
		case <-timer.C:
		case <-x.Cancelled():
			timer.Stop()
			return nil, false // leases see the cancellation at once
		}
		timer.Stop()
	}
}

// segWait is the least time a transfer waits for the lease table or a
// segment its exposure's slot names, before leases serve it instead
// (resolve waits for WithTimeout, when it is longer).
const segWait = 100 * time.Millisecond

// resolveOnce is one try of resolve. missing says a segment the slot names
// has not arrived; arrived is closed when the next one does.
func (p *peer) resolveOnce(x *agent.Work, h [16]byte, ops []shmOp) (t *shmXfer, missing bool, arrived chan struct{}) {
	sp := &p.sh
	sp.mu.Lock()
	defer sp.mu.Unlock()
	if sp.err != nil || sp.noTable {
		return nil, false, nil
	}
	if sp.table == nil {
		// Sent right after the handshake: a transfer posted at once on a
		// new connection gets there first.
		if sp.arrived == nil {
			sp.arrived = make(chan struct{})
		}
		return nil, true, sp.arrived
	}
	tbl := sp.table.mem
	slot := -1
	var v slotView
	var want uint64
	home := home(h, sp.slots)
	for j := range min(maxProbe, sp.slots) {
		k := (home + j) & (sp.slots - 1)
		// The stamp before the view: the exposing side writes a slot's
		// view only while its stamp is no live one, and its stamp last,
		// so a view read between this stamp and an enter that finds it
		// unchanged is the one published with it. Read after the view,
		// the stamp could be that of an exposure which took the slot
		// since: the old key would enter the new exposure's generation.
		st := atomic.LoadUint64(slotAt(tbl, k).stamp)
		if st == 0 {
			break // never used: an exposure published would lie here or before
		}
		if v = readSlot(tbl, k); v.hash == h {
			slot, want = k, st
			break
		}
	}
	if slot < 0 {
		return nil, false, nil
	}
	w := slotAt(tbl, slot)
	// An exposure in more than slotSegs segments goes to leases: a range
	// in a segment the slot does not name could only be found by address,
	// and a freed segment whose drop is still on its way may lie at the
	// same address as a new one.
	if want&3 != slotLive || v.acc != x.Op.Access() || !v.all {
		return nil, false, nil
	}
	if v.whole {
		return p.resolveWhole(x, tbl, slot, w, v, want), false, nil
	}
	var named [slotSegs]*segMap
	for j, id := range v.segs {
		if sp.unmapped[id] {
			return nil, false, nil
		}
		k := slices.IndexFunc(sp.segs, func(s *segMap) bool { return s.id == id })
		if k < 0 {
			if sp.arrived == nil {
				sp.arrived = make(chan struct{})
			}
			return nil, true, sp.arrived
		}
		named[j] = sp.segs[k]
	}
	t = &shmXfer{w: w, want: want}
	var used [4]*segMap
	nused := 0
	for i := range x.Segments {
		sg := &x.Segments[i]
		a, n := sg.Remote.Addr, sg.Remote.Len
		if a < v.lo || a+n > v.hi || a+n < a || uint64(len(sg.Local.Mem)) != n {
			t.release()
			return nil, false, nil
		}
		// In one of the segments the exposure lies in, by identity: not
		// one the exposure does not lie in (between two that it does,
		// inside its span), nor a freed one at the same address.
		var s *segMap
		for _, c := range named[:len(v.segs)] {
			if a >= c.base && a+n <= c.base+c.size {
				s = c
				break
			}
		}
		if s == nil {
			t.release()
			return nil, false, nil
		}
		off := a - s.base
		ops[i] = shmOp{local: sg.Local.Mem, remote: s.m.mem[off : off+n]} // cap to the segment's end: mergeOps
		if slices.Contains(used[:nused], s) {
			continue
		}
		if nused < len(used) {
			used[nused] = s
			nused++
		}
		t.held = append(t.held, s.m.ref())
	}
	t.held = append(t.held, sp.table.ref())
	// The proof that this connection used the exposure: the key itself,
	// which only a holder of it can write (its hash is what the slot
	// shows).
	if b := slotBytes(tbl, slot)[64:]; load16(b) != x.Key {
		store16(b, x.Key)
	}
	return t, false, nil
}

// resolveWhole is resolveOnce for an exposure of ordinary host memory
// (slotWhole): x is copied with cross-memory attach inside the slot if
// every range is nonempty and lies in the exposure's span (its one
// region), x is small enough to be copied on the posting goroutine
// (shmInline), and WithLeaseFree is on here; else nil, and leases serve
// it. The caller holds p.sh.mu.
func (p *peer) resolveWhole(x *agent.Work, tbl []byte, slot int, w slotWords, v slotView, want uint64) *shmXfer {
	if !p.b.cfg.leaseFree || x.Bytes() > shmInline {
		return nil
	}
	for i := range x.Segments {
		sg := &x.Segments[i]
		a, n := sg.Remote.Addr, sg.Remote.Len
		if n == 0 || a < v.lo || a+n > v.hi || a+n < a || uint64(len(sg.Local.Mem)) != n {
			return nil
		}
	}
	if b := slotBytes(tbl, slot)[64:]; load16(b) != x.Key {
		store16(b, x.Key) // the proof, as resolveOnce writes it
	}
	return &shmXfer{w: w, want: want, held: []*mapped{p.sh.table.ref()}, vm: true}
}

// postShared moves x through the peer's lease table if its exposure is
// published there and every range lies in it, and reports whether it
// did; otherwise leases serve x. Through shared memory, transfers of up
// to shmInline bytes are copied before it returns, on the caller's
// goroutine; larger ones by the workers, after a tUse tells the exposing
// side. An exposure of other host memory is copied with cross-memory
// attach before it returns (copyVM), at most shmInline bytes. A transfer
// that must wait for the lease table or a segment (sent, not read yet)
// waits on a goroutine of its own (postLater): Post returns at once.
func (b *Backend) postShared(p *peer, x *agent.Work) bool {
	var one [1]shmOp
	ops := one[:]
	if len(x.Segments) > 1 {
		ops = make([]shmOp, len(x.Segments))
	}
	t, missing, _ := p.resolveOnce(x, keyHash(x.Key), ops)
	switch {
	case missing:
		if len(x.Segments) == 1 {
			ops = make([]shmOp, 1) // one[:] must not escape to the goroutine's wait
		}
		go b.postLater(p, x, ops)
		return true
	case t == nil:
		return false
	}
	b.runShared(p, x, t, ops)
	return true
}

// postLater is postShared for a transfer that waits for the lease table
// or a segment (resolve: until it comes, x is cancelled, the peer is lost,
// or WithTimeout), then moves through the table or under leases.
func (b *Backend) postLater(p *peer, x *agent.Work, ops []shmOp) {
	t, ok := p.resolve(x, ops)
	if ok {
		b.runShared(p, x, t, ops)
		return
	}
	select {
	case <-x.Cancelled():
		// Cancelled while it waited: it ends here, asking the peer for
		// nothing.
		x.Finish(x.CancelErr())
		b.xwg.Done()
		return
	default:
	}
	if err := b.postLeases(p, x); err != nil {
		x.Finish(err) // not started; postLeases gave its count back
	}
}

// runShared copies x through t: postShared's work once x is resolved.
func (b *Backend) runShared(p *peer, x *agent.Work, t *shmXfer, ops []shmOp) {
	if t.vm {
		x.Via("table")
		b.finishShared(p, x, t, b.copyVM(p, x, t))
		return
	}
	x.Via("shm")
	if len(ops) > 1 {
		ops = mergeOps(ops)
	}
	if x.Bytes() <= shmInline {
		b.finishShared(p, x, t, b.copyShared(p, x, t, ops, 1))
		return
	}
	p.send(&header{typ: tUse, status: uint8(x.Op.Access()), key: x.Key}, nil, nil)
	go func() { b.finishShared(p, x, t, b.copyShared(p, x, t, ops, b.cfg.workers)) }()
}

// finishShared ends a transfer moved through shared memory: it finishes,
// then its notification goes out (one way; agent.Work.FinishNotify).
func (b *Backend) finishShared(p *peer, x *agent.Work, t *shmXfer, err error) {
	t.release()
	if err == nil {
		x.FinishNotify(p.notify)
	} else {
		x.Finish(err)
	}
	b.xwg.Done()
}

// revoked says why a copy found its slot's stamp seen instead of the one
// it wanted: the agent closing (the peer is lost) or the exposure revoked.
func (p *peer) revoked(t *shmXfer, seen uint64, key agent.Key) error {
	if seen == t.want&^3|slotClosed {
		return fmt.Errorf("cma: peer %s is closing: %w", p.id, agent.ErrRemoteLost)
	}
	return fmt.Errorf("cma: peer %s: %w: exposure %v revoked", p.id, agent.ErrAccessDenied, key)
}

// shmOp is one segment's copy through a mapping.
type shmOp struct {
	local, remote []byte
}

// Copies through shared memory: a transfer of up to shmInline bytes is
// copied on the goroutine that posts it; a larger one is cut into pieces
// of at most shmPiece bytes that the workers (WithWorkers) take in turn,
// each leaving the slot at least every shmHold bytes so that a revocation
// waits for little.
const (
	shmInline = 1 << 20
	shmPiece  = 4 << 20
	shmHold   = 16 << 20
)

// copyShared copies ops through t with up to workers goroutines (this one
// included), inside t's slot, and reports why it stopped early: the
// transfer was cancelled, the exposure revoked, or the peer lost (checked
// before each piece: a peer that died is no longer there to hear of it,
// even though its memory is still mapped here). The
// connection stays open while copies run (holdShared), since its end is
// what tells the exposing side that none does.
func (b *Backend) copyShared(p *peer, x *agent.Work, t *shmXfer, ops []shmOp, workers int) error {
	if err := p.holdShared(); err != nil {
		return err
	}
	defer p.unholdShared()
	write := x.Op == agent.OpWrite
	if workers <= 1 {
		if seen, ok := t.w.try(t.want); !ok {
			return p.revoked(t, seen, x.Key)
		}
		for _, op := range ops {
			if write {
				copy(op.remote, op.local)
			} else {
				copy(op.local, op.remote)
			}
		}
		t.w.leave()
		return nil
	}
	// Pieces of at most shmPiece bytes, taken in turn.
	var pieces []shmOp
	for _, op := range ops {
		for len(op.local) > shmPiece {
			pieces = append(pieces, shmOp{local: op.local[:shmPiece], remote: op.remote[:shmPiece]})
			op.local, op.remote = op.local[shmPiece:], op.remote[shmPiece:]
		}
		pieces = append(pieces, op)
	}
	workers = min(workers, len(pieces))
	var next atomic.Int64
	var failed atomic.Pointer[error]
	run := func() {
		in := false
		var held int
		for failed.Load() == nil {
			i := int(next.Add(1) - 1)
			if i >= len(pieces) {
				break
			}
			if in && held >= shmHold {
				t.w.leave()
				in, held = false, 0
			}
			select {
			case <-x.Cancelled():
				err := x.CancelErr()
				failed.CompareAndSwap(nil, &err)
				i = len(pieces)
			case <-p.dead:
				// The peer's end closed: it is gone, or dropped us. Its
				// memory may outlive it here, but nobody would hear of
				// the transfer.
				err := p.failure()
				failed.CompareAndSwap(nil, &err)
				i = len(pieces)
			default:
			}
			if i == len(pieces) {
				break
			}
			if !in {
				if seen, ok := t.w.try(t.want); !ok {
					err := p.revoked(t, seen, x.Key)
					failed.CompareAndSwap(nil, &err)
					return
				}
				in = true
			}
			op := pieces[i]
			if write {
				copy(op.remote, op.local)
			} else {
				copy(op.local, op.remote)
			}
			held += len(op.local)
		}
		if in {
			t.w.leave()
		}
	}
	var wg sync.WaitGroup
	for range workers - 1 {
		wg.Add(1)
		go func() { defer wg.Done(); run() }()
	}
	run()
	wg.Wait()
	if err := failed.Load(); err != nil {
		return *err
	}
	return nil
}

// copyVM copies x, an exposure of ordinary host memory found in the
// peer's lease table (resolveWhole), with cross-memory attach on the
// peer's process, inside t's slot, on the calling goroutine. As through a
// mapping, the connection stays open while it copies (holdShared): its
// end tells the exposing side that no copy runs.
func (b *Backend) copyVM(p *peer, x *agent.Work, t *shmXfer) error {
	if err := p.holdShared(); err != nil {
		return err
	}
	defer p.unholdShared()
	if seen, ok := t.w.try(t.want); !ok {
		return p.revoked(t, seen, x.Key)
	}
	v := driverIovecs.Get().(*iovecs)
	err := vmSegments(int(p.ci.pid), x.Op == agent.OpWrite, x.Segments, v)
	t.w.leave()
	driverIovecs.Put(v)
	if err != nil {
		return (&xstate{p: p, x: x}).copyError(err)
	}
	return nil
}

// vmSegments copies segs with process_vm_readv/writev on process pid, at
// most iovMax segments a call, through v.
func vmSegments(pid int, write bool, segs []agent.Segment, v *iovecs) error {
	n, total := 0, uint64(0)
	flush := func() error {
		err := vmCopy(pid, write, v.local[:n], v.remote[:n], total)
		clear(v.local[:n]) // hold no reference to local memory
		n, total = 0, 0
		return err
	}
	for i := range segs {
		sg := &segs[i]
		if n == iovMax {
			if err := flush(); err != nil {
				return err
			}
		}
		v.local[n] = unix.Iovec{Base: &sg.Local.Mem[0]}
		v.local[n].SetLen(len(sg.Local.Mem))
		v.remote[n] = unix.RemoteIovec{Base: uintptr(sg.Remote.Addr), Len: int(sg.Remote.Len)}
		n++
		total += sg.Remote.Len
	}
	if n == 0 {
		return nil
	}
	return flush()
}

// holdShared keeps the connection open while a copy through a mapping
// runs: it fails once the peer did.
func (p *peer) holdShared() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return p.failureLocked()
	}
	p.holding++
	return nil
}

// unholdShared ends what holdShared began, closing the connection of a
// failed peer once no copy runs.
func (p *peer) unholdShared() {
	p.mu.Lock()
	p.holding--
	last := p.holding == 0 && p.err != nil
	p.mu.Unlock()
	if last {
		p.shut()
	}
}

// sharable reports whether x may move through shared memory: host memory
// on both sides.
func sharable(x *agent.Work) bool {
	for i := range x.Segments {
		if x.Segments[i].Local.Kind != agent.KindDRAM || x.Segments[i].Remote.Kind != agent.KindDRAM {
			return false
		}
	}
	return len(x.Segments) > 0
}

// mergeOps merges neighbouring copies that are contiguous on both sides
// (KV-cache blocks of a pool, in order): one copy of a few MiB runs faster
// than many of 64 KiB (memmove streams past the cache from 1 MiB). Only
// slices whose capacity already covers the next are merged, so no slice
// reaches past what it was cut from.
func mergeOps(ops []shmOp) []shmOp {
	out := ops[:1]
	for _, op := range ops[1:] {
		last := &out[len(out)-1]
		if follows(last.local, op.local) && follows(last.remote, op.remote) {
			n := len(last.local) + len(op.local)
			last.local, last.remote = last.local[:n], last.remote[:n]
			continue
		}
		out = append(out, op)
	}
	return out
}

// follows reports whether b starts where a ends, within a's capacity.
func follows(a, b []byte) bool {
	return len(b) > 0 && cap(a)-len(a) >= len(b) &&
		unsafe.Add(unsafe.Pointer(unsafe.SliceData(a)), len(a)) == unsafe.Pointer(unsafe.SliceData(b))
}
