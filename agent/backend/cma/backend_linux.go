//go:build linux

package cma

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/hostid"
)

// Backend is the cross-memory-attach backend. Create one per agent with New
// and hand it to the agent, which starts and closes it. Safe for concurrent
// use.
type Backend struct {
	cfg    config
	optErr error

	host  agent.Host
	id    uuid.UUID
	pid   int
	self  connInfo
	ln    *net.UnixListener
	probe *[16]byte // nonce a dialling peer reads to prove it may
	scope int       // Yama ptrace_scope, -1 without Yama
	lim   limits

	// The host's Yama and the probe's system call, or a test's stand-ins.
	readScope func() int
	ptracers  *ptracerSet
	readv     func(pid int, local []unix.Iovec, remote []unix.RemoteIovec) (int, error)

	mu      sync.Mutex
	closed  bool
	peers   map[uuid.UUID][]*peer // by agent ID; several when tokens disagree on the socket
	conns   map[*net.UnixConn]struct{}
	live    map[*peer]struct{}       // peers with a reader, listed or not: Close fails them
	byPID   map[int]int              // accepted connections from each process
	shaking map[*net.UnixConn]uint64 // accepted connections still in the handshake, by arrival
	arrived uint64

	stats stats

	tasks chan task
	xwg   sync.WaitGroup // transfers and notifications in flight
	wg    sync.WaitGroup // goroutines
	stop  chan struct{}  // closed when the last transfer is done: workers exit
	quit  chan struct{}  // closed when Close begins: probes in flight give up

	retry time.Duration // how long a failed verdict stands: retryFailed
	swept time.Time     // when expired verdicts were last dropped
}

// retryFailed is how long a peer's failed verdict (unreachable, silent,
// not permitted) stands before a transfer probes it again: a peer that
// never answers costs one WithTimeout per period, not one per transfer,
// and a peer whose permissions change is tried again within it.
const retryFailed = 30 * time.Second

// New returns a cross-memory-attach backend for one agent. Invalid options
// are reported by Start, that is by the agent's constructor.
func New(opts ...Option) *Backend {
	b := &Backend{cfg: defaults(), peers: map[uuid.UUID][]*peer{}, conns: map[*net.UnixConn]struct{}{},
		byPID: map[int]int{}, shaking: map[*net.UnixConn]uint64{}, stop: make(chan struct{}), quit: make(chan struct{}),
		retry: retryFailed, readScope: ptraceScope, ptracers: ptracers, readv: processVMReadv}
	var errs []error
	for _, o := range opts {
		if err := o.apply(&b.cfg); err != nil {
			errs = append(errs, err)
		}
	}
	b.optErr = errors.Join(errs...)
	b.lim = limits{maxRanges: b.cfg.maxRanges, maxNotify: b.cfg.maxNotify}
	return b
}

// Name implements agent.Backend.
func (b *Backend) Name() string { return Name }

// Stats returns the backend's counters. Safe for concurrent use.
func (b *Backend) Stats() Stats { return b.stats.snapshot() }

// Supports implements agent.Backend: host memory only.
func (b *Backend) Supports(k agent.MemKind) bool { return k == agent.KindDRAM }

// Start implements agent.Backend: it listens on a socket in the abstract
// namespace and starts the accept loop and the copy workers.
func (b *Backend) Start(h agent.Host) ([]byte, error) {
	if b.optErr != nil {
		return nil, b.optErr
	}
	b.host, b.id, b.pid = h, h.ID(), os.Getpid()
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	name := fmt.Sprintf("goxfer-cma/%d/%s/%x", b.pid, b.id, rnd)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@" + name, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("cma: listen on abstract socket %q: %w", name, err)
	}
	ln.SetUnlinkOnClose(false)
	b.ln = ln
	b.probe = new([16]byte)
	_, _ = rand.Read(b.probe[:])
	b.scope = b.readScope()
	b.self = connInfo{host: hostIdentity(), pid: uint32(b.pid), sock: name}
	b.tasks = make(chan task, 4*b.cfg.workers)
	b.wg.Add(1 + b.cfg.workers)
	go b.accept()
	for range b.cfg.workers {
		go b.worker()
	}
	return b.self.marshal(), nil
}

// hostIdentity names this boot of this host, its PID namespace (process IDs
// in connection information mean the same process to both sides) and its
// network namespace (abstract sockets live there).
func hostIdentity() [8]byte { return hostid.Of("pid", "net") }

// ptraceScope reads kernel.yama.ptrace_scope, or -1 without Yama.
func ptraceScope() int {
	b, err := os.ReadFile("/proc/sys/kernel/yama/ptrace_scope")
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return -1
	}
	return n
}

func (b *Backend) probeAddr() uint64 { return uint64(uintptr(unsafe.Pointer(b.probe))) }

// Reachable implements agent.Backend. The peer must publish cma connection
// information with this host's identity (same boot, PID and network
// namespaces) and must let this process read its memory. The first call for
// a peer connects to it and proves that with a trial process_vm_readv; the
// verdict is cached, so later calls cost a map lookup. That probe does local
// I/O, bounded by WithTimeout and run by the backend, not the caller: every
// caller, the first included, waits for the verdict only until its ctx ends,
// and then returns an error wrapping context.Cause(ctx). A failed verdict
// stands for 30 s: a peer that accepts and never answers costs one
// WithTimeout per 30 s, not one per call. Permission cannot be judged from
// the metadata alone, and judging it later would be too late to fall back.
//
// Under Yama mode 1 the peer lets this process read it only once it names
// it its ptracer, which it does only for a process that presents a key of
// one of its exposures: the agent calls ReachableWithKey for transfers.
func (b *Backend) Reachable(ctx context.Context, info agent.Info) error {
	return b.reach(ctx, info, agent.Key{}, 0)
}

// ReachableWithKey implements agent.KeyedReacher: Reachable for a transfer
// under key with access acc. The probe's handshake presents the key, so
// that under Yama mode 1 the peer may name this process its ptracer. A
// verdict that failed for want of a valid key does not stand against a call
// with another key.
func (b *Backend) ReachableWithKey(ctx context.Context, info agent.Info, key agent.Key, acc agent.Access) error {
	return b.reach(ctx, info, key, acc)
}

func (b *Backend) reach(ctx context.Context, info agent.Info, key agent.Key, acc agent.Access) error {
	raw, ok := info.Conn(Name)
	if !ok {
		return errors.New("peer has no cma backend")
	}
	if b.ln == nil {
		return errors.New("cma backend not started")
	}
	if len(raw) >= 9 && [8]byte(raw[1:9]) != b.self.host {
		return errors.New("peer runs on another host, or in another PID or network namespace")
	}
	// At most a few rounds: a probe started by a caller with another key,
	// or none, may fail where this caller's key would pass.
	var verdict error
	for range 3 {
		p, err := b.peerWith(info.ID, raw, key, acc)
		if err != nil {
			return err
		}
		select {
		case <-p.ready:
		case <-ctx.Done():
			return fmt.Errorf("probe of peer %s still running: %w", info.ID, context.Cause(ctx))
		}
		if verdict = p.verdict; verdict == nil || !p.keyMayHelp(key) {
			break
		}
	}
	return verdict
}

// peerWith returns the peer named by id and raw connection information. If
// no connection, probe or standing verdict exists, or the verdict failed
// for want of a key and key is another, it starts a probe presenting key
// on a goroutine of the backend's; callers wait on the peer's ready
// channel.
func (b *Backend) peerWith(id uuid.UUID, raw []byte, key agent.Key, acc agent.Access) (*peer, error) {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil, agent.ErrClosed
	}
	for _, p := range b.peers[id] {
		if bytes.Equal(p.raw, raw) {
			if !p.expired(b.retry) && !p.keyMayHelp(key) {
				b.mu.Unlock()
				return p, nil
			}
			b.drop(p)
			break
		}
	}
	b.sweep()
	ci, err := parseConnInfo(raw)
	if err != nil {
		b.mu.Unlock()
		return nil, err
	}
	// Peers are keyed by identity and socket together: a token that claims a
	// known agent's identity at another socket gets a connection of its own
	// and never redirects anyone else's transfers.
	p := &peer{b: b, id: id, raw: bytes.Clone(raw), ci: ci, key: key, acc: acc, ready: make(chan struct{}), dead: make(chan struct{}), waiting: map[uint64]*window{}}
	b.peers[id] = append(b.peers[id], p)
	b.wg.Add(1) // connect's, then the reader's
	b.mu.Unlock()
	go p.connect()
	return p, nil
}

// sweep drops the expired verdicts of every peer, once per retry period,
// so that peers no transfer names again do not pile up. The caller holds
// b.mu.
func (b *Backend) sweep() {
	if time.Since(b.swept) < b.retry {
		return
	}
	b.swept = time.Now()
	for _, ps := range b.peers {
		for _, p := range ps {
			if p.expired(b.retry) {
				b.drop(p)
			}
		}
	}
}

// forget removes p from the peers, so that the next transfer connects
// afresh.
func (b *Backend) forget(p *peer) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.drop(p)
}

// drop removes p from the peers. The caller holds b.mu.
func (b *Backend) drop(p *peer) {
	ps := b.peers[p.id]
	for i, q := range ps {
		if q == p {
			ps = append(ps[:i:i], ps[i+1:]...)
			break
		}
	}
	if len(ps) == 0 {
		delete(b.peers, p.id)
	} else {
		b.peers[p.id] = ps
	}
}

func (b *Backend) track(c *net.UnixConn) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return false
	}
	b.conns[c] = struct{}{}
	return true
}

func (b *Backend) untrack(c *net.UnixConn) {
	b.mu.Lock()
	delete(b.conns, c)
	b.mu.Unlock()
}

// Close implements agent.Backend: it stops listening, closes every
// connection, fails what is still in flight with
// agent.ErrClosed, and waits for the backend's goroutines.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	close(b.quit)
	var peers []*peer
	for _, ps := range b.peers {
		peers = append(peers, ps...)
	}
	for p := range b.live {
		peers = append(peers, p)
	}
	conns := make([]*net.UnixConn, 0, len(b.conns))
	for c := range b.conns {
		conns = append(conns, c)
	}
	b.mu.Unlock()
	if b.ln == nil {
		return nil
	}
	err := b.ln.Close()
	for _, c := range conns {
		_ = c.Close() // the peer sees the end of the stream: this agent is gone
	}
	for _, p := range peers {
		<-p.ready
		p.fail(agent.ErrClosed)
	}
	b.xwg.Wait()
	close(b.stop)
	b.wg.Wait()
	return err
}

// peerCred returns the process ID of the socket's other end, as the kernel
// recorded it when that end connected or listened.
func peerCred(c *net.UnixConn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, err
	}
	if cerr != nil {
		return 0, cerr
	}
	return int(cred.Pid), nil
}

// PeerDeparted implements agent.Departer: the control connections to agent
// id are closed, so lease requests waiting on a peer that may be frozen
// rather than dead fail with cause at once instead of at the timeout. The
// next transfer to it connects afresh.
func (b *Backend) PeerDeparted(id uuid.UUID, cause error) {
	b.mu.Lock()
	var gone []*peer
	for _, p := range slices.Clone(b.peers[id]) {
		select {
		case <-p.ready:
			gone = append(gone, p)
		default:
			// Probing: its verdict reaches only the callers already
			// waiting, and its reader, if it connects, fails it at once
			// (read checks departed under b.mu too).
			p.departed = cause
			b.drop(p)
		}
	}
	b.mu.Unlock()
	for _, p := range gone {
		p.fail(fmt.Errorf("cma: peer %s departed: %w", id, cause))
	}
}
