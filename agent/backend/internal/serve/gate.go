package serve

import (
	"errors"
	"io"
	"sync"
)

// ErrEvicted is what a backend's handshake returns when its connection was
// closed to make room for another (Pass.Done reported false). The eviction
// was counted by whoever called Gate.Enter, so a connection that ends with
// it is counted no further.
var ErrEvicted = errors.New("handshake closed to make room for another")

// Gate bounds the connections in their handshake at once. A connection
// enters when it is accepted and leaves when its handshake arrived, or
// failed; when one enters a full gate, the one that entered first and is
// still inside is closed to make room (evicted). A legitimate handshake
// takes one round trip, so the oldest is the likeliest to be a slow-loris,
// and a flood of connections that never handshake holds at most the
// gate's size of them without locking honest peers out.
//
// Create one with NewGate. Safe for concurrent use; Enter, Pass.Done and Len
// take O(1) time.
type Gate struct {
	limit int

	mu         sync.Mutex
	head, tail *Pass // inside, oldest first
	n          int
}

// NewGate returns a gate that holds at most limit connections; limit must
// be at least 1.
func NewGate(limit int) *Gate {
	if limit < 1 {
		panic("serve: a Gate must hold at least one connection")
	}
	return &Gate{limit: limit}
}

// Max returns how many connections the gate holds at most.
func (g *Gate) Max() int { return g.limit }

// Len returns how many connections are inside: at most Max.
func (g *Gate) Len() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.n
}

// Pass is one connection's passage through a Gate.
type Pass struct {
	g          *Gate
	c          io.Closer
	prev, next *Pass
	state      uint8 // under g.mu
}

const (
	inside = iota
	left
	evicted
)

// Enter lets c into the gate and returns its pass. If the gate was full, the
// oldest connection inside is evicted, which Enter reports: its pass's Done
// returns false from then on, and its Close is called, after Enter released
// the gate's lock, and possibly while its owner closes it too (as a net.Conn
// allows). The eviction is the caller's to count (Counters.Drop with
// LimitRejected, in both backends) and to report (agent.Host.Refused). The
// connection that enters is never the one evicted.
//
// A listening side admits connections with Set.Admit instead, which enters
// the gate only while its Set is not stopped: a backend that is closing
// must not evict, nor count, anything.
func (g *Gate) Enter(c io.Closer) (p *Pass, evictedOne bool) {
	p, victim := g.enter(c)
	if victim != nil {
		_ = victim.Close()
	}
	return p, victim != nil
}

// enter lets c in and returns its pass, and the connection it evicted to
// make room, if any, which the caller closes once it holds no lock.
func (g *Gate) enter(c io.Closer) (p *Pass, victim io.Closer) {
	p = &Pass{g: g, c: c}
	g.mu.Lock()
	defer g.mu.Unlock()
	p.prev = g.tail
	if g.tail != nil {
		g.tail.next = p
	} else {
		g.head = p
	}
	g.tail = p
	g.n++
	if g.n > g.limit {
		v := g.head
		g.unlink(v)
		v.state = evicted
		victim = v.c
	}
	return p, victim
}

// unlink removes p, which is inside, from the list. The caller holds g.mu.
func (g *Gate) unlink(p *Pass) {
	if p.prev != nil {
		p.prev.next = p.next
	} else {
		g.head = p.next
	}
	if p.next != nil {
		p.next.prev = p.prev
	} else {
		g.tail = p.prev
	}
	p.prev, p.next = nil, nil
	g.n--
}

// Done takes p's connection out of the gate, if it is still inside, and
// reports whether it may go on: false if it was evicted, in which case it
// was closed (or is being closed) by the gate and the caller should end it
// with ErrEvicted, uncounted. Call it once the handshake arrived or failed;
// calling it again (say, deferred as well) is harmless and reports the same.
func (p *Pass) Done() bool {
	g := p.g
	g.mu.Lock()
	defer g.mu.Unlock()
	switch p.state {
	case inside:
		g.unlink(p)
		p.state = left
		return true
	case left:
		return true
	default:
		return false
	}
}
