//go:build linux

package cma

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
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
	"github.com/goxfer/goxfer/agent/backend/internal/serve"
	"github.com/goxfer/goxfer/internal/hostid"
	"github.com/goxfer/goxfer/internal/oneline"
)

// Backend is the cross-memory-attach backend: an [agent.Backend] that is
// also an [agent.KeyedReacher], an [agent.Departer], [agent.Counting] and
// an [agent.DeviceStager] and an [agent.Publisher].
// Create one per agent with [New] and hand it to [agent.WithBackends]; the
// agent starts and closes it, and it serves that agent only. Safe for
// concurrent use.
type Backend struct {
	cfg    config
	optErr error

	host  agent.Host
	log   *slog.Logger // the host's
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

	mu     sync.Mutex
	closed bool
	peers  map[uuid.UUID][]*peer // by agent ID; several when tokens disagree on the socket
	live   map[*peer]struct{}    // peers with a reader, listed or not: Close fails them

	// Accepted connections and their goroutines, and dialled ones until
	// their reader starts: what Close closes and waits for.
	conns serve.Set[*net.UnixConn]
	byPID *serve.Caps[int] // accepted connections from each process
	gate  *serve.Gate      // accepted connections still in the handshake

	stats serve.Counters

	// The backend's lifetime: the host's, also cancelled when Close begins
	// (the agent cancels it just before, a test calling Close may not).
	// Probes in flight give up, and the accept loop closes the listener.
	ctx    context.Context
	cancel context.CancelCauseFunc

	tasks chan task
	xwg   sync.WaitGroup // transfers and notifications in flight
	wg    sync.WaitGroup // goroutines but the accepted connections' (conns)
	stop  chan struct{}  // closed when the last transfer is done: workers exit

	dev devState // the agent's device driver, for the device path (ipc_linux.go)
	pub shmPub   // exposures published in shared memory (shm_linux.go)

	retry time.Duration // how long a failed verdict stands: retryFailed
	swept time.Time     // when expired verdicts were last dropped
}

// New returns a cross-memory-attach backend for one agent, configured by
// opts (each option names its default). Invalid options are reported by
// Start, that is by [agent.New], with an error wrapping
// [agent.ErrInvalidOption].
func New(opts ...Option) *Backend {
	b := &Backend{cfg: defaults(), peers: map[uuid.UUID][]*peer{}, stop: make(chan struct{}),
		retry: retryFailed, readScope: ptraceScope, ptracers: ptracers, readv: processVMReadv}
	var errs []error
	for _, o := range opts {
		if o == nil {
			errs = append(errs, fmt.Errorf("%w: cma: nil option", agent.ErrInvalidOption))
			continue
		}
		if err := o.apply(&b.cfg); err != nil {
			errs = append(errs, err)
		}
	}
	b.optErr = oneline.Join(errs...)
	// A failing option changed nothing: the limits are valid.
	b.stats.Classes = serve.Classes{Limit: errLimit, Protocol: errProtocol}
	b.byPID = serve.NewCaps[int](b.cfg.maxConnsPerProc)
	b.gate = serve.NewGate(b.cfg.maxHandshakes)
	b.lim = limits{maxRanges: b.cfg.maxRanges, maxNotify: b.cfg.maxNotify}
	return b
}

// Name implements [agent.Backend]: [Name].
func (b *Backend) Name() string { return Name }

// Stats implements [agent.Counting]: the backend's counters since it
// started. Safe for concurrent use, also after Close.
func (b *Backend) Stats() Stats { return b.stats.Stats() }

// Supports implements [agent.Backend]: host memory ([agent.KindDRAM])
// only.
func (b *Backend) Supports(k agent.MemKind) bool { return k == agent.KindDRAM }

// Start implements [agent.Backend]: it listens on a socket in the abstract
// namespace and starts the accept loop and the copy workers, which run
// until Close; h's Context ending stops probes and the accept loop first.
// It returns what peers need to reach this agent: the host's identity,
// this process's ID and the socket's name.
func (b *Backend) Start(h agent.Host) ([]byte, error) {
	if b.optErr != nil {
		return nil, b.optErr
	}
	b.host, b.log, b.id, b.pid = h, h.Logger(), h.ID(), os.Getpid()
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	name := fmt.Sprintf("goxfer-cma/%d/%s/%x", b.pid, b.id, rnd)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@" + name, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("cma: listen on abstract socket %q: %w", name, err)
	}
	ln.SetUnlinkOnClose(false)
	b.ln = ln
	b.ctx, b.cancel = context.WithCancelCause(h.Context())
	b.probe = new([16]byte)
	_, _ = rand.Read(b.probe[:])
	b.scope = b.readScope()
	b.self = connInfo{host: hostIdentity(), pid: uint32(b.pid), sock: name}
	b.tasks = make(chan task, 4*b.cfg.workers)
	b.wg.Add(1 + b.cfg.workers)
	go func() {
		defer b.wg.Done()
		serve.Accept(b.ctx, ln, b.log, b.admit) // closes ln when b.ctx ends
	}()
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

// closeFlush bounds how long Close lets the connections' writers send the
// notifications still queued.
const closeFlush = time.Second

// Close implements [agent.Backend]: it ends the backend's lifetime, stops
// listening, lets each connection's writer send the notifications still
// queued (those of transfers that succeeded, above all), within a second
// or WithTimeout if shorter, in all,
// closes every connection, fails what is still in flight with
// [agent.ErrClosed], waits for transfers and notifications in flight to
// finish, then for the backend's goroutines. Later calls do nothing.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	if b.cancel != nil {
		b.cancel(agent.ErrClosed)
	}
	var peers []*peer
	for _, ps := range b.peers {
		peers = append(peers, ps...)
	}
	for p := range b.live {
		peers = append(peers, p)
	}
	b.mu.Unlock()
	// The notifications of transfers that succeeded go out first (the
	// agent waited for them to be queued), within closeFlush in all: a
	// peer that has not read them by then has stopped reading.
	flushBy := time.Now().Add(min(b.cfg.timeout, closeFlush))
	for _, p := range peers {
		select {
		case <-p.ready:
			p.flush(flushBy)
		default: // still connecting: nothing was sent to it
		}
	}
	conns, _ := b.conns.Stop()
	if b.ln == nil {
		return nil
	}
	err := b.ln.Close() // the accept loop closed it already if b.ctx ended first
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
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
	b.conns.Wait()
	if b.dev.drv != nil {
		b.dev.close()
	}
	return err
}

// dropped counts a connection ended by err on its peer's account, which
// broke off a handshake if inHandshake, and logs it at level Debug with
// args; it reports whether err was the peer's fault
// ([serve.Counters.Dropped]).
func (b *Backend) dropped(err error, inHandshake bool, args ...any) bool {
	if _, ok := b.stats.Dropped(err, inHandshake); !ok {
		return false
	}
	b.log.Debug("cma: dropped a connection", append(args, "err", err)...)
	return true
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

// PeerDeparted implements [agent.Departer]: the control connections to
// agent id are closed, so lease requests waiting on a peer that may be frozen
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

// StagesDevice implements [agent.DeviceStager]: true. cma copies a peer's
// memory only under the leases the peer grants, so the peer's agent stages
// its device memory through pinned host buffers and its grant names them
// (the protocol's staged grants); this side's device memory is staged by
// this agent before cma sees it.
func (b *Backend) StagesDevice() bool { return true }

// sameUser reports whether the process behind c runs as this process's
// user (or as root): only such a peer is offered shared segments, the
// same peers that could read this process's memory with cross-memory
// attach.
func sameUser(c *net.UnixConn) bool {
	rc, err := c.SyscallConn()
	if err != nil {
		return false
	}
	var cred *unix.Ucred
	if err := rc.Control(func(fd uintptr) {
		cred, _ = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil || cred == nil {
		return false
	}
	return cred.Uid == uint32(os.Getuid()) || cred.Uid == 0
}
