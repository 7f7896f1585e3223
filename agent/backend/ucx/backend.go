//go:build ucx

package ucx

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/hostid"
)

// Backend is the UCX backend, an [agent.Backend]. Create one per agent with
// [New] and hand it to the agent, which starts and closes it. Safe for
// concurrent use.
//
// Memory: the backend maps every region the agent registers
// ([agent.Registrar]) with ucp_mem_map, and unmaps it when the agent
// deregisters it. The agent's caller owns the memory and keeps it alive and
// in place meanwhile (Go's heap does not move objects); UCX keeps its
// address, never a Go pointer. Memory from [Backend.Alloc] is the
// backend's; see there.
type Backend struct {
	cfg    config
	optErr error

	host agent.Host
	log  *slog.Logger // host.Logger()
	id   uuid.UUID
	self connInfo
	cuda bool
	lim  limits

	mu      sync.Mutex
	started bool
	// launched: Start ran the progress thread, which closes done when it
	// ends, also after failing to set UCX up.
	launched bool
	closed   bool
	cmds     []command
	wakeFD   int
	done     chan struct{} // closed when the progress loop has exited

	regMu  sync.RWMutex // guards regs and n's context against Close
	regs   map[regKey]*mapping
	allocs map[uint64]*mapping   // Alloc's blocks, by address
	live   map[*mapping]struct{} // every mapping not yet unmapped
	dead   bool                  // the context is gone
	regSeq atomic.Uint64

	n *native // created and destroyed by the progress thread

	stats stats
}

// New returns a UCX backend for one agent, configured by opts (defaults
// under each option). Invalid options are reported by Start, that is by the
// agent's constructor, wrapping [agent.ErrInvalidOption]. Nothing is
// created before Start.
func New(opts ...Option) *Backend {
	cfg, err := newConfig(opts)
	return &Backend{cfg: cfg, optErr: err, regs: map[regKey]*mapping{}, allocs: map[uint64]*mapping{}, live: map[*mapping]struct{}{}, wakeFD: -1, done: make(chan struct{})}
}

// BuiltIn reports whether this binary was built with the ucx tag: true here.
func BuiltIn() bool { return true }

// Name implements [agent.Backend]: [Name].
func (b *Backend) Name() string { return Name }

// Supports implements [agent.Backend]: host memory, and GPU memory when the
// UCX context reports CUDA support (known once started).
func (b *Backend) Supports(k agent.MemKind) bool {
	return k == agent.KindDRAM || (k == agent.KindVRAM && b.cuda)
}

// ucxSettings returns the UCX configuration the context is created with:
// the environment's, overridden by the options. Shared-memory transports
// report peer failures only when asked to; endpoints with peer error
// handling need that, so it is asked for unless the environment decides.
func (c *config) ucxSettings() [][2]string {
	var s [][2]string
	set := false
	for _, k := range []string{"MM_ERROR_HANDLING", "POSIX_ERROR_HANDLING", "SYSV_ERROR_HANDLING"} {
		_, ok := os.LookupEnv("UCX_" + k)
		set = set || ok
	}
	if !set && usesSharedMemory(c.effectiveTLS()) {
		s = append(s, [2]string{"MM_ERROR_HANDLING", "y"})
	}
	if tls := c.ucxTLS(); tls != "" {
		s = append(s, [2]string{"TLS", tls})
	}
	return append(s, c.settings...)
}

// ucxTLS returns the UCX_TLS to set for the context, "" for the
// environment's: WithTransports's, with sysv added beside posix unless
// WithSysvBesidePosix(false).
func (c *config) ucxTLS() string {
	if !c.noSysv {
		if tls, ok := sysvBesidePosix(c.effectiveTLS()); ok {
			return tls
		}
	}
	return c.tls
}

// tlsList returns the transports a UCX_TLS list names, and true; false for
// "", "all" and lists starting with "^", which leave the choice to UCX.
func tlsList(tls string) ([]string, bool) {
	tls = strings.TrimSpace(tls)
	if tls == "" || tls == "all" || strings.HasPrefix(tls, "^") {
		return nil, false
	}
	names := strings.Split(tls, ",")
	for i, t := range names {
		names[i] = strings.TrimSpace(strings.TrimPrefix(t, "\\"))
	}
	return names, true
}

// sysvBesidePosix returns tls with sysv appended, and true, when it is a
// list naming posix and no transport or alias that includes sysv.
func sysvBesidePosix(tls string) (string, bool) {
	tls = strings.TrimSpace(tls)
	names, ok := tlsList(tls)
	if !ok || !slices.Contains(names, "posix") || slices.ContainsFunc(names, func(t string) bool {
		switch t {
		case "sysv", "sm", "shm", "mm", "all":
			return true
		}
		return false
	}) {
		return tls, false
	}
	return tls + ",sysv", true
}

// effectiveTLS returns the UCX_TLS the context is created with.
func (c *config) effectiveTLS() string {
	if c.tls != "" {
		return c.tls
	}
	return os.Getenv("UCX_TLS")
}

// socketsOnly reports whether a UCX_TLS list names nothing but tcp (and
// self): transports whose every event, a socket that can be written again
// included, wakes an armed worker.
func socketsOnly(tls string) bool {
	names, ok := tlsList(tls)
	return ok && !slices.ContainsFunc(names, func(t string) bool { return t != "tcp" && t != "self" })
}

// usesSharedMemory guesses from a UCX_TLS list whether UCX loads its
// shared-memory transports (posix, sysv).
func usesSharedMemory(tls string) bool {
	names, ok := tlsList(tls)
	return !ok || slices.ContainsFunc(names, func(t string) bool {
		switch t {
		case "sm", "shm", "mm", "posix", "sysv":
			return true
		}
		return false
	})
}

// reachesNet guesses from a UCX_TLS list whether the transports reach
// other hosts: anything but shared memory and loopback does.
func reachesNet(tls string) bool {
	names, ok := tlsList(tls)
	return !ok || slices.ContainsFunc(names, func(t string) bool {
		switch t {
		case "self", "sm", "shm", "posix", "sysv", "xpmem", "cma", "knem", "cuda_copy", "cuda_ipc", "rocm_copy", "rocm_ipc", "":
			return false
		}
		return true
	})
}

// Start implements [agent.Backend]: it creates the UCP context and worker on
// a new progress thread and returns the connection information (the
// worker's address, the host's identity and whether the transports reach
// other hosts). It keeps h for the backend's lifetime and logs through
// h.Logger.
func (b *Backend) Start(h agent.Host) ([]byte, error) {
	if b.optErr != nil {
		return nil, b.optErr
	}
	b.host, b.log, b.id = h, h.Logger(), h.ID()
	b.lim = limits{maxRanges: b.cfg.maxRanges, maxNotify: b.cfg.maxNotify}
	wfd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("ucx: eventfd: %w", err)
	}
	ready := make(chan error, 1)
	l := &loop{b: b, wake: wfd}
	b.mu.Lock()
	b.launched = true // the progress thread closes b.done, even if it fails
	b.mu.Unlock()
	go l.run(ready)
	if err := <-ready; err != nil {
		_ = unix.Close(wfd)
		return nil, err
	}
	b.self.net = reachesNet(b.cfg.effectiveTLS())
	b.self.host = hostid.Of("net")
	b.cuda = b.n.cuda()
	b.mu.Lock()
	b.started, b.wakeFD = true, wfd
	b.mu.Unlock()
	return b.self.marshal(), nil
}

// Reachable implements [agent.Backend] without I/O, so ctx has no say. The
// peer must publish ucx connection information; a peer on another host (or
// network namespace) is reachable only if both sides' transports include a
// network one, as guessed from UCX_TLS. Safe for concurrent use.
func (b *Backend) Reachable(_ context.Context, info agent.Info) error {
	raw, ok := info.Conn(Name)
	if !ok {
		return errors.New("peer has no ucx backend")
	}
	b.mu.Lock()
	started, closed := b.started, b.closed
	b.mu.Unlock()
	if !started {
		return errors.New("ucx backend not started")
	}
	if closed {
		return agent.ErrClosed
	}
	ci, err := parseConnInfo(raw)
	if err != nil {
		return err
	}
	if ci.host != b.self.host && (!ci.net || !b.self.net) {
		return errors.New("peer runs on another host and one side's UCX transports are shared memory only")
	}
	return nil
}

// command is work handed to the progress thread.
type command struct {
	post    *xstate
	cancel  *xstate // cancelled (Work.AfterCancel)
	overdue *xstate // cancelled, and its grace is over
	notify  *note
	depart  *departure
	run     func(*loop) // tests: code to run on the progress thread
	close   bool
}

// departure is a peer declared gone from outside (agent.Departer).
type departure struct {
	id    uuid.UUID
	cause error
}

type note struct {
	peer agent.Info
	key  agent.Key
	msg  []byte
}

// submit queues c for the progress thread and wakes it.
func (b *Backend) submit(c command) error {
	b.mu.Lock()
	if b.closed && !c.close {
		b.mu.Unlock()
		return agent.ErrClosed
	}
	wake := len(b.cmds) == 0
	b.cmds = append(b.cmds, c)
	fd := b.wakeFD
	b.mu.Unlock()
	if wake {
		var one = [8]byte{1}
		_, _ = unix.Write(fd, one[:])
	}
	return nil
}

// takeCommands returns the queued commands, for the progress thread.
func (b *Backend) takeCommands(into []command) []command {
	b.mu.Lock()
	into = append(into, b.cmds...)
	clear(b.cmds)
	b.cmds = b.cmds[:0]
	b.mu.Unlock()
	return into
}

// Post implements [agent.Backend]: it queues x for the progress thread,
// which connects to the peer if need be and drives the transfer, lease by
// lease; it never blocks. The backend touches x's local memory until it
// calls x.Finish. A cancelled transfer finishes promptly with
// x.CancelErr, also when the peer answers nothing: its lease requests are
// abandoned, and bytes still moving a grace later are stopped by dropping
// the connection (docs/ucx.md, Cancellation). Post fails, and x is not
// started, for memory kinds UCX cannot move here, a notification over
// 64 KiB, or a closed backend. Safe for concurrent use.
func (b *Backend) Post(x *agent.Work) error {
	for i, s := range x.Segments {
		if !b.Supports(s.Local.Kind) || !b.Supports(s.Remote.Kind) {
			return fmt.Errorf("%w: segment %d: ucx does not support %v memory here", agent.ErrInvalid, i, s.Local.Kind)
		}
	}
	if len(x.Notify) > b.cfg.maxNotify {
		return fmt.Errorf("%w: notification of %d bytes, at most %d", agent.ErrInvalid, len(x.Notify), b.cfg.maxNotify)
	}
	return b.submit(command{post: &xstate{x: x, write: x.Op == agent.OpWrite}})
}

// Notify implements [agent.Backend]. It never blocks: msg is copied and
// queued for the progress thread, which connects to the peer if need be and
// sends it once the peer has answered the connection request (dropped, best
// effort, if the connection fails first). A ctx already done fails it with
// an error wrapping context.Cause(ctx); there is nothing to wait for after
// that. Safe for concurrent use.
func (b *Backend) Notify(ctx context.Context, peer agent.Info, key agent.Key, msg []byte) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("ucx: notify peer %s: %w", peer.ID, context.Cause(ctx))
	}
	if len(msg) > b.cfg.maxNotify {
		return fmt.Errorf("%w: notification of %d bytes, at most %d", agent.ErrInvalid, len(msg), b.cfg.maxNotify)
	}
	return b.submit(command{notify: &note{peer: peer, key: key, msg: append([]byte(nil), msg...)}})
}

// PeerDeparted implements [agent.Departer]: the connections to agent id are
// dropped at once and their endpoints force-closed, failing with cause
// (which wraps [agent.ErrRemoteLost]) every transfer waiting on that peer:
// lease requests unanswered at once; READs the peer is writing into this
// agent's memory, and puts and flushes in flight, once the endpoint is
// closed, so that no operation still touches the transfer's memory. It
// does not wait for WithTimeout to notice a peer that may have gone silent
// rather than closed its endpoints. The next transfer to it connects afresh.
// Connections it opened to this agent (for its own transfers, and the
// leases they hold here) are left to their heartbeats: they serve its
// requests if it is in fact alive. It never blocks; safe for concurrent
// use.
func (b *Backend) PeerDeparted(id uuid.UUID, cause error) {
	if cause == nil {
		cause = agent.ErrRemoteLost
	}
	b.mu.Lock()
	started := b.started
	b.mu.Unlock()
	if started {
		_ = b.submit(command{depart: &departure{id: id, cause: cause}})
	}
}

// Stats returns the backend's counters ([agent.Counting]). Safe for
// concurrent use, also after Close.
func (b *Backend) Stats() Stats { return b.stats.snapshot() }

// Close implements [agent.Backend]: it says goodbye to every peer, fails
// what is still in flight with [agent.ErrClosed], unmaps every registration
// and every block from [Backend.Alloc], and destroys the worker and
// context. It waits for the progress thread, which gives the goodbyes up
// to a quarter of WithTimeout (at most a second) and the endpoints up to
// WithTimeout to close. Later calls wait for the first and return nil.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		<-b.done
		return nil
	}
	b.closed = true
	started, launched := b.started, b.launched
	b.mu.Unlock()
	if !started {
		if launched { // a Start that failed inside UCX: the thread has ended
			<-b.done
		} else {
			close(b.done)
		}
		return nil
	}
	_ = b.submit(command{close: true})
	<-b.done
	return unix.Close(b.wakeFD)
}

// regKey names a registered region.
type regKey struct{ addr, len uint64 }

// mapping is one ucp_mem_map registration.
type mapping struct {
	id         uint64
	addr, len  uint64
	memh       memh
	packed     []byte // the packed remote key; made by the progress thread
	users      int    // leases and windows using it; guarded by regMu
	registered bool   // in regs; false: lazy, or deregistered while in use
	// alloc: memory UCX allocated (Alloc); it stays mapped, and
	// registered, until Free. refs counts the agent's registrations of
	// regions inside it.
	alloc bool
	refs  int
}

// allocReg is the handle of a registration of a region inside memory
// this backend allocated: the allocation's mapping serves it.
type allocReg struct {
	m *mapping
	k regKey
}

// RegisterMem implements [agent.Registrar]: ucp_mem_map of the region,
// unmapped by DeregisterMem. GPU memory is mapped only when UCX supports
// CUDA; otherwise the handle is nil and the region is left to other
// backends. A region inside a block from [Backend.Alloc] reuses the
// block's mapping. The caller keeps the memory alive and in place until
// DeregisterMem. Safe for concurrent use.
func (b *Backend) RegisterMem(l agent.Local) (any, error) {
	if l.Kind == agent.KindVRAM && !b.cuda {
		return nil, nil
	}
	b.regMu.Lock()
	defer b.regMu.Unlock()
	if b.dead {
		return nil, agent.ErrClosed
	}
	k := regKey{l.Addr, l.Len}
	if l.Kind == agent.KindDRAM {
		if a := b.allocOfLocked(l.Addr, l.Len); a != nil {
			// Memory from Alloc is mapped already: its mapping, and its
			// remote key, serve every region inside it.
			b.forgetLocked(k)
			a.refs++
			b.regs[k] = a
			return &allocReg{m: a, k: k}, nil
		}
	}
	m, err := b.mapLocked(l.Addr, l.Len, l.Kind == agent.KindVRAM)
	if err != nil {
		return nil, err
	}
	m.registered = true
	b.forgetLocked(k)
	b.regs[k] = m
	return m, nil
}

// forgetLocked drops what regs holds under k: the agent registers a
// region once, but be safe anyway. The caller holds regMu.
func (b *Backend) forgetLocked(k regKey) {
	old := b.regs[k]
	if old == nil {
		return
	}
	delete(b.regs, k)
	if !old.alloc {
		old.registered = false
		_ = b.dropLocked(old)
	}
}

// allocOfLocked returns the allocation holding [addr, addr+n), or nil.
// The caller holds regMu.
func (b *Backend) allocOfLocked(addr, n uint64) *mapping {
	for _, a := range b.allocs {
		if a.addr <= addr && addr+n <= a.addr+a.len && addr+n >= addr {
			return a
		}
	}
	return nil
}

func (b *Backend) mapLocked(addr, n uint64, cuda bool) (*mapping, error) {
	h, err := b.n.mapMem(addr, n, cuda)
	if err != nil {
		return nil, fmt.Errorf("ucx: map 0x%x+%d: %w", addr, n, err)
	}
	m := &mapping{id: b.regSeq.Add(1), addr: addr, len: n, memh: h}
	b.live[m] = struct{}{}
	return m, nil
}

// DeregisterMem implements [agent.Registrar]. A mapping still used by a
// lease or a transfer is unmapped when the last one lets go of it. Safe for
// concurrent use; a second call with the same handle does nothing.
func (b *Backend) DeregisterMem(handle any) error {
	if r, ok := handle.(*allocReg); ok {
		b.regMu.Lock()
		defer b.regMu.Unlock()
		if r.m == nil {
			return nil
		}
		if b.regs[r.k] == r.m {
			delete(b.regs, r.k)
		}
		r.m.refs--
		r.m = nil
		return nil
	}
	m, _ := handle.(*mapping)
	if m == nil {
		return nil
	}
	b.regMu.Lock()
	defer b.regMu.Unlock()
	if b.dead || !m.registered {
		return nil
	}
	m.registered = false
	if k := (regKey{m.addr, m.len}); b.regs[k] == m {
		delete(b.regs, k)
	}
	return b.dropLocked(m)
}

// dropLocked unmaps m unless it is registered or in use. The caller holds
// regMu.
func (b *Backend) dropLocked(m *mapping) error {
	if m.registered || m.alloc || m.users > 0 || m.memh == nil {
		return nil
	}
	h := m.memh
	m.memh = nil
	delete(b.live, m)
	return b.n.unmap(h)
}

// unuse lets go of mappings a lease or window used: each has one user
// less, and one deregistered meanwhile, or mapped for it alone, is unmapped
// once unused.
func (b *Backend) unuse(maps []*mapping) {
	if len(maps) == 0 {
		return
	}
	b.regMu.Lock()
	defer b.regMu.Unlock()
	b.unuseLocked(maps)
}

// unuseLocked is unuse for a caller holding regMu.
func (b *Backend) unuseLocked(maps []*mapping) {
	for _, m := range maps {
		m.users--
		if !m.registered && m.users == 0 {
			_ = b.dropLocked(m)
		}
	}
}

// findLocked returns the registration holding [addr, addr+n), preferring the one
// registered as exactly hint. The caller holds regMu.
func (b *Backend) findLocked(hint agent.Region, addr, n uint64) *mapping {
	if m := b.regs[regKey{hint.Addr, hint.Len}]; m != nil && m.addr <= addr && addr+n <= m.addr+m.len {
		return m
	}
	for _, m := range b.regs { // the exposed region is not itself registered: rare
		if m.addr <= addr && addr+n <= m.addr+m.len {
			return m
		}
	}
	return b.allocOfLocked(addr, n)
}

// localLocked returns the mapping of local memory [addr, addr+n) of a
// transfer: its registration, or the allocation holding it; nil if
// neither. The caller holds regMu.
func (b *Backend) localLocked(addr, n uint64) *mapping {
	if m := b.regs[regKey{addr, n}]; m != nil {
		return m
	}
	if len(b.allocs) > 0 {
		return b.allocOfLocked(addr, n)
	}
	return nil
}

// unmapAll unmaps every mapping as the context goes away.
func (b *Backend) unmapAll() {
	b.regMu.Lock()
	defer b.regMu.Unlock()
	for m := range b.live {
		_ = b.n.unmap(m.memh)
		m.memh = nil
	}
	clear(b.live)
	clear(b.regs)
	clear(b.allocs)
	b.dead = true
}

func newCID() cid {
	var c cid
	_, _ = rand.Read(c[:])
	return c
}

// lockThread pins the calling goroutine to its OS thread for good: the
// thread exits with the goroutine, taking nothing UCX left on it along.
func lockThread() { runtime.LockOSThread() }
