// Package tcp is goxfer's pure-Go backend across processes and hosts.
//
// Each agent listens on one TCP address. An agent that transfers to a peer
// dials it once, with several data connections (streams) and one control
// connection for notifications, and keeps them for later transfers. Bytes go
// straight between registered memory and the sockets: the exposing side
// answers a READ with one vectored write from the exposed regions and reads
// a WRITE's payload straight into them. Large descriptors are split into
// chunks pipelined over the streams; many small ones share a frame.
//
// Every remote access is checked by the exposing agent against the key, the
// access kind and the exposed regions, under a lease per frame renewed at
// each keepalive timeout, so revoking an exposure waits for at most one
// timeout. Cancelling a transfer never waits for the peer. Idle connections
// exchange keepalives; a connection silent for longer than the keepalive
// timeout, or broken, fails its transfers with [agent.ErrRemoteLost] and
// tells the agent the peer is lost.
//
// The backend logs on its host's logger ([agent.Host].Logger): connections
// it drops on a peer's account at level Debug, accept failures at Warn.
// docs/tcp.md has the design, the limits and their defaults, and the wire
// format.
package tcp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/internal/serve"
	"github.com/goxfer/goxfer/internal/oneline"
)

// Name is the backend's name in metadata and reports.
const Name = "tcp"

// Backend is the TCP backend. Create one per agent with [New] and hand it to
// the agent ([agent.WithBackends]), which starts and closes it. Safe for
// concurrent use.
type Backend struct {
	cfg    config
	optErr error

	host agent.Host
	log  *slog.Logger // the host's
	id   uuid.UUID
	self connInfo
	ln   net.Listener

	mu      sync.Mutex
	closed  bool
	peers   map[peerKey]*peer
	inbound map[sessionKey]*inbound // live connections of each dialling peer's session
	out     map[netip.Addr]int      // connections we dialled to each address

	conns  serve.Set[*wconn]       // live connections, both directions, and the goroutines serving accepted ones
	byIP   *serve.Caps[netip.Addr] // accepted connections from each address
	byPeer *serve.Caps[peerAddr]   // handshaken connections from each identity at each address
	gate   *serve.Gate             // accepted connections still in the handshake

	stats serve.Counters

	// The backend's lifetime: the host's (agent.Host.Context), also
	// cancelled when Close begins (the agent cancels it just before; a
	// test calling Close may not). Dials, handshakes and the keepalive
	// loop end with it.
	ctx    context.Context
	cancel context.CancelCauseFunc

	wg    sync.WaitGroup
	nudge chan struct{} // wakes the keepalive loop early
}

// New returns a TCP backend for one agent, configured by opts (defaults:
// docs/tcp.md). Invalid options are reported by [Backend.Start], that is by
// the agent's constructor.
func New(opts ...Option) *Backend {
	b := &Backend{cfg: defaults(), peers: map[peerKey]*peer{}, inbound: map[sessionKey]*inbound{},
		out: map[netip.Addr]int{}, nudge: make(chan struct{}, 1)}
	b.stats.Classes = serve.Classes{Limit: errLimit, Protocol: errProtocol, Timeouts: []error{errStalled}}
	var errs []error
	for _, o := range opts {
		if o == nil {
			errs = append(errs, fmt.Errorf("%w: tcp: nil option", agent.ErrInvalidOption))
			continue
		}
		if err := o.apply(&b.cfg); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		if err := b.cfg.check(); err != nil {
			errs = append(errs, err)
		}
	}
	b.optErr = oneline.Join(errs...)
	// An option that failed left its default in place: the limits are valid.
	b.byIP = serve.NewCaps[netip.Addr](b.cfg.maxConnsPerIP)
	b.byPeer = serve.NewCaps[peerAddr](b.cfg.maxConnsPerPeer)
	b.gate = serve.NewGate(b.cfg.maxHandshakes)
	return b
}

// Name implements [agent.Backend]: it returns [Name].
func (b *Backend) Name() string { return Name }

// Supports implements [agent.Backend]: host memory ([agent.KindDRAM])
// only; device memory needs a GPU-capable backend or staging.
func (b *Backend) Supports(k agent.MemKind) bool { return k == agent.KindDRAM }

// Addr returns the address the backend listens on, or nil before Start. Call
// it once Start has returned.
func (b *Backend) Addr() net.Addr {
	if b.ln == nil {
		return nil
	}
	return b.ln.Addr()
}

// Advertised returns the address published to peers ([WithAdvertiseAddr]),
// or "" before Start. Call it once Start has returned.
func (b *Backend) Advertised() string { return b.self.addr }

// Start implements [agent.Backend]: it listens and starts the accept loop and
// the keepalive loop, which end with h.Context() or Close. The backend logs
// on h.Logger().
func (b *Backend) Start(h agent.Host) ([]byte, error) {
	if b.optErr != nil {
		return nil, b.optErr
	}
	listen := b.cfg.testListen
	if listen == nil {
		listen = func(addr string) (net.Listener, error) { return net.Listen("tcp", addr) }
	}
	ln, err := listen(b.cfg.listen)
	if err != nil {
		return nil, fmt.Errorf("tcp: listen on %q: %w", b.cfg.listen, err)
	}
	b.host, b.log, b.id, b.ln = h, h.Logger(), h.ID(), ln
	b.ctx, b.cancel = context.WithCancelCause(h.Context())
	b.self = connInfo{host: hostIdentity(), addr: b.cfg.advertise}
	if b.self.addr == "" {
		b.self.addr = advertiseFor(ln.Addr())
	}
	b.wg.Add(2)
	go func() {
		defer b.wg.Done()
		serve.Accept(b.ctx, ln, b.log, b.admit)
	}()
	go b.keepalive()
	return b.self.marshal(), nil
}

// advertiseFor returns the address to publish for a listener bound to a.
func advertiseFor(addr net.Addr) string {
	a, ok := addr.(*net.TCPAddr)
	if !ok || !a.IP.IsUnspecified() {
		return addr.String()
	}
	ip := net.IPv4(127, 0, 0, 1)
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, ad := range addrs {
			if n, ok := ad.(*net.IPNet); ok && n.IP.To4() != nil && n.IP.IsGlobalUnicast() {
				ip = n.IP
				break
			}
		}
	}
	return net.JoinHostPort(ip.String(), fmt.Sprint(a.Port))
}

// dial connects to addr within ctx and the keepalive timeout.
func (b *Backend) dial(ctx context.Context, addr string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, b.cfg.timeout)
	defer cancel()
	if b.cfg.testDial != nil {
		return b.cfg.testDial(ctx, addr)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", addr)
}

// Reachable implements [agent.Backend] without I/O. A peer that publishes a
// loopback address but runs on another host (or in another network
// namespace) is unreachable, and the error says which option the peer must
// set.
func (b *Backend) Reachable(_ context.Context, info agent.Info) error {
	raw, ok := info.Conn(Name)
	if !ok {
		return errors.New("tcp: the peer has no tcp backend")
	}
	ci, err := parseConnInfo(raw)
	if err != nil {
		return err
	}
	if isLoopback(ci.addr) && ci.host != b.self.host {
		return fmt.Errorf("tcp: peer %s advertises the loopback address %q but runs on another host or network namespace; "+
			"start the peer with tcp.WithListenAddr and tcp.WithAdvertiseAddr set to an address this host can reach", info.ID, ci.addr)
	}
	return nil
}

// wconn is a connection with a write lock, shared by both directions'
// bookkeeping: the keepalive loop pings whichever connection is idle.
type wconn struct {
	c         net.Conn    // a *net.TCPConn but in tests (config.testDial)
	ip        netip.Addr  // an accepted connection's remote address, counted in byIP; zero for ours
	peer      peerAddr    // an accepted connection's peer, once counted in byPeer
	pass      *serve.Pass // an accepted connection's passage through Backend.gate
	wl        wlock
	why       atomic.Pointer[error] // why the connection was cut (cut)
	lastWrite atomic.Int64          // unix nanos
	rx        atomic.Uint64         // bytes read, counted by the patientConn under the reader
	tx        atomic.Uint64         // bytes written, handshake and pings included
	ptx       atomic.Uint64         // bytes of pings written, counted before tx
	pingRx    uint64                // rx when the last ping was sent; keepalive loop only
	every     atomic.Int64          // ping after this long without a write, in ns; 0 until the handshake is done
	ping      [hdrSize]byte
}

func newWconn(c net.Conn) *wconn {
	w := &wconn{c: c, wl: newWlock()}
	(&header{typ: tPing}).put(w.ping[:])
	w.lastWrite.Store(time.Now().UnixNano())
	return w
}

// cut closes w because of err, which its reader reports, and counts, in
// place of the error the close gives it.
func (w *wconn) cut(err error) {
	w.why.CompareAndSwap(nil, &err)
	_ = w.c.Close()
}

// reason returns why w was cut, or err if it was not.
func (w *wconn) reason(err error) error {
	if why := w.why.Load(); why != nil {
		return *why
	}
	return err
}

// setPingEvery sets how often w pings when idle and wakes the keepalive
// loop, which may have to tick sooner.
func (b *Backend) setPingEvery(w *wconn, every time.Duration) {
	w.every.Store(int64(every))
	select {
	case b.nudge <- struct{}{}:
	default:
	}
}

// track counts a connection we dialled among those Close ends, unless the
// backend is closing: it reports whether it did.
func (b *Backend) track(w *wconn) bool { return b.conns.Add(w) }

// untrack uncounts w, ended, wherever it was counted.
func (b *Backend) untrack(w *wconn) {
	b.conns.Remove(w)
	if w.pass != nil {
		w.pass.Done()
	}
	if w.ip.IsValid() {
		b.byIP.Release(w.ip)
	}
	if w.peer.id != uuid.Nil {
		b.byPeer.Release(w.peer)
	}
}

// keepalive pings connections that have not written for their ping
// interval. It wakes every half of the shortest one, so an idle connection
// pings at most 1.5 of its intervals apart. It never waits for a peer: a
// connection busy writing needs no ping (its writer is bounded by the
// timeout on its own), and a ping that the socket does not take at once is
// finished by a goroutine of its own (finishPing).
func (b *Backend) keepalive() {
	defer b.wg.Done()
	t := time.NewTimer(b.cfg.interval / 2)
	defer t.Stop()
	var idle []*wconn
	for {
		select {
		case <-b.ctx.Done():
			return
		case <-b.nudge:
		case <-t.C:
		}
		now := time.Now()
		tick := b.cfg.interval / 2
		idle = idle[:0]
		for _, w := range b.conns.Members() {
			every := time.Duration(w.every.Load())
			if every <= 0 {
				continue // still in the handshake: it must not see a ping first
			}
			tick = min(tick, every/2)
			if now.UnixNano()-w.lastWrite.Load() >= int64(every) {
				idle = append(idle, w)
			}
		}
		b.mu.Lock()
		reaped := b.reapable(now)
		b.mu.Unlock()
		for _, w := range idle {
			if !w.wl.tryLock() { // busy connections are not idle
				continue
			}
			// A ping tells a peer whose request is still arriving that it
			// is arriving, and how much of it: on a slow link it must not
			// take the wait for its answer as a stall, and a claim of
			// progress can be checked against what it sent.
			ping := w.ping
			rx := w.rx.Load()
			binary.LittleEndian.PutUint64(ping[8:], rx)
			if rx != w.pingRx {
				w.pingRx, ping[1] = rx, stBusy
			}
			n, err := tryWrite(w.c, ping[:])
			w.ptx.Add(uint64(n))
			w.tx.Add(uint64(n))
			switch {
			case err != nil:
				w.wl.unlock()
				w.cut(err)
			case n == hdrSize:
				w.lastWrite.Store(now.UnixNano())
				w.wl.unlock()
			default: // the socket is full, or took part of the ping
				b.wg.Add(1)
				go b.finishPing(w, append([]byte(nil), ping[n:]...))
			}
		}
		for _, p := range reaped {
			b.wg.Add(1)
			go func() { // its goodbyes may wait a little for a writer
				defer b.wg.Done()
				p.retire()
			}()
		}
		t.Reset(tick)
	}
}

// finishPing writes the rest of a ping that the socket did not take at
// once, holding w's write lock, which it releases. A peer that takes no
// byte of it within the keepalive timeout reads nothing, and a ping cut
// short would break the framing: the connection is cut, a timeout.
func (b *Backend) finishPing(w *wconn, rest []byte) {
	defer b.wg.Done()
	defer w.wl.unlock()
	_ = w.c.SetWriteDeadline(time.Now().Add(b.cfg.timeout))
	n, err := w.c.Write(rest)
	w.ptx.Add(uint64(n))
	w.tx.Add(uint64(n))
	if err != nil {
		w.cut(fmt.Errorf("tcp: the peer took no keepalive for %v: %w", b.cfg.timeout, err))
		return
	}
	w.lastWrite.Store(time.Now().UnixNano())
}

// Close implements [agent.Backend]: it stops listening, says goodbye on and
// closes every connection, fails what waits on a peer with
// [agent.ErrClosed], and waits for the backend's goroutines. It never waits
// for a peer. Later calls return nil.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	peers := make([]*peer, 0, len(b.peers))
	for _, p := range b.peers {
		peers = append(peers, p)
	}
	conns, _ := b.conns.Stop()
	b.mu.Unlock()
	if b.ln == nil {
		return nil
	}
	b.cancel(agent.ErrClosed)
	err := b.ln.Close() // the accept loop closes it too, when the agent cancels Host.Context
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	var bye [hdrSize]byte
	(&header{typ: tBye}).put(bye[:])
	for _, w := range conns {
		if w.wl.tryLock() { // a connection busy writing just closes
			_, _ = tryWrite(w.c, bye[:]) // a goodbye cut short is still a goodbye: the connection closes
			w.wl.unlock()
		}
		_ = w.c.Close()
	}
	for _, p := range peers {
		p.fail(agent.ErrClosed)
	}
	b.wg.Wait()
	b.conns.Wait()
	return err
}
