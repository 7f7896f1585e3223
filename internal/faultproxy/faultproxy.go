// Package faultproxy is a TCP proxy for tests that injects network faults
// between the clients that dial it and one upstream server: latency with
// jitter, bandwidth limits, stalls, resets, refused connections, and
// half-open or half-closed connections. Faults are switched at run time,
// per direction where that matters, and apply at once to the connections
// already open as well as to new ones.
//
//	p, err := faultproxy.New(upstreamAddr) // listens on 127.0.0.1:0
//	if err != nil { ... }
//	defer p.Close()
//	dial(p.Addr())                         // instead of upstreamAddr
//	p.Stall(faultproxy.Both)               // a partition: nothing moves
//	p.Heal()                               // every fault lifted
//
// The proxy never corrupts, reorders, duplicates or silently drops bytes of
// a connection that carries on: TCP's checksums and sequence numbers mean
// no real network does that to a stream, so a test that did would prove
// nothing. What a network can do to a stream, it does: delay it, slow it,
// stop it (the bytes wait, as TCP retransmission would make them), end it
// with a reset, end one direction, or lose one end entirely (a crashed host
// behind a silent network).
//
// Every goroutine belongs to the Proxy; Close stops and joins them all.
package faultproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Direction names the flow of bytes a fault applies to.
type Direction uint8

const (
	// Upstream is the bytes clients send towards the upstream server.
	Upstream Direction = 1 << iota
	// Downstream is the bytes the upstream server sends back to clients.
	Downstream
	// Both directions.
	Both = Upstream | Downstream
)

// String returns "upstream", "downstream" or "both".
func (d Direction) String() string {
	switch d {
	case Upstream:
		return "upstream"
	case Downstream:
		return "downstream"
	case Both:
		return "both"
	}
	return fmt.Sprintf("Direction(%d)", uint8(d))
}

// End names one of the two connections the proxy holds for each client.
type End uint8

const (
	// Client is the connection from the client that dialled the proxy.
	Client End = iota
	// Server is the proxy's connection to the upstream server.
	Server
)

// String returns "client" or "server".
func (e End) String() string {
	if e == Client {
		return "client"
	}
	return "server"
}

// Tunables of the forwarding path.
const (
	chunkSize = 32 << 10 // bytes read at once
	queueLen  = 32       // chunks buffered per direction of a connection
	// dialTimeout bounds the dial of the upstream server for one client.
	dialTimeout = 5 * time.Second
	// paceQuantum is the time one write of a rate-limited direction covers:
	// bandwidth limits are smooth at this granularity.
	paceQuantum = 20 * time.Millisecond
)

// Stats counts what a Proxy has done since New.
type Stats struct {
	Accepted   int   // client connections accepted and proxied
	Refused    int   // client connections reset on arrival (Refuse, no upstream, upstream dial failed)
	Resets     int   // connections reset by Reset
	HalfOpened int   // connections made half-open by HalfOpen
	HalfClosed int   // directions of connections closed by HalfClose
	Open       int   // connections open now
	Upstream   int64 // bytes forwarded towards the upstream server
	Downstream int64 // bytes forwarded back to clients
}

// faults are the faults of one direction.
type faults struct {
	latency, jitter time.Duration
	rate            int64 // bytes per second; 0: unlimited
	stall           bool
}

// trigger is a function armed by When.
type trigger struct {
	at int64 // fires when the bytes forwarded would pass this
	f  func()
	id *byte // identity, for disarming
}

// Proxy forwards TCP connections from its listening address to an upstream
// address, injecting the faults it is told to. Create one with New and
// Close it. All methods are safe for concurrent use, and may be called from
// a function armed with When.
type Proxy struct {
	ln     net.Listener
	ctx    context.Context // cancelled by Close: ends upstream dials
	cancel context.CancelFunc
	wg     sync.WaitGroup

	fwd    [2]atomic.Int64 // bytes forwarded, by direction index
	armed  [2]atomic.Int64 // lowest trigger threshold per direction, or MaxInt64
	pacers [2]pacer

	mu       sync.Mutex
	closed   bool
	upstream string
	faults   [2]faults
	refuse   bool
	changed  chan struct{} // closed and replaced whenever faults change
	links    map[*link]struct{}
	triggers [2][]trigger
	stats    Stats
}

// dirIndex maps a single direction to 0 (Upstream) or 1 (Downstream).
func dirIndex(d Direction) int {
	if d == Downstream {
		return 1
	}
	return 0
}

// each calls f for each single direction in d.
func each(d Direction, f func(i int)) {
	if d&Upstream != 0 {
		f(0)
	}
	if d&Downstream != 0 {
		f(1)
	}
}

// New starts a Proxy listening on 127.0.0.1 on a free port, forwarding to
// upstream (host:port). upstream may be empty and set later with
// SetUpstream, for a server that must learn the proxy's address before it
// starts; until then clients are reset on arrival.
func New(upstream string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("faultproxy: listen: %w", err)
	}
	p := &Proxy{ln: ln, upstream: upstream, changed: make(chan struct{}), links: make(map[*link]struct{})}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	for i := range p.armed {
		p.armed[i].Store(math.MaxInt64)
	}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr returns the address clients dial, host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// SetUpstream sets the address that connections accepted from now on are
// forwarded to. Connections already open keep theirs.
func (p *Proxy) SetUpstream(addr string) {
	p.mu.Lock()
	p.upstream = addr
	p.mu.Unlock()
}

// changeLocked wakes every forwarding goroutine waiting on the faults; p.mu
// is held.
func (p *Proxy) changeLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// Latency delays every byte forwarded in dir by d, plus or minus a uniform
// random jitter of at most jitter, never reordering bytes: a chunk is never
// delivered before the one read before it. d = 0 and jitter = 0 remove the
// delay. Throughput under latency is bounded by what the proxy buffers per
// connection and direction (1 MiB) per d, as a real network's window bounds
// it.
func (p *Proxy) Latency(dir Direction, d, jitter time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	each(dir, func(i int) { p.faults[i].latency, p.faults[i].jitter = max(d, 0), max(jitter, 0) })
	p.changeLocked()
}

// Bandwidth limits the bytes forwarded in dir, over all connections
// together as over one link, to bytesPerSecond; 0 (or less) removes the
// limit.
func (p *Proxy) Bandwidth(dir Direction, bytesPerSecond int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	each(dir, func(i int) {
		p.faults[i].rate = max(bytesPerSecond, 0)
		p.pacers[i].reset()
	})
	p.changeLocked()
}

// Stall stops forwarding in dir, on every connection open now and every
// new one, keeping the connections open: the bytes wait in the proxy (and,
// once its buffers are full, in the senders' sockets, whose writes then
// block), as they would behind a partition that TCP retransmission bridges
// when it heals. Resume or Heal lets them through, in order. A client
// dialling a stalled proxy connects, but its first exchange goes nowhere.
func (p *Proxy) Stall(dir Direction) {
	p.mu.Lock()
	defer p.mu.Unlock()
	each(dir, func(i int) { p.faults[i].stall = true })
	p.changeLocked()
}

// Resume lifts a Stall of dir.
func (p *Proxy) Resume(dir Direction) {
	p.mu.Lock()
	defer p.mu.Unlock()
	each(dir, func(i int) { p.faults[i].stall = false })
	p.changeLocked()
}

// Refuse makes the proxy reset every new client connection on arrival (on)
// or proxy them again (off). The dialler's connect fails with a reset, or
// succeeds (the kernel completes it before the proxy sees it) and its first
// read or write fails with one: as close to "connection refused" as a
// listener that keeps its port can get. Connections open now are not affected.
func (p *Proxy) Refuse(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refuse = on
}

// Heal lifts every latency, bandwidth limit, stall and refusal. Connections
// made half-open or half-closed stay so: like a crashed host's, they are
// broken for good, and their endpoints must notice.
func (p *Proxy) Heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := range p.faults {
		p.faults[i] = faults{}
		p.pacers[i].reset()
	}
	p.refuse = false
	p.changeLocked()
}

// Reset closes every connection open now, both ends, with a TCP reset (RST,
// SO_LINGER 0), and returns how many it closed. Bytes buffered in the proxy
// are lost with them, as they would be on a host that reset the
// connection. New connections are proxied as usual.
func (p *Proxy) Reset() int {
	links := p.openLinks()
	for _, l := range links {
		l.kill(true)
	}
	p.mu.Lock()
	p.stats.Resets += len(links)
	p.mu.Unlock()
	return len(links)
}

// HalfOpen makes every connection open now half-open, and returns how many:
// the drop end's connection is reset, and the other end's stays open but
// hears nothing more (no bytes, no FIN, no RST), while what it sends is
// read and discarded, as when a host crashes behind a network that stays
// silent. HalfOpen(Server) leaves clients talking to a dead server;
// HalfOpen(Client) leaves the server with dead clients. The surviving end
// is closed when its owner closes it, or by Close.
func (p *Proxy) HalfOpen(drop End) int {
	links := p.openLinks()
	for _, l := range links {
		l.drop(drop)
	}
	p.mu.Lock()
	p.stats.HalfOpened += len(links)
	p.mu.Unlock()
	return len(links)
}

// HalfClose ends dir on every connection open now, and returns how many
// directions it ended: the receiving end gets a FIN (it reads end of file)
// while the other direction keeps flowing. Bytes still arriving in dir are
// read and discarded: their sender learns nothing, as with a peer that
// shut down its reading side.
func (p *Proxy) HalfClose(dir Direction) int {
	links := p.openLinks()
	n := 0
	for _, l := range links {
		each(dir, func(i int) {
			if l.pipes[i].finish() {
				n++
			}
		})
	}
	p.mu.Lock()
	p.stats.HalfClosed += n
	p.mu.Unlock()
	return n
}

// When arms f to run once, as soon as the bytes forwarded in dir (Upstream
// or Downstream, counted since New) would pass n, on the forwarding
// goroutine of the connection whose chunk passes it, before that chunk is
// written on. A fault f injects therefore hits mid-stream for certain: the
// chunk that passed n, at least, is subject to it. f must not block; it may
// call any method of the Proxy but Close. Use Stats to read the bytes
// forwarded so far. The returned function disarms f, and reports whether
// it did so before f ran.
func (p *Proxy) When(dir Direction, n int64, f func()) (disarm func() bool) {
	if dir != Upstream && dir != Downstream {
		panic("faultproxy: When needs Upstream or Downstream")
	}
	i := dirIndex(dir)
	id := new(byte)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.triggers[i] = append(p.triggers[i], trigger{at: n, f: f, id: id})
	p.rearmLocked(i)
	return func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		for k, t := range p.triggers[i] {
			if t.id == id {
				p.triggers[i] = append(p.triggers[i][:k], p.triggers[i][k+1:]...)
				p.rearmLocked(i)
				return true
			}
		}
		return false
	}
}

func (p *Proxy) rearmLocked(i int) {
	lowest := int64(math.MaxInt64)
	for _, t := range p.triggers[i] {
		lowest = min(lowest, t.at)
	}
	p.armed[i].Store(lowest)
}

// fire runs the triggers of direction i that total passes.
func (p *Proxy) fire(i int, total int64) {
	if total <= p.armed[i].Load() {
		return
	}
	p.mu.Lock()
	var due []func()
	kept := p.triggers[i][:0]
	for _, t := range p.triggers[i] {
		if total > t.at {
			due = append(due, t.f)
		} else {
			kept = append(kept, t)
		}
	}
	clear(p.triggers[i][len(kept):])
	p.triggers[i] = kept
	p.rearmLocked(i)
	p.mu.Unlock()
	for _, f := range due {
		f()
	}
}

// Stats returns what the proxy has done so far.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	s := p.stats
	s.Open = len(p.links)
	p.mu.Unlock()
	s.Upstream, s.Downstream = p.fwd[0].Load(), p.fwd[1].Load()
	return s
}

// Close stops listening, closes every connection and waits for every
// goroutine of the Proxy. It is idempotent.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	err := p.ln.Close()
	p.cancel()
	for _, l := range p.openLinks() {
		l.kill(false)
	}
	p.wg.Wait()
	return err
}

func (p *Proxy) openLinks() []*link {
	p.mu.Lock()
	defer p.mu.Unlock()
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	return links
}

// state returns direction i's faults and the channel closed when they next
// change.
func (p *Proxy) state(i int) (faults, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.faults[i], p.changed
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			select { // e.g. EMFILE: do not spin
			case <-p.ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		client := c.(*net.TCPConn)
		p.mu.Lock()
		upstream, refuse, closed := p.upstream, p.refuse, p.closed
		if refuse || upstream == "" {
			p.stats.Refused++
		}
		p.mu.Unlock()
		if closed {
			_ = client.Close()
			return
		}
		if refuse || upstream == "" {
			rst(client)
			continue
		}
		p.wg.Add(1)
		go p.serve(client, upstream)
	}
}

// rst closes c with a TCP reset.
func rst(c *net.TCPConn) {
	_ = c.SetLinger(0)
	_ = c.Close()
}

// serve dials the upstream server for client, then forwards both ways
// until both directions end, and closes both connections.
func (p *Proxy) serve(client *net.TCPConn, upstream string) {
	defer p.wg.Done()
	ctx, cancel := context.WithTimeout(p.ctx, dialTimeout)
	d := net.Dialer{}
	c, err := d.DialContext(ctx, "tcp", upstream)
	cancel()
	if err != nil {
		p.mu.Lock()
		p.stats.Refused++
		p.mu.Unlock()
		rst(client)
		return
	}
	l := &link{p: p, conns: [2]*net.TCPConn{client, c.(*net.TCPConn)}, done: make(chan struct{})}
	l.pipes[0] = newPipe(l, 0, Client, Server)
	l.pipes[1] = newPipe(l, 1, Server, Client)
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		_ = client.Close()
		_ = c.Close()
		return
	}
	p.links[l] = struct{}{}
	p.stats.Accepted++
	p.mu.Unlock()

	var wg sync.WaitGroup
	for _, pp := range l.pipes {
		wg.Go(pp.read)
		wg.Go(pp.write)
	}
	wg.Wait()
	l.kill(false)
	p.mu.Lock()
	delete(p.links, l)
	p.mu.Unlock()
}

// link is one proxied connection: the client's connection and the one to
// the upstream server, and a pipe for each direction.
type link struct {
	p     *Proxy
	conns [2]*net.TCPConn // indexed by End
	pipes [2]*pipe        // indexed by direction
	done  chan struct{}   // closed by kill

	dropped  atomic.Int32 // 0, or 1 + the End dropped by HalfOpen
	killOnce sync.Once
}

// kill closes both connections, with a reset if rst, and stops the pipes.
func (l *link) kill(reset bool) {
	l.killOnce.Do(func() {
		close(l.done)
		for _, c := range l.conns {
			if reset {
				rst(c)
			} else {
				_ = c.Close()
			}
		}
	})
}

// drop makes the link half-open: end e is reset, the other stays open and
// silent.
func (l *link) drop(e End) {
	if !l.dropped.CompareAndSwap(0, int32(e)+1) {
		return
	}
	rst(l.conns[e])
	// Wake the writers so that they drop what they hold.
	for _, pp := range l.pipes {
		pp.wake()
	}
}

// droppedEnd reports which end HalfOpen dropped, if any.
func (l *link) droppedEnd() (End, bool) {
	d := l.dropped.Load()
	return End(d - 1), d != 0
}

// chunk is a piece of the byte stream, or its end.
type chunk struct {
	buf *[]byte
	n   int
	at  time.Time // when it was read
	eof bool      // the source sent FIN
}

var bufs = sync.Pool{New: func() any { b := make([]byte, chunkSize); return &b }}

// pipe forwards one direction of a link: a reader goroutine fills a
// bounded queue from the source, a writer goroutine applies the faults and
// writes to the destination, so that latency delays bytes without
// throttling them.
type pipe struct {
	l        *link
	i        int // direction index
	src, dst End
	q        chan chunk
	kick     chan struct{} // wakes the writer: drop or finish
	fin      atomic.Bool   // HalfClose: FIN sent, further bytes discarded
}

func newPipe(l *link, i int, src, dst End) *pipe {
	return &pipe{l: l, i: i, src: src, dst: dst, q: make(chan chunk, queueLen), kick: make(chan struct{}, 1)}
}

func (pp *pipe) wake() {
	select {
	case pp.kick <- struct{}{}:
	default:
	}
}

// finish half-closes the pipe: FIN to the destination, bytes discarded from
// now on. It reports whether it did anything.
func (pp *pipe) finish() bool {
	if !pp.fin.CompareAndSwap(false, true) {
		return false
	}
	_ = pp.l.conns[pp.dst].CloseWrite()
	pp.wake()
	return true
}

// read fills the queue until the source ends. A source that is reset, or
// fails, resets the whole link, unless HalfOpen dropped it.
func (pp *pipe) read() {
	defer close(pp.q)
	l := pp.l
	src := l.conns[pp.src]
	for {
		b := bufs.Get().(*[]byte)
		n, err := src.Read(*b)
		if n > 0 {
			select {
			case pp.q <- chunk{buf: b, n: n, at: time.Now()}:
			case <-l.done:
				bufs.Put(b)
				return
			}
		} else {
			bufs.Put(b)
		}
		if err == nil {
			continue
		}
		if e, ok := l.droppedEnd(); ok {
			if e != pp.src {
				l.kill(false) // the surviving end closed: the link is over
			}
			return
		}
		if errors.Is(err, io.EOF) {
			select {
			case pp.q <- chunk{eof: true}:
			case <-l.done:
			}
			return
		}
		l.kill(true) // a reset or an error: pass it on as a reset
		return
	}
}

// write delivers the queue to the destination, applying the direction's
// faults to each chunk.
func (pp *pipe) write() {
	l := pp.l
	dst := l.conns[pp.dst]
	var last time.Time // delivery time of the previous chunk: no reordering
	defer func() {
		for c := range pp.q { // the reader ends: the link is done or dropped
			if c.buf != nil {
				bufs.Put(c.buf)
			}
		}
	}()
	for {
		var c chunk
		select {
		case c = <-pp.q:
		case <-l.done:
			return
		}
		if c.buf == nil && !c.eof {
			return // the queue closed
		}
		ok := pp.deliver(dst, c, &last)
		if c.buf != nil {
			bufs.Put(c.buf)
		}
		if !ok {
			return
		}
		if c.eof {
			if !pp.fin.Load() {
				_ = dst.CloseWrite()
			}
			return
		}
	}
}

// discarding reports whether the pipe drops what it reads: its direction
// was half-closed, or one of its ends dropped.
func (pp *pipe) discarding() bool {
	if pp.fin.Load() {
		return true
	}
	_, dropped := pp.l.droppedEnd()
	return dropped
}

// deliver writes one chunk once its faults allow, and reports whether the
// pipe goes on.
func (pp *pipe) deliver(dst *net.TCPConn, c chunk, last *time.Time) bool {
	l, p := pp.l, pp.l.p
	var jitter time.Duration
	drawn := false
	data := []byte(nil)
	if c.buf != nil {
		data = (*c.buf)[:c.n]
	}
	fired := false
	for len(data) > 0 || c.eof {
		if pp.discarding() {
			return !c.eof
		}
		f, changed := p.state(pp.i)
		// Latency: hold the chunk until its delivery time.
		if f.jitter > 0 && !drawn {
			jitter = time.Duration(rand.Int64N(int64(2*f.jitter)+1)) - f.jitter
			drawn = true
		}
		due := c.at.Add(f.latency + jitter)
		if f.latency == 0 && f.jitter == 0 {
			due = time.Time{}
		}
		if due.Before(*last) {
			due = *last
		}
		if wait := time.Until(due); wait > 0 {
			if !pp.sleep(wait, changed) {
				return false
			}
			continue
		}
		if f.stall {
			select {
			case <-changed:
			case <-pp.kick:
			case <-l.done:
				return false
			}
			continue
		}
		if c.eof {
			*last = due
			return true
		}
		// Triggers see the chunk before it goes on, under the faults they
		// inject.
		if !fired {
			fired = true
			p.fire(pp.i, p.fwd[pp.i].Load()+int64(len(data)))
			continue
		}
		piece := data
		if f.rate > 0 {
			quantum := max(int(f.rate*int64(paceQuantum)/int64(time.Second)), 1)
			piece = data[:min(len(data), quantum)]
			at := p.pacers[pp.i].reserve(len(piece), f.rate)
			if wait := time.Until(at); wait > 0 {
				if !pp.sleep(wait, changed) {
					return false
				}
				// The reservation stands even if the faults changed:
				// another may have taken its place since.
			}
			if pp.discarding() {
				return true
			}
		}
		n, err := dst.Write(piece)
		p.fwd[pp.i].Add(int64(n))
		if err != nil {
			if pp.discarding() {
				return true
			}
			l.kill(true)
			return false
		}
		data = data[n:]
		*last = due
	}
	return true
}

// sleep waits d, or until the faults change or the writer is kicked; it
// reports false if the link ended.
func (pp *pipe) sleep(d time.Duration, changed <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-changed:
	case <-pp.kick:
	case <-pp.l.done:
		return false
	}
	return true
}

// pacer shares one direction's bandwidth among all connections.
type pacer struct {
	mu   sync.Mutex
	next time.Time
}

func (pc *pacer) reset() {
	pc.mu.Lock()
	pc.next = time.Time{}
	pc.mu.Unlock()
}

// reserve books n bytes at rate and returns when they may be sent.
func (pc *pacer) reserve(n int, rate int64) time.Time {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	now := time.Now()
	if pc.next.Before(now) {
		pc.next = now
	}
	at := pc.next
	pc.next = pc.next.Add(time.Duration(int64(n) * int64(time.Second) / rate))
	return at
}
