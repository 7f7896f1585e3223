//go:build ucx

package ucx

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
)

// maxInPeers bounds the connections this agent accepts at once.
const maxInPeers = 4096

// inPeer is the exposing side of one connection: an endpoint back to the
// transferring agent, for answers, and the leases it holds.
type inPeer struct {
	cid      cid        // this side's connection ID
	remote   cid        // the transferring side's
	peer     uuid.UUID  // the agent, as its hello named itself
	link     agent.Link // this endpoint, as the agent sees it
	ep       endpoint
	epID     uint64
	leases   map[uint64]*held
	rkeys    map[uint64]*rkeyEntry // the reader's keys, for READs pushed to it
	used     bool                  // it opened a lease or notified: its loss is reported
	failed   bool
	lastRecv time.Time
}

// held is a granted lease and the registrations its keys unlock.
type held struct {
	l       agent.Lease
	maps    []*mapping
	rkeys   []*rkeyEntry
	pushing bool // its bytes are being written to the reader
}

// onHello accepts a connection: it connects back to the worker address
// the hello names and answers with this side's connection ID.
func (l *loop) onHello(m *msg) {
	switch {
	case l.closing:
		l.b.host.Refused()
		return
	case m.peer != l.b.id || m.from == uuid.Nil:
		l.refuseHello(m, &l.b.stats.handshake, fmt.Errorf("%w: hello for agent %s", errProtocol, m.peer))
		return
	case len(l.ins) >= maxInPeers:
		l.refuseHello(m, &l.b.stats.limit, fmt.Errorf("%w: %d connections held, at most %d", errLimit, len(l.ins), maxInPeers))
		return
	}
	p := &inPeer{cid: newCID(), remote: m.src, peer: m.from, link: agent.NewLink(m.from), epID: l.next(), leases: map[uint64]*held{}, rkeys: map[uint64]*rkeyEntry{}, lastRecv: time.Now()}
	var err error
	if p.ep, err = l.n.connect(m.addr, p.epID); err != nil {
		l.refuseHello(m, &l.b.stats.handshake, fmt.Errorf("connect to the worker address of the hello: %w", err))
		return
	}
	l.epErr[p.epID] = p
	l.ins[p.cid] = p
	b := l.frame(tWelcome, stOK, 0, p.remote)
	b = append(b, p.cid[:]...)
	b = append(b, l.b.id[:]...)
	_ = l.send(p.ep, b)
}

// refuseHello counts a connection request refused on its peer's account,
// in kind, and logs why.
func (l *loop) refuseHello(m *msg, kind *atomic.Uint64, why error) {
	l.b.stats.drop(kind)
	l.b.host.Refused()
	l.logDrop("ucx: refused a connection request", m.from, why)
}

// onOpen grants or refuses one lease: the key, the access kind and every
// range are checked, and a lease is granted for all of them or none. The
// grant carries the packed remote keys of the registrations holding the
// ranges.
func (l *loop) onOpen(p *inPeer, m *msg) {
	p.used = true
	if _, dup := p.leases[m.lease]; dup || len(p.leases) >= maxLeases {
		if dup {
			l.b.stats.drop(&l.b.stats.protocol)
		} else {
			l.b.stats.drop(&l.b.stats.limit)
		}
		l.b.host.Refused()
		l.failIn(p, fmt.Errorf("%w: lease %d requested twice, or more than %d leases held", errProtocol, m.lease, maxLeases), true)
		return
	}
	lease, err := l.b.host.Open(p.link, m.key, agent.Access(m.status))
	if errors.Is(err, agent.ErrRemoteLost) {
		l.refuse(p, m.lease, stLost, err) // this agent is closing
		return
	}
	if err != nil {
		l.refuse(p, m.lease, stDenied, err)
		return
	}
	h := &held{l: lease}
	l.leases++
	if m.inline {
		l.inlineOpen(p, m, h)
		return
	}
	b := l.frame(tGrant, stOK, 0, p.remote)
	b = binary.LittleEndian.AppendUint64(b, m.lease)
	clear(l.seen)
	l.idx = l.idx[:0]
	l.b.regMu.Lock()
	for i := range int(m.count) {
		addr, n := m.rangeAt(i)
		mem, err := h.l.Slice(addr, n)
		if err == nil && mem == nil && !l.b.cuda {
			// Exposed GPU memory (Slice has no bytes for it): without
			// CUDA, UCX would treat the address as host memory.
			err = fmt.Errorf("%w: [0x%x, +%d) is GPU memory, which this side's UCX cannot reach (built without CUDA)", agent.ErrAccessDenied, addr, n)
		}
		var mp *mapping
		if err == nil {
			region, _ := h.l.Region(addr, n)
			if mp = l.b.findLocked(region, addr, n); mp == nil {
				// Exposed but not registered: map it for this lease.
				mp, err = l.b.mapLocked(region.Addr, region.Len, region.Kind == agent.KindVRAM)
			}
		}
		if err == nil && mp.packed == nil && !m.push {
			mp.packed, err = l.n.pack(mp.memh)
			if err == nil && len(mp.packed) > maxRkey {
				err = fmt.Errorf("ucx: packed remote key of %d bytes", len(mp.packed))
			}
		}
		if err != nil {
			l.b.regMu.Unlock()
			l.release(h)
			l.refuse(p, m.lease, stDenied, fmt.Errorf("range %d: %w", i, err))
			return
		}
		k, added := l.use(mp, &h.maps)
		if added && !m.push {
			b = appendKey(b, mp)
		}
		l.idx = append(l.idx, k)
	}
	l.b.regMu.Unlock()
	if m.push {
		l.push(p, m, h)
		return
	}
	for _, k := range l.idx {
		b = binary.LittleEndian.AppendUint16(b, k)
	}
	binary.LittleEndian.PutUint32(b[4:], uint32(len(h.maps)))
	p.leases[m.lease] = h
	_ = l.send(p.ep, b)
}

// inlineOpen serves an inline open: every range is checked first, then a
// WRITE's bytes are copied in, or a READ's copied into the grant, and the
// lease ends before the answer goes out. No remote key is handed out.
func (l *loop) inlineOpen(p *inPeer, m *msg, h *held) {
	l.mems = l.mems[:0]
	for i := range int(m.count) {
		addr, n := m.rangeAt(i)
		mem, err := h.l.Slice(addr, n)
		if err == nil && mem == nil {
			err = fmt.Errorf("%w: device memory moves by RMA only", agent.ErrAccessDenied)
		}
		if err != nil {
			clear(l.mems)
			l.release(h)
			l.refuse(p, m.lease, stDenied, fmt.Errorf("range %d: %w", i, err))
			return
		}
		l.mems = append(l.mems, mem)
	}
	b := l.frame(tGrant, stOK, 0, p.remote)
	b = binary.LittleEndian.AppendUint64(b, m.lease)
	data := m.data
	write := agent.Access(m.status) == agent.AccessWrite
	for i, mem := range l.mems {
		if write {
			data = data[copy(mem, data):]
		} else {
			b = append(b, mem...)
		}
		l.mems[i] = nil
	}
	l.release(h)
	_ = l.send(p.ep, b)
}

// push writes the ranges of a granted READ into the reader's memory: its
// keys are unpacked on the connection's endpoint (and kept), the puts and
// a flush posted; pushed answers once the flush completes.
func (l *loop) push(p *inPeer, m *msg, h *held) {
	src := l.idx // the exposing side's mapping per range, by index into h.maps
	local := make([]uint64, len(src))
	for i, k := range src {
		local[i] = memhPtr64(h.maps[k])
	}
	var err error
	l.keys, l.idx, err = parseGrant(m.keys, m.nkeys, int(m.count), l.keys, l.idx)
	if err != nil || len(m.local) != 8*int(m.count) {
		l.b.stats.drop(&l.b.stats.protocol)
		l.b.host.Refused()
		l.release(h)
		if err == nil {
			err = fmt.Errorf("%w: %d local addresses for %d ranges", errProtocol, len(m.local)/8, m.count)
		}
		l.failIn(p, fmt.Errorf("push open: %w", err), true)
		return
	}
	rk, err := unpackKeys(p.ep, p.rkeys, l.keys, &h.rkeys)
	if err != nil {
		l.release(h) // and h.rkeys
		l.refuse(p, m.lease, stDenied, fmt.Errorf("the reader's key: %w", err))
		return
	}
	l.batch.reset()
	for i := range int(m.count) {
		addr, n := m.rangeAt(i)
		l.batch.add(addr, m.localAt(i), n, rk[l.idx[i]], uintptr(local[i]))
	}
	h.pushing = true
	p.leases[m.lease] = h
	w := &window{push: h, pushPeer: p, pushLease: m.lease, flushID: l.next()}
	l.ops[w.flushID] = w
	_ = l.n.rma(p.ep, true, &l.batch, w.flushID) // its failure shows in the flush
}

// pushed answers a pushed READ once its bytes are in the reader's memory,
// or failed to get there, and ends its lease.
func (l *loop) pushed(w *window, err error) {
	p, h := w.pushPeer, w.push
	h.pushing = false
	if !p.failed {
		if err != nil {
			l.refuse(p, w.pushLease, stLost, fmt.Errorf("writing the READ: %w", err))
		} else {
			_ = l.send(p.ep, binary.LittleEndian.AppendUint64(l.frame(tGrant, stOK, 0, p.remote), w.pushLease))
		}
	}
	if p.leases[w.pushLease] == h {
		delete(p.leases, w.pushLease)
	}
	l.release(h)
}

func (l *loop) refuse(p *inPeer, id uint64, st uint8, why error) {
	if st == stDenied {
		l.b.stats.denied.Add(1)
	}
	text := why.Error()
	if len(text) > maxErrMsg {
		text = text[:maxErrMsg]
	}
	b := l.frame(tGrant, st, 0, p.remote)
	b = binary.LittleEndian.AppendUint64(b, id)
	b = append(b, text...)
	_ = l.send(p.ep, b)
}

func (l *loop) onRelease(p *inPeer, id uint64) {
	if h := p.leases[id]; h != nil {
		delete(p.leases, id)
		l.release(h)
	}
}

// release ends a lease: revocation of its exposure may proceed, and
// registrations deregistered meanwhile, or mapped for it alone, are
// unmapped.
func (l *loop) release(h *held) {
	h.l.Release()
	l.leases--
	unuseKeys(h.rkeys)
	h.rkeys = nil
	l.b.unuse(h.maps)
	h.maps = nil
}

// failIn drops a connection: the leases it holds are released (a peer gone
// mid-transfer touches nothing more once its endpoint is closed) and, if
// report and it was used, exposures bound to the peer hear of it.
func (l *loop) failIn(p *inPeer, err error, report bool) {
	if p.failed {
		return
	}
	p.failed = true
	l.logDrop("ucx: dropped a connection", p.peer, err)
	delete(l.ins, p.cid)
	for id, h := range p.leases {
		if !h.pushing { // pushing: released when its flush fails, or the endpoint is gone
			delete(p.leases, id)
			l.release(h)
		}
	}
	l.dyingIn = append(l.dyingIn, p)
	l.closeEP(p.ep, p.epID, true)
	if report && p.used {
		l.b.host.LinkLost(p.link, err)
	}
}

// buriedIn runs once p's endpoint is closed: no write of it can read
// exposed memory any more.
func (l *loop) buriedIn(p *inPeer) {
	l.dyingIn = slices.DeleteFunc(l.dyingIn, func(q *inPeer) bool { return q == p })
	for id, h := range p.leases {
		delete(p.leases, id)
		for fid, w := range l.ops {
			if w.push == h {
				delete(l.ops, fid)
			}
		}
		h.pushing = false
		l.release(h)
	}
	for id, e := range p.rkeys {
		destroyRkey(e.k)
		delete(p.rkeys, id)
	}
}

func memhPtr64(m *mapping) uint64 {
	if m.memh == nil {
		return 0
	}
	return uint64(memhPtr(m.memh))
}
