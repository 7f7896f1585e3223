//go:build ucx

package ucx

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"iter"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
)

// outPeer is the transferring side's connection to one remote agent: an
// endpoint to its worker, the leases requested on it, and the remote keys
// it granted, unpacked.
type outPeer struct {
	id    uuid.UUID
	raw   []byte // its connection information
	cid   cid    // this side's connection ID
	ep    endpoint
	epID  uint64
	ready bool // welcomed: remote is known
	// remote is the peer's connection ID, from its welcome.
	remote   cid
	failed   bool
	deadline time.Time // for the welcome
	lastRecv time.Time
	lastPing time.Time

	waiting []*xstate // posted before the welcome
	notes   []*note
	wins    map[uint64]*window
	// abandoned holds the lease requests of cancelled transfers that the
	// peer has not answered yet, by lease ID: the answer is dropped (a
	// grant released), and the deadline still holds.
	abandoned map[uint64]abandoned
	rkeys     map[uint64]*rkeyEntry // by the peer's registration ID
}

// abandoned is a lease request whose transfer was cancelled before the
// peer answered it.
type abandoned struct {
	deadline time.Time // for the answer, as the window's
	release  bool      // a grant holds a lease that this side must end
}

type rkeyEntry struct {
	k     uintptr
	users int // windows in flight using it
}

// xstate is one transfer: a part for requesting its leases (pump), held
// until the last is requested or the transfer failed, plus one per window
// requested or moving. The last part finishes the transfer. Only the
// progress thread touches it.
type xstate struct {
	agent.Parts
	l        *loop
	x        *agent.Work
	p        *outPeer
	write    bool
	next     cursor // first byte not yet leased
	inflight int    // windows requested or moving, at most leaseDepth
	pumped   bool   // every lease requested, or failed: pump's part is done

	// stopWatch unregisters the watch on cancellation (Work.AfterCancel)
	// once the transfer finished.
	stopWatch func() bool
	cancelled bool        // the cancellation was handled (loop.cancel)
	grace     *time.Timer // a cancelled transfer's bytes still moving: see loop.cancel
	over      bool        // finished: commands still naming it do nothing
}

// notify sends the transfer's notification once every lease is flushed,
// that is once the bytes are in place (agent.Parts calls it).
func (xs *xstate) notify(key agent.Key, msg []byte) error {
	if err := xs.l.sendNotify(xs.p, key, msg); err != nil {
		return xs.p.failure(err)
	}
	return nil
}

// finished runs after the transfer's Finish: the cancellation watch and
// timer go, and commands still queued for xs find it over.
func (xs *xstate) finished() {
	xs.over = true
	xs.l.xfers--
	if xs.stopWatch != nil {
		xs.stopWatch()
	}
	if xs.grace != nil {
		xs.grace.Stop()
	}
}

// window is one lease of a transfer: requested, granted, moved, flushed,
// released.
type window struct {
	id        uint64
	xs        *xstate
	start     cursor
	n         uint64
	pieces    int
	deadline  time.Time // for the grant
	granted   bool
	flushID   uint64
	rkeys     []*rkeyEntry
	locals    []*mapping
	flushOnly bool  // a flush of the shutdown, no window
	remotePut bool  // a READ the exposing side writes into this side's memory
	inline    bool  // the bytes travel in the open or the grant
	push      *held // the exposing side's write of a READ into a peer's memory
	pushPeer  *inPeer
	pushLease uint64
}

func (l *loop) allOuts() []*outPeer {
	var ps []*outPeer
	for _, p := range l.outCID {
		ps = append(ps, p)
	}
	return ps
}

// outFor returns the connection to the agent info describes, connecting
// if there is none. Connections are keyed by identity and worker address
// together: a token that claims a known agent's identity at another
// address gets a connection of its own and never redirects anyone else's
// transfers.
func (l *loop) outFor(info agent.Info) (*outPeer, error) {
	raw, _ := info.Conn(Name)
	for _, p := range l.outs[info.ID] {
		if bytes.Equal(p.raw, raw) {
			return p, nil
		}
	}
	ci, err := parseConnInfo(raw)
	if err != nil {
		return nil, fmt.Errorf("ucx: peer %s: %w", info.ID, err)
	}
	now := time.Now()
	p := &outPeer{id: info.ID, raw: bytes.Clone(raw), cid: newCID(), epID: l.next(), deadline: now.Add(l.b.cfg.timeout),
		wins: map[uint64]*window{}, abandoned: map[uint64]abandoned{}, rkeys: map[uint64]*rkeyEntry{}}
	p.ep, err = l.n.connect(ci.addr, p.epID)
	if err != nil {
		return nil, fmt.Errorf("ucx: connect to peer %s: %w: %w", info.ID, agent.ErrRemoteLost, err)
	}
	l.epErr[p.epID] = p
	l.outs[p.id] = append(l.outs[p.id], p)
	l.outCID[p.cid] = p
	b := l.frame(tHello, 0, 0, cid{})
	b = append(b, l.b.id[:]...)
	b = append(b, info.ID[:]...)
	b = append(b, p.cid[:]...)
	b = append(b, l.b.self.addr...)
	if err := l.send(p.ep, b); err != nil {
		l.failOut(p, fmt.Errorf("ucx: hello to peer %s: %w: %w", p.id, agent.ErrRemoteLost, err))
		return nil, p.failure(err)
	}
	return p, nil
}

func (p *outPeer) failure(err error) error {
	return fmt.Errorf("ucx: peer %s: %w: %w", p.id, agent.ErrRemoteLost, err)
}

func (l *loop) onWelcome(p *outPeer, m *msg) {
	if p.ready {
		l.badMessage()
		return
	}
	if m.from != p.id {
		l.b.stats.drop(&l.b.stats.handshake)
		l.b.host.Refused()
		l.failOut(p, fmt.Errorf("ucx: the worker of peer %s answers as agent %s: %w", p.id, m.from, agent.ErrRemoteLost))
		return
	}
	now := time.Now()
	p.ready, p.remote, p.lastRecv, p.lastPing = true, m.src, now, now
	waiting, notes := p.waiting, p.notes
	p.waiting, p.notes = nil, nil
	for _, n := range notes {
		l.sendNotify(p, n.key, n.msg)
	}
	for _, xs := range waiting {
		l.pump(xs)
	}
}

func (l *loop) startXfer(xs *xstate) {
	p, err := l.outFor(xs.x.Peer)
	if err != nil {
		xs.x.Finish(err)
		return
	}
	xs.l, xs.p = l, p
	xs.Init(xs.x, xs.notify, xs.finished)
	l.xfers++ // until finished
	// Watched for its whole life: pump and onGrant see a cancellation only
	// when a lease is requested or granted, and a peer may answer neither.
	b := l.b
	xs.stopWatch = xs.x.AfterCancel(func() { _ = b.submit(command{cancel: xs}) })
	if !p.ready {
		p.waiting = append(p.waiting, xs)
		return
	}
	l.pump(xs)
}

// pump requests the transfer's next leases, up to leaseDepth at a time.
// Once every lease is requested, or the transfer failed, it drops its own
// part: the transfer finishes when its last window ends.
func (l *loop) pump(xs *xstate) {
	if xs.pumped {
		return
	}
	x, p := xs.x, xs.p
	for !xs.Failed() && xs.inflight < leaseDepth && xs.next.Seg < len(x.Segments) {
		select {
		case <-x.Cancelled():
			xs.Fail(x.CancelErr())
			continue
		default:
		}
		end, n, pieces := agent.Span(x.Segments, xs.next, uint64(l.b.cfg.lease), l.b.cfg.maxRanges)
		w := &window{id: l.next(), xs: xs, start: xs.next, n: n, pieces: pieces, deadline: time.Now().Add(l.b.cfg.timeout)}
		xs.next = end
		w.inline = l.canInline(w)
		w.remotePut = !w.inline && !xs.write && !l.b.cfg.getReads
		var keys []byte
		if w.remotePut {
			var err error
			if keys, err = l.localKeys(w); err != nil {
				xs.Fail(err)
				continue
			}
		}
		p.wins[w.id] = w
		xs.inflight++
		xs.Add()
		b := l.frame(tOpen, uint8(x.Op.Access()), uint32(pieces), p.remote)
		b = binary.LittleEndian.AppendUint64(b, w.id)
		b = append(b, x.Key[:]...)
		for pc := range w.span() {
			b = binary.LittleEndian.AppendUint64(b, pc.RemoteAddr())
			b = binary.LittleEndian.AppendUint64(b, pc.Len)
		}
		if w.inline {
			b[3] = 2
			if xs.write {
				for pc := range w.span() {
					b = append(b, pc.Local()...)
				}
			}
		}
		if w.remotePut {
			b[3] = 1
			for pc := range w.span() {
				b = binary.LittleEndian.AppendUint64(b, pc.LocalAddr())
			}
			b = binary.LittleEndian.AppendUint32(b, uint32(len(w.locals)))
			b = append(b, keys...)
		}
		if err := l.send(p.ep, b); err != nil {
			l.failOut(p, p.failure(err)) // fails this transfer and pumps it
			return
		}
	}
	if xs.Failed() || xs.next.Seg >= len(x.Segments) {
		xs.pumped = true
		xs.Done(nil)
	}
}

// ended ends one window of xs, with err if it failed, and requests the
// transfer's next lease.
func (l *loop) ended(xs *xstate, err error) {
	xs.inflight--
	xs.Done(err)
	l.pump(xs)
}

// canInline reports whether w moves in the control messages: at most
// WithInlineSize bytes, host memory on both sides.
func (l *loop) canInline(w *window) bool {
	if w.n > uint64(l.b.cfg.inline) {
		return false
	}
	for pc := range w.span() {
		if loc := pc.Seg.Local; loc.Kind != agent.KindDRAM || pc.Seg.Remote.Kind != agent.KindDRAM || uint64(len(loc.Mem)) < pc.Off+pc.Len {
			return false
		}
	}
	return true
}

// localKeys maps the local memory of a READ window the exposing side will
// write into (registrations, or the segment mapped for the window alone),
// and returns the packed keys and per-piece key indices, as in a grant.
// The window holds the registrations until it is done.
func (l *loop) localKeys(w *window) ([]byte, error) {
	clear(l.seen)
	var keys, idx []byte
	var err error
	l.b.regMu.Lock()
	defer l.b.regMu.Unlock()
	for pc := range w.span() {
		loc := pc.Seg.Local
		mp := l.b.findLocked(loc.Region, pc.LocalAddr(), pc.Len)
		if mp == nil {
			if mp, err = l.b.mapLocked(loc.Addr, loc.Len, loc.Kind == agent.KindVRAM); err != nil {
				break
			}
			l.b.regs[regKey{loc.Addr, loc.Len}] = mp // found again by the next pieces
		}
		if mp.packed == nil {
			if mp.packed, err = l.n.pack(mp.memh); err != nil {
				break
			}
		}
		k, added := l.use(mp, &w.locals)
		if added {
			keys = appendKey(keys, mp)
		}
		idx = binary.LittleEndian.AppendUint16(idx, k)
	}
	// Lazy mappings are the window's alone: out of regs again.
	for _, mp := range w.locals {
		if !mp.registered {
			if k := (regKey{mp.addr, mp.len}); l.b.regs[k] == mp {
				delete(l.b.regs, k)
			}
		}
	}
	if err != nil {
		l.b.unuseLocked(w.locals)
		w.locals = nil
		return nil, fmt.Errorf("ucx: map local memory for a READ: %w", err)
	}
	return append(keys, idx...), nil
}

// span yields w's pieces, in order (agent.Pieces).
func (w *window) span() iter.Seq[agent.Piece] { return w.xs.x.Pieces(w.start, w.n) }

func (l *loop) sendNotify(p *outPeer, key agent.Key, msg []byte) error {
	b := l.frame(tNotify, 0, 0, p.remote)
	b = append(b, key[:]...)
	b = append(b, msg...)
	return l.send(p.ep, b)
}

// endLease tells the peer a lease is over.
func (l *loop) endLease(p *outPeer, id uint64) {
	if p.failed {
		return
	}
	b := l.frame(tRelease, 0, 0, p.remote)
	b = binary.LittleEndian.AppendUint64(b, id)
	_ = l.send(p.ep, b)
}

func (l *loop) onGrant(p *outPeer, m *msg) {
	w := p.wins[m.lease]
	if w == nil {
		if a, ok := p.abandoned[m.lease]; ok {
			// The answer to a request of a cancelled transfer, which
			// finished without it: no byte moves, a lease held is ended.
			delete(p.abandoned, m.lease)
			if a.release && m.status == stOK {
				l.endLease(p, m.lease)
			}
			return
		}
		l.badMessage()
		return
	}
	if w.granted {
		l.badMessage()
		return
	}
	xs := w.xs
	x := xs.x
	drop := func(err error, release bool) {
		l.doneWith(w)
		delete(p.wins, w.id)
		if release {
			l.endLease(p, w.id)
		}
		l.ended(xs, err)
	}
	if m.status != stOK {
		text := string(m.body)
		if m.status == stLost {
			drop(fmt.Errorf("ucx: peer %s is closing: %w (%q)", p.id, agent.ErrRemoteLost, text), false)
		} else {
			drop(fmt.Errorf("ucx: peer %s refused the %v: %w (%q)", p.id, x.Op, agent.ErrAccessDenied, text), false)
		}
		return
	}
	if w.inline { // the exposing side copied the bytes, and let go of the lease
		if m.count != 0 || (xs.write && len(m.body) != 0) || (!xs.write && uint64(len(m.body)) != w.n) {
			l.badMessage()
			drop(fmt.Errorf("ucx: %w: inline grant of %d bytes from peer %s for %d", errProtocol, len(m.body), p.id, w.n), false)
			return
		}
		if !xs.write {
			body := m.body
			for pc := range w.span() {
				body = body[copy(pc.Local(), body):]
			}
		}
		drop(nil, false)
		return
	}
	if w.remotePut { // the exposing side wrote the bytes, flushed, and let go of the lease
		if m.count != 0 || len(m.body) != 0 {
			l.badMessage()
		}
		drop(nil, false)
		return
	}
	if xs.Failed() {
		drop(nil, true)
		return
	}
	select {
	case <-x.Cancelled():
		drop(x.CancelErr(), true)
		return
	default:
	}
	var err error
	l.keys, l.idx, err = parseGrant(m.body, m.count, w.pieces, l.keys, l.idx)
	if err != nil {
		l.badMessage()
		drop(fmt.Errorf("ucx: grant from peer %s: %w", p.id, err), true)
		return
	}
	rk, err := unpackKeys(p.ep, p.rkeys, l.keys, &w.rkeys)
	if err != nil {
		drop(fmt.Errorf("ucx: remote key from peer %s: %w", p.id, err), true) // doneWith lets go of w.rkeys
		return
	}
	l.batch.reset()
	l.b.regMu.Lock()
	i := 0
	for pc := range w.span() {
		var mh uintptr
		if m := l.b.localLocked(pc.Seg.Local.Addr, pc.Seg.Local.Len); m != nil && m.memh != nil {
			if len(w.locals) == 0 || w.locals[len(w.locals)-1] != m {
				m.users++
				w.locals = append(w.locals, m)
			}
			mh = memhPtr(m.memh)
		}
		l.batch.add(pc.LocalAddr(), pc.RemoteAddr(), pc.Len, rk[l.idx[i]], mh)
		i++
	}
	l.b.regMu.Unlock()
	w.granted = true
	w.flushID = l.next()
	l.ops[w.flushID] = w
	if err := l.n.rma(p.ep, xs.write, &l.batch, w.flushID); err != nil {
		xs.Fail(p.failure(err)) // the flush's event still comes
	}
}

// unpackKeys returns the remote keys of a grant's keys, unpacked on ep or
// found in cache (a connection's, by the peer's registration ID; unused
// ones are dropped beyond maxRkeys). Each one returned, and each one
// unpacked before a failure, is counted in used, which the caller lets go
// of when done with them.
func unpackKeys(ep endpoint, cache map[uint64]*rkeyEntry, keys []grantKey, used *[]*rkeyEntry) ([]uintptr, error) {
	rk := make([]uintptr, len(keys))
	for i, k := range keys {
		e := cache[k.reg]
		if e == nil {
			h, err := unpack(ep, k.packed)
			if err != nil {
				return nil, err
			}
			e = &rkeyEntry{k: h}
			cache[k.reg] = e
		}
		e.users++
		*used = append(*used, e)
		rk[i] = e.k
	}
	if len(cache) > maxRkeys {
		for id, e := range cache {
			if e.users == 0 {
				destroyRkey(e.k)
				delete(cache, id)
			}
		}
	}
	return rk, nil
}

// use returns mp's index in *maps, the mappings a lease or window holds,
// adding it (one more user) if it is not there yet, and whether it did.
// l.seen indexes *maps: the caller clears it for each lease or window, and
// holds regMu.
func (l *loop) use(mp *mapping, maps *[]*mapping) (k uint16, added bool) {
	if k, ok := l.seen[mp]; ok {
		return k, false
	}
	k = uint16(len(*maps))
	l.seen[mp] = k
	mp.users++
	*maps = append(*maps, mp)
	return k, true
}

// appendKey appends mp's entry of a grant's key table: registration ID,
// packed key length and packed key.
func appendKey(b []byte, mp *mapping) []byte {
	b = binary.LittleEndian.AppendUint64(b, mp.id)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(mp.packed)))
	return append(b, mp.packed...)
}

// flushed runs when a window's operations have all completed, or failed.
func (l *loop) flushed(w *window, err error) {
	if w.flushOnly {
		return
	}
	if w.push != nil {
		l.pushed(w, err)
		return
	}
	xs := w.xs
	p := xs.p
	l.doneWith(w)
	delete(p.wins, w.id)
	l.endLease(p, w.id)
	if err != nil {
		err = fmt.Errorf("ucx: %v of %d bytes with peer %s: %w: %w", xs.x.Op, w.n, p.id, agent.ErrRemoteLost, err)
	}
	l.ended(xs, err)
}

// doneWith lets go of the remote keys and registrations w used.
func (l *loop) doneWith(w *window) {
	unuseKeys(w.rkeys)
	w.rkeys = nil
	l.b.unuse(w.locals)
	w.locals = nil
}

// unuseKeys lets go of remote keys: each has one user less.
func unuseKeys(keys []*rkeyEntry) {
	for _, e := range keys {
		e.users--
	}
}

// failOut fails p once: transfers waiting for it fail, its endpoint is
// force-closed, and the next transfer connects afresh. Lease requests
// unanswered end at once. Windows whose operations are in flight finish
// when their flush fails or, at the latest, when the endpoint is closed;
// so do READs the peer writes into this side's memory (remotePut): until
// the endpoint is closed, its writes may still land.
//
// An outgoing channel presents no key to this agent, so its failure is no
// loss for this agent's exposures: only the channels a peer used to reach
// them report that (agent.Link).
func (l *loop) failOut(p *outPeer, err error) {
	if p.failed {
		return
	}
	p.failed, p.ready = true, false
	l.logDrop("ucx: dropped a connection", p.id, err)
	delete(l.outCID, p.cid)
	if ps := l.outs[p.id]; len(ps) > 0 {
		ps = slices.DeleteFunc(ps, func(q *outPeer) bool { return q == p })
		if len(ps) == 0 {
			delete(l.outs, p.id)
		} else {
			l.outs[p.id] = ps
		}
	}
	var ended []*xstate // one entry per window ended
	for id, w := range p.wins {
		w.xs.Fail(err)
		if !w.granted && !w.remotePut {
			l.doneWith(w)
			delete(p.wins, id)
			ended = append(ended, w.xs)
		}
	}
	waiting := p.waiting
	for _, xs := range waiting {
		xs.Fail(err)
	}
	p.waiting, p.notes = nil, nil
	l.dying = append(l.dying, p)
	l.closeEP(p.ep, p.epID, true)
	for _, xs := range ended {
		l.ended(xs, nil)
	}
	for _, xs := range waiting {
		l.pump(xs)
	}
}

// buried runs once p's endpoint is closed: no operation of it can touch
// memory any more.
func (l *loop) buried(p *outPeer) {
	l.dying = slices.DeleteFunc(l.dying, func(q *outPeer) bool { return q == p })
	for id, w := range p.wins {
		delete(p.wins, id)
		delete(l.ops, w.flushID)
		l.doneWith(w)
		l.ended(w.xs, p.failure(fmt.Errorf("endpoint closed")))
	}
	for id, e := range p.rkeys {
		destroyRkey(e.k)
		delete(p.rkeys, id)
	}
}

// cancelGrace is how long a cancelled transfer's bytes in flight may keep
// moving before the connection they move on is dropped to stop them:
// a quarter of WithTimeout, at most half a second.
func (c *config) cancelGrace() time.Duration { return min(c.timeout/4, 500*time.Millisecond) }

// cancel handles xs's cancellation (Work.AfterCancel), on the progress
// thread, so that xs finishes promptly with its CancelErr even if the peer
// answers nothing. Its lease requests still unanswered are abandoned, and
// end at once: until a grant, no byte of local memory is touched, and the
// answer, when it comes, is dropped (a grant's lease released). Windows
// whose bytes are moving (puts or gets in flight, or a READ the exposing
// side writes into this side's memory) end when they do; if they still
// move after cancelGrace, the connection is dropped (failOut), and they
// end once its endpoint is closed: no byte lands after Finish.
func (l *loop) cancel(xs *xstate) {
	if xs.over || xs.cancelled {
		return
	}
	xs.cancelled = true
	p := xs.p
	xs.Fail(xs.x.CancelErr())
	if i := slices.Index(p.waiting, xs); i >= 0 { // no window yet
		p.waiting = slices.Delete(p.waiting, i, i+1)
		l.pump(xs)
		return
	}
	if p.failed {
		return // its windows end when the endpoint is closed
	}
	var ended, moving int
	for id, w := range p.wins {
		if w.xs != xs {
			continue
		}
		if w.granted || w.remotePut {
			moving++
			continue
		}
		l.doneWith(w)
		delete(p.wins, id)
		p.abandoned[id] = abandoned{deadline: w.deadline, release: !w.inline}
		ended++
	}
	if moving > 0 {
		b := l.b
		xs.grace = time.AfterFunc(b.cfg.cancelGrace(), func() { _ = b.submit(command{overdue: xs}) })
	}
	for range ended {
		l.ended(xs, nil) // pumps: its part goes with the last
	}
	if ended == 0 {
		l.pump(xs)
	}
}

// overdue runs cancelGrace after xs's cancellation: if its bytes still
// move, the connection is dropped, which stops them.
func (l *loop) overdue(xs *xstate) {
	if xs.over || xs.p.failed {
		return
	}
	l.failOut(xs.p, fmt.Errorf("ucx: connection to peer %s dropped: a cancelled %v still moved bytes %v later: %w",
		xs.p.id, xs.x.Op, l.b.cfg.cancelGrace(), agent.ErrRemoteLost))
}
