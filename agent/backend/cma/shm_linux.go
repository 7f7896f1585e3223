//go:build linux

package cma

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sort"
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

// mapKey names a mapping: an exposure key, for one access.
type mapKey struct {
	key agent.Key
	acc agent.Access
}

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

// enter counts a copy in the slot and reports whether the mapping is still
// want (its generation, live). On false the copy must not touch the
// memory; it has left already.
func (w slotWords) enter(want uint64) bool {
	atomic.AddUint32(w.readers, 1)
	if atomic.LoadUint64(w.stamp) == want {
		return true
	}
	w.leave()
	return false
}

// leave ends a copy entered with enter, waking a revocation that waits.
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

// shmServe is the exposing side's shared-memory state for one connection.
type shmServe struct {
	mu    sync.Mutex
	table []byte // the lease table, mapped; nil until the first mapping
	gens  []uint64
	free  []int // slots free for reuse; slots past len(gens) are fresh
	byKey map[mapKey]*served
	segs  map[uint64]int // segments sent on the connection: mappings naming them
	// peerGone: the copier closed its end (its process exited, or it
	// closed the socket once its copies were over): no copy of its runs.
	peerGone atomic.Bool
	over     bool // the connection ended: send nothing more
}

// served is one mapping granted on a connection.
type served struct {
	k        mapKey
	retiring bool // under shmServe.mu: the slot is being retired
	ans      mapAnswer
	lease    agent.Lease // standing: released once the slot drained
	segs     []uint64
}

// mapReq answers a tMap (f): it checks the key and access as for a lease,
// and grants the exposure's regions that lie in shared segments, sending
// the lease table and the segments new to the connection first.
func (s *server) mapReq(f *frame) error {
	k := mapKey{key: f.key, acc: agent.Access(f.status)}
	sv := &s.sh
	sv.mu.Lock()
	if m := sv.byKey[k]; m != nil && !m.retiring {
		sv.mu.Unlock()
		return s.answerMap(f.id, &m.ans) // asked again (the copier dropped its copy)
	}
	sv.mu.Unlock()
	lease, err := s.b.host.Open(s.link, f.key, k.acc)
	if errors.Is(err, agent.ErrRemoteLost) {
		return s.answer(tMapped, f.id, stLost, err, nil)
	}
	if err != nil {
		s.b.stats.Deny()
		return s.answer(tMapped, f.id, stDenied, err, nil)
	}
	var ents []mapEntry
	var segs []uint64
	sizes := map[uint64]uint64{}
	for _, r := range lease.Regions() {
		if r.Kind != agent.KindDRAM {
			continue
		}
		sg, ok := shm.Find(r.Addr, r.Len)
		if !ok {
			continue
		}
		ents = append(ents, mapEntry{addr: r.Addr, n: r.Len, seg: sg.ID, off: r.Addr - sg.Base})
		if _, seen := sizes[sg.ID]; !seen {
			sizes[sg.ID] = sg.Size
			segs = append(segs, sg.ID)
		}
	}
	if len(ents) == 0 || len(ents) > maxMapEntries {
		lease.Release()
		return s.answer(tMapped, f.id, stNone, nil, nil)
	}
	sv.mu.Lock()
	defer sv.mu.Unlock()
	if m := sv.byKey[k]; m != nil { // a retiring one, being revoked
		lease.Release()
		return s.answer(tMapped, f.id, stNone, nil, nil)
	}
	fresh := 0
	for _, id := range segs {
		if _, ok := sv.segs[id]; !ok {
			fresh++
		}
	}
	slot := -1
	switch {
	case len(sv.segs)+fresh > maxShares:
	case len(sv.free) > 0:
		slot = sv.free[len(sv.free)-1]
		sv.free = sv.free[:len(sv.free)-1]
	case len(sv.gens) < maxSlots:
		slot = len(sv.gens)
		sv.gens = append(sv.gens, 0)
	}
	if slot < 0 {
		lease.Release()
		return s.answer(tMapped, f.id, stNone, nil, nil)
	}
	if sv.table == nil {
		mem, fd, err := newTable(maxSlots)
		if err != nil {
			sv.free = append(sv.free, slot)
			lease.Release()
			s.b.log.Warn("cma: no lease table for shared memory; leases serve instead", "peer", s.peer, "err", err)
			return s.answer(tMapped, f.id, stNone, nil, nil)
		}
		var b [hdrSize]byte
		(&header{typ: tTable, id: uint64(len(mem))}).put(b[:])
		err = s.write(b[:], unix.UnixRights(fd))
		unix.Close(fd)
		sv.table = mem
		if err != nil {
			lease.Release()
			return err
		}
	}
	for _, id := range segs {
		if _, ok := sv.segs[id]; ok {
			continue
		}
		fd, err := shm.DupFD(id)
		if err != nil { // pinned by the exposure: cannot happen but through a bug
			sv.free = append(sv.free, slot)
			lease.Release()
			return s.answer(tMapped, f.id, stNone, nil, nil)
		}
		b := make([]byte, hdrSize, hdrSize+segInfoSize)
		(&header{typ: tSeg, id: id, length: segInfoSize}).put(b)
		b = binary.LittleEndian.AppendUint64(b, sizes[id])
		err = s.write(b, unix.UnixRights(fd))
		unix.Close(fd)
		if err != nil {
			lease.Release()
			return err
		}
		if sv.segs == nil {
			sv.segs = map[uint64]int{}
		}
		sv.segs[id] = 0
	}
	for _, id := range segs {
		sv.segs[id]++
	}
	sv.gens[slot]++
	gen := sv.gens[slot]
	w := slotAt(sv.table, slot)
	atomic.StoreUint32(w.readers, 0)
	atomic.StoreUint32(w.waiting, 0)
	atomic.StoreUint64(w.stamp, gen<<2|slotLive)
	lease.Stand()
	m := &served{k: k, ans: mapAnswer{slot: uint32(slot), gen: gen, entries: ents}, lease: lease, segs: segs}
	if sv.byKey == nil {
		sv.byKey = map[mapKey]*served{}
	}
	sv.byKey[k] = m
	gone := lease.Gone()
	s.watchWG.Add(1)
	go func() {
		defer s.watchWG.Done()
		select {
		case <-gone:
		case <-s.done:
		}
		s.retire(m)
	}()
	return s.answerMap(f.id, &m.ans)
}

// answerMap writes a granted tMapped.
func (s *server) answerMap(id uint64, a *mapAnswer) error {
	b := make([]byte, hdrSize, hdrSize+len(a.entries)*mapEntrySize+mapAnswerSize)
	(&header{typ: tMapped, status: stOK, count: uint32(len(a.entries)), id: id, length: mapAnswerSize}).put(b)
	return s.write(putMapAnswer(b, *a), nil)
}

// retire ends mapping m, whose exposure is gone or whose connection ended:
// it marks the slot revoked, waits until no copy is inside it (at most
// WithTimeout; at once if the copier's end closed), then releases the
// exposure's standing lease, so that Revoke returns only once no copy
// touches the memory. Past the timeout the connection is dropped
// (errRevoking) and the lease released: the peer is not waited for
// forever. The copier then hears tUnmap, and tSegDrop for segments no
// mapping names any more.
func (s *server) retire(m *served) {
	sv := &s.sh
	sv.mu.Lock()
	m.retiring = true
	w := slotAt(sv.table, int(m.ans.slot))
	sv.mu.Unlock()
	state := uint64(slotRevoked)
	if m.lease.Closing() {
		state = slotClosed
	}
	atomic.StoreUint64(w.stamp, m.ans.gen<<2|state)
	deadline := time.Now().Add(s.b.cfg.timeout)
	for {
		r := atomic.LoadUint32(w.readers)
		if r == 0 || sv.peerGone.Load() {
			break
		}
		if !time.Now().Before(deadline) {
			s.b.log.Warn("cma: a peer stayed inside a revoked mapping of shared memory past the timeout; its connection is dropped", "peer", s.peer, "readers", r)
			s.abort(fmt.Errorf("%w: %d copies inside a revoked mapping of shared memory", errRevoking, r))
			break
		}
		atomic.StoreUint32(w.waiting, 1)
		futexWait(w.readers, r, time.Millisecond)
	}
	atomic.StoreUint32(w.waiting, 0)
	m.lease.Release()
	sv.mu.Lock()
	defer sv.mu.Unlock()
	delete(sv.byKey, m.k)
	sv.free = append(sv.free, int(m.ans.slot))
	var drop []uint64
	for _, id := range m.segs {
		if sv.segs[id]--; sv.segs[id] <= 0 {
			delete(sv.segs, id)
			drop = append(drop, id)
		}
	}
	if sv.over {
		return
	}
	var b [hdrSize]byte
	(&header{typ: tUnmap, status: uint8(m.k.acc), id: uint64(m.ans.slot), key: m.k.key}).put(b[:])
	if err := s.write(b[:], nil); err != nil {
		return // the connection is ending: the copier unmaps everything
	}
	for _, id := range drop {
		(&header{typ: tSegDrop, id: id}).put(b[:])
		if err := s.write(b[:], nil); err != nil {
			return
		}
	}
}

// closeShm unmaps the connection's lease table, once every mapping was
// retired (serve calls it after the watchers returned).
func (s *server) closeShm() {
	sv := &s.sh
	sv.mu.Lock()
	defer sv.mu.Unlock()
	sv.over = true
	if sv.table != nil {
		_ = unix.Munmap(sv.table)
		sv.table = nil
	}
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

// mapping is the copier's view of one granted mapping: the slot to enter,
// the generation to find there, and the exposure's regions in shared
// segments with where they are mapped here. A negative one (none) says
// the exposure has no shared memory: leases serve it.
type mapping struct {
	k      mapKey
	none   bool
	slot   uint32
	w      slotWords
	want   uint64
	regs   []shmReg // sorted by addr
	maxEnd []uint64 // running maximum end, as agent's regionSet
	held   []*mapped
	refs   atomic.Int32 // the cache's, and one per transfer using it
}

// shmReg is an exposed region of the peer mapped here.
type shmReg struct {
	addr, n uint64
	mem     []byte
}

func (m *mapping) release() {
	if m.refs.Add(-1) == 0 {
		for _, h := range m.held {
			h.unref()
		}
	}
}

// find returns the mapped bytes of the peer's [addr, addr+n), or nil if
// they lie in no region of the mapping.
func (m *mapping) find(addr, n uint64) []byte {
	end := addr + n
	if n == 0 || end < addr {
		return nil
	}
	i := sort.Search(len(m.regs), func(i int) bool { return m.regs[i].addr > addr }) - 1
	for ; i >= 0 && m.maxEnd[i] >= end; i-- {
		if r := &m.regs[i]; r.addr <= addr && end <= r.addr+r.n {
			off := addr - r.addr
			return r.mem[off : off+n : off+n]
		}
	}
	return nil
}

// shmPeer is the copier's shared-memory state for one connection.
type shmPeer struct {
	mu    sync.Mutex
	table *mapped
	slots int
	segs  map[uint64]*mapped // nil entry: the segment could not be mapped
	maps  map[mapKey]*mapping
	asks  map[uint64]*mapAsk // by request ID
	byKey map[mapKey]*mapAsk
	err   error // the connection failed: map nothing more
}

// mapAsk is a tMap in flight and the transfers waiting for its answer.
type mapAsk struct {
	k    mapKey
	then []func(m *mapping, err error)
}

// maxMaps bounds the mappings a connection caches; past it the negative
// ones are forgotten.
const maxMaps = 8192

// mapping returns the cached mapping of k, referenced, or asks the peer
// for it (tMap) and arranges for then to run with the answer, on a
// goroutine of its own; asked then says so. A negative mapping is
// returned as such.
func (p *peer) mapping(k mapKey, then func(m *mapping, err error)) (m *mapping, asked bool, err error) {
	sp := &p.sh
	sp.mu.Lock()
	if sp.err != nil {
		err = sp.err
		sp.mu.Unlock()
		return nil, false, err
	}
	if m = sp.maps[k]; m != nil {
		m.refs.Add(1)
		sp.mu.Unlock()
		return m, false, nil
	}
	if a := sp.byKey[k]; a != nil {
		a.then = append(a.then, then)
		sp.mu.Unlock()
		return nil, true, nil
	}
	id := p.seq.Add(1)
	a := &mapAsk{k: k, then: []func(*mapping, error){then}}
	if sp.asks == nil {
		sp.asks, sp.byKey = map[uint64]*mapAsk{}, map[mapKey]*mapAsk{}
	}
	sp.asks[id], sp.byKey[k] = a, a
	sp.mu.Unlock()
	p.mu.Lock()
	p.asking++
	p.watch()
	p.mu.Unlock()
	p.send(&header{typ: tMap, status: uint8(k.acc), id: id, key: k.key}, nil, nil)
	return nil, true, nil
}

// answered hands a tMap's outcome to the transfers waiting for it.
func (p *peer) answered(a *mapAsk, m *mapping, err error) {
	p.mu.Lock()
	p.asking--
	p.watch()
	p.mu.Unlock()
	for _, then := range a.then {
		if m != nil {
			m.refs.Add(1)
		}
		go then(m, err)
	}
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
	return nil
}

// segment handles a tSeg: a segment the peer shares, mapped once. One
// that cannot be mapped (memory) is recorded: mappings naming it fall back
// to leases.
func (p *peer) segment(f *frame, rr *rightsReader) error {
	fd := rr.take()
	if fd < 0 {
		return fmt.Errorf("%w: segment %d came with no file descriptor", errProtocol, f.id)
	}
	defer unix.Close(fd)
	size := binary.LittleEndian.Uint64(f.payload)
	sp := &p.sh
	sp.mu.Lock()
	defer sp.mu.Unlock()
	if _, dup := sp.segs[f.id]; dup {
		return fmt.Errorf("%w: segment %d shared twice", errProtocol, f.id)
	}
	if len(sp.segs) >= maxShares {
		return fmt.Errorf("%w: more than %d segments shared on one connection", errLimit, maxShares)
	}
	if sp.err != nil {
		return nil
	}
	if sp.segs == nil {
		sp.segs = map[uint64]*mapped{}
	}
	mem, err := shm.Map(fd, size)
	if err != nil {
		if errors.Is(err, shm.ErrInvalid) {
			return fmt.Errorf("%w: segment %d: %w", errProtocol, f.id, err)
		}
		p.b.log.Warn("cma: could not map a peer's shared segment; leases serve it", "peer", p.id, "err", err)
		sp.segs[f.id] = nil
		return nil
	}
	m := &mapped{mem: mem}
	m.refs.Store(1)
	sp.segs[f.id] = m
	return nil
}

// segDrop handles a tSegDrop: the connection's reference on the segment
// goes; mappings naming it keep theirs.
func (p *peer) segDrop(id uint64) error {
	sp := &p.sh
	sp.mu.Lock()
	m, ok := sp.segs[id]
	delete(sp.segs, id)
	failed := sp.err != nil
	sp.mu.Unlock()
	if !ok {
		if failed {
			return nil
		}
		return fmt.Errorf("%w: drop of segment %d, which was not shared", errProtocol, id)
	}
	if m != nil {
		m.unref()
	}
	return nil
}

// unmap handles a tUnmap: the mapping is over; the cache forgets it.
func (p *peer) unmap(f *frame) {
	k := mapKey{key: f.key, acc: agent.Access(f.status)}
	sp := &p.sh
	sp.mu.Lock()
	m := sp.maps[k]
	if m != nil && !m.none && uint64(m.slot) == f.id {
		delete(sp.maps, k)
	} else {
		m = nil
	}
	sp.mu.Unlock()
	if m != nil {
		m.release()
	}
}

// mapped handles a tMapped (f): it builds the mapping from the answer,
// checked against the table and segments shared before it, caches it, and
// hands it to the transfers waiting.
func (p *peer) mappedAnswer(f *frame) error {
	sp := &p.sh
	sp.mu.Lock()
	a := sp.asks[f.id]
	if a == nil {
		failed := sp.err != nil
		sp.mu.Unlock()
		if failed {
			return nil
		}
		return fmt.Errorf("%w: a mapping answer to request %d, which awaits none", errProtocol, f.id)
	}
	delete(sp.asks, f.id)
	delete(sp.byKey, a.k)
	var m *mapping
	var err error
	switch f.status {
	case stOK:
		var berr error
		if m, berr = sp.build(a.k, f); berr != nil {
			// The connection fails: the failure answers a, as every
			// request still waiting (shmFail).
			sp.asks[f.id], sp.byKey[a.k] = a, a
			sp.mu.Unlock()
			return berr
		}
	case stNone:
		m = &mapping{k: a.k, none: true}
	case stLost:
		err = fmt.Errorf("cma: peer %s is closing: %w (%q)", p.id, agent.ErrRemoteLost, f.payload)
	default:
		err = fmt.Errorf("cma: peer %s refused: %w (%q)", p.id, agent.ErrAccessDenied, f.payload)
	}
	if m != nil {
		if len(sp.maps) >= maxMaps {
			for k, old := range sp.maps {
				if old.none {
					delete(sp.maps, k)
				}
			}
		}
		if old := sp.maps[a.k]; old != nil && !old.none {
			defer old.release() // answered afresh: the cache's reference goes
		}
		if sp.maps == nil {
			sp.maps = map[mapKey]*mapping{}
		}
		if len(sp.maps) < maxMaps {
			m.refs.Store(1) // the cache's
			sp.maps[a.k] = m
		} else {
			delete(sp.maps, a.k)
		}
	}
	sp.mu.Unlock()
	p.answered(a, m, err)
	return nil
}

// build makes the mapping a granted tMapped (f) describes. The caller
// holds sp.mu. An answer naming a slot outside the table, a segment never
// shared, or a range outside its segment breaks the protocol; one naming
// a segment that could not be mapped is a negative mapping.
func (sp *shmPeer) build(k mapKey, f *frame) (*mapping, error) {
	ans, err := getMapAnswer(f)
	if err != nil {
		return nil, err
	}
	if sp.table == nil || int(ans.slot) >= sp.slots {
		return nil, fmt.Errorf("%w: mapping answer %d names slot %d of a table of %d", errProtocol, f.id, ans.slot, sp.slots)
	}
	m := &mapping{k: k, slot: ans.slot, w: slotAt(sp.table.mem, int(ans.slot)), want: ans.gen<<2 | slotLive}
	m.regs = make([]shmReg, 0, len(ans.entries))
	used := map[uint64]*mapped{}
	for i, e := range ans.entries {
		seg, ok := sp.segs[e.seg]
		if !ok {
			return nil, fmt.Errorf("%w: mapping answer %d: entry %d names segment %d, never shared", errProtocol, f.id, i, e.seg)
		}
		if seg == nil {
			return &mapping{k: k, none: true}, nil
		}
		if e.off+e.n > uint64(len(seg.mem)) {
			return nil, fmt.Errorf("%w: mapping answer %d: entry %d, [%d, +%d) of segment %d of %d bytes", errProtocol, f.id, i, e.off, e.n, e.seg, len(seg.mem))
		}
		m.regs = append(m.regs, shmReg{addr: e.addr, n: e.n, mem: seg.mem[e.off : e.off+e.n : e.off+e.n]})
		used[e.seg] = seg
	}
	slices.SortFunc(m.regs, func(a, b shmReg) int { return cmp.Compare(a.addr, b.addr) })
	m.maxEnd = make([]uint64, len(m.regs))
	var end uint64
	for i, r := range m.regs {
		end = max(end, r.addr+r.n)
		m.maxEnd[i] = end
	}
	m.held = append(m.held, sp.table.ref())
	for _, seg := range used {
		m.held = append(m.held, seg.ref())
	}
	return m, nil
}

// shmFail ends the connection's shared-memory state: the transfers waiting
// for an answer fail with err, and the mappings are dropped (unmapped once
// the copies using them returned).
func (p *peer) shmFail(err error) {
	sp := &p.sh
	sp.mu.Lock()
	if sp.err != nil {
		sp.mu.Unlock()
		return
	}
	sp.err = err
	asks := sp.asks
	maps, segs, table := sp.maps, sp.segs, sp.table
	sp.asks, sp.byKey, sp.maps, sp.segs, sp.table = nil, nil, nil, nil, nil
	sp.mu.Unlock()
	for _, a := range asks {
		p.answered(a, nil, err)
	}
	for _, m := range maps {
		if !m.none {
			m.release()
		}
	}
	for _, s := range segs {
		if s != nil {
			s.unref()
		}
	}
	if table != nil {
		table.unref()
	}
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

// postShared moves x through mapping m (referenced for it), if every
// remote range lies in it: it reports false, m released, if one does not
// (leases then serve x). Small transfers are copied before it returns.
func (b *Backend) postShared(p *peer, x *agent.Work, m *mapping) bool {
	if len(x.Segments) == 1 { // the common small case: no allocation
		sg := &x.Segments[0]
		mem := m.find(sg.Remote.Addr, sg.Remote.Len)
		if mem == nil || uint64(len(sg.Local.Mem)) != sg.Remote.Len {
			m.release()
			return false
		}
		x.Via("shm")
		if sg.Remote.Len <= shmInline {
			b.finishShared(p, x, m, b.copyShared(p, x, m, []shmOp{{local: sg.Local.Mem, remote: mem}}, 1))
			return true
		}
	}
	ops := make([]shmOp, len(x.Segments))
	var total uint64
	for i := range x.Segments {
		sg := &x.Segments[i]
		mem := m.find(sg.Remote.Addr, sg.Remote.Len)
		if mem == nil || uint64(len(sg.Local.Mem)) != sg.Remote.Len {
			m.release()
			return false
		}
		ops[i] = shmOp{local: sg.Local.Mem, remote: mem}
		total += sg.Remote.Len
	}
	x.Via("shm")
	if total <= shmInline {
		b.finishShared(p, x, m, b.copyShared(p, x, m, ops, 1))
		return true
	}
	go func() { b.finishShared(p, x, m, b.copyShared(p, x, m, ops, b.cfg.workers)) }()
	return true
}

// finishShared ends a transfer moved through a mapping: its notification
// goes out (queued, one way), then it finishes.
func (b *Backend) finishShared(p *peer, x *agent.Work, m *mapping, err error) {
	m.release()
	if err == nil && x.Notify != nil {
		err = p.notify(x.Key, x.Notify)
	}
	x.Finish(err)
	b.xwg.Done()
}

// copyShared copies ops through m with up to workers goroutines (this one
// included), inside m's slot, and reports why it stopped early: the
// transfer was cancelled, the exposure revoked, or the peer lost (checked
// before each piece: a peer that died is no longer there to hear of it,
// even though its memory is still mapped here). The
// connection stays open while copies run (holdShared), since its end is
// what tells the exposing side that none does.
func (b *Backend) copyShared(p *peer, x *agent.Work, m *mapping, ops []shmOp, workers int) error {
	if err := p.holdShared(); err != nil {
		return err
	}
	defer p.unholdShared()
	write := x.Op == agent.OpWrite
	if workers <= 1 {
		if !m.w.enter(m.want) {
			return p.revoked(m)
		}
		for _, op := range ops {
			if write {
				copy(op.remote, op.local)
			} else {
				copy(op.local, op.remote)
			}
		}
		m.w.leave()
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
				m.w.leave()
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
				if !m.w.enter(m.want) {
					err := p.revoked(m)
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
			m.w.leave()
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

// revoked drops m from the cache, whose slot no longer holds it, and says
// why the copy stopped.
func (p *peer) revoked(m *mapping) error {
	sp := &p.sh
	sp.mu.Lock()
	if sp.maps[m.k] == m {
		delete(sp.maps, m.k)
		defer m.release()
	}
	sp.mu.Unlock()
	if atomic.LoadUint64(m.w.stamp) == m.want&^3|slotClosed {
		return fmt.Errorf("cma: peer %s is closing: %w", p.id, agent.ErrRemoteLost)
	}
	return fmt.Errorf("cma: peer %s: %w: exposure %v revoked", p.id, agent.ErrAccessDenied, m.k.key)
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

// postMapped tries the shared-memory path for x: it reports whether it
// took x (then x finishes there); otherwise leases serve it. On a mapping
// not yet known it asks the peer and takes x, which continues when the
// answer arrives, through a mapping or through leases (postLeases).
func (b *Backend) postMapped(p *peer, x *agent.Work) bool {
	k := mapKey{key: x.Key, acc: x.Op.Access()}
	var claimed atomic.Bool
	then := func(m *mapping, err error) {
		if !claimed.CompareAndSwap(false, true) {
			if m != nil {
				m.release()
			}
			return
		}
		switch {
		case err != nil:
			if m != nil {
				m.release()
			}
			x.Finish(err)
			b.xwg.Done()
		case m.none:
			m.release()
			if err := b.postLeases(p, x); err != nil {
				x.Finish(err)
			}
		default:
			if !b.postShared(p, x, m) {
				if err := b.postLeases(p, x); err != nil {
					x.Finish(err)
				}
			}
		}
	}
	m, asked, err := p.mapping(k, then)
	switch {
	case err != nil:
		return false // the peer failed: leases say so
	case asked:
		// The answer's arrival or the cancellation, whichever comes
		// first, finishes x; the other does nothing.
		x.AfterCancel(func() {
			if claimed.CompareAndSwap(false, true) {
				x.Finish(x.CancelErr())
				b.xwg.Done()
			}
		})
		return true
	case m.none:
		m.release()
		return false
	}
	return b.postShared(p, x, m)
}
