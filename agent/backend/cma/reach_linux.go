//go:build linux

package cma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
)

// retryFailed is how long a peer's failed verdict (unreachable, silent,
// not permitted) stands before a transfer probes it again: a peer that
// never answers costs one WithTimeout per period, not one per transfer,
// and a peer whose permissions change is tried again within it.
const retryFailed = 30 * time.Second

// Reachable implements [agent.Backend]. The peer must publish cma connection
// information with this host's identity (same boot, PID and network
// namespaces; a peer elsewhere is out of reach, [agent.ErrOutOfReach]) and
// must let this process read its memory. The first call for
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

// ReachableWithKey implements [agent.KeyedReacher]: Reachable for a transfer
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
		return agent.OutOfReach("peer runs on another host, or in another PID or network namespace")
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

// expired reports whether p holds a failed verdict older than retry. The
// caller holds p.b.mu.
func (p *peer) expired(retry time.Duration) bool {
	select {
	case <-p.ready:
		return p.verdict != nil && time.Since(p.failed) >= retry
	default:
		return false // probing
	}
}

// keyMayHelp reports whether p's probe failed for want of a valid key and
// key, which it did not present, might pass.
func (p *peer) keyMayHelp(key agent.Key) bool {
	select {
	case <-p.ready:
		return key != (agent.Key{}) && key != p.key && errors.Is(p.verdict, errNeedKey)
	default:
		return false
	}
}

// errNotPermitted marks a peer this process may not read: the probe failed.
var errNotPermitted = errors.New("cross-memory attach not permitted")

// errNeedKey marks a probe that failed, under Yama mode 1, because the
// handshake presented no key, or one the peer refused: a probe with
// another key may pass.
var errNeedKey = errors.New("the peer names a ptracer only for a key of its exposures")

// probePeer tries the access every transfer will need: reading the peer's
// memory from this process.
func (b *Backend) probePeer(pid int, in handshake) error {
	var got [16]byte
	l := []unix.Iovec{{Base: &got[0], Len: uint64(len(got))}}
	r := []unix.RemoteIovec{{Base: uintptr(in.probe), Len: len(got)}}
	n, err := b.readv(pid, l, r)
	switch {
	case errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES):
		err = fmt.Errorf("%w: a trial process_vm_readv of process %d failed: %v; %s", errNotPermitted, pid, err, scopeHint(in.scope, in.ptracer))
		if in.scope == 1 && (in.ptracer == ptrNoKey || in.ptracer == ptrRefused) {
			err = fmt.Errorf("%w (%w)", err, errNeedKey)
		}
		return err
	case errors.Is(err, unix.ENOSYS):
		return fmt.Errorf("%w: process_vm_readv is not available (%v)", errNotPermitted, err)
	case err != nil:
		return fmt.Errorf("%w: a trial process_vm_readv of process %d failed: %v", errNotPermitted, pid, err)
	case n != len(got) || got != in.nonce:
		return fmt.Errorf("%w: a trial process_vm_readv of process %d read %d bytes %x, its handshake promised %x", errNotPermitted, pid, n, got[:n], in.nonce)
	}
	return nil
}

func processVMReadv(pid int, l []unix.Iovec, r []unix.RemoteIovec) (int, error) {
	return unix.ProcessVMReadv(pid, l, r, 0)
}

// scopeHint explains a denied probe from the host's Yama mode and the
// peer's ptracer answer, as the peer reported them.
func scopeHint(scope, ptracer uint8) string {
	switch scope {
	case 1:
		switch ptracer {
		case ptrNoKey:
			return "kernel.yama.ptrace_scope is 1 and the peer names as its ptracer only a process that presents a key of one of its exposures; this one presented none"
		case ptrRefused:
			return "kernel.yama.ptrace_scope is 1 and the peer refused the key presented for its ptracer exception (unknown, revoked, or exposed for the other access)"
		case ptrHeld:
			return "kernel.yama.ptrace_scope is 1 and the peer's one ptracer exception is held by another process connected to it"
		case ptrNamed:
			return "kernel.yama.ptrace_scope is 1; the peer named this process its ptracer, yet the kernel refused"
		}
		return "kernel.yama.ptrace_scope is 1 and the peer has not named this process as its ptracer (it runs with cma.WithPtracer(false))"
	case 2:
		return "kernel.yama.ptrace_scope is 2: only processes with CAP_SYS_PTRACE may attach"
	case 3:
		return "kernel.yama.ptrace_scope is 3: attaching is disabled on this host"
	}
	return "the processes run as different users, or the peer is not dumpable, and this process lacks CAP_SYS_PTRACE"
}

// usable returns the connected peer info names and counts a user of the
// backend in xwg, which the caller releases. The agent chose this backend
// because Reachable found the peer connected; if that connection ended
// since (the peer departed, failed) and no other is up, the transfer fails
// at once rather than wait, without the caller's context, for a new probe.
func (b *Backend) usable(info agent.Info) (*peer, error) {
	raw, _ := info.Conn(Name)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, agent.ErrClosed
	}
	var p *peer
	for _, q := range b.peers[info.ID] {
		if bytes.Equal(q.raw, raw) {
			p = q
			break
		}
	}
	if p == nil {
		return nil, fmt.Errorf("cma: peer %s: %w: its connection ended after cma was chosen", info.ID, agent.ErrRemoteLost)
	}
	select {
	case <-p.ready:
	default:
		return nil, fmt.Errorf("cma: peer %s: %w: its connection ended after cma was chosen, and a new one is being probed", info.ID, agent.ErrRemoteLost)
	}
	if p.verdict != nil {
		return nil, p.verdict
	}
	b.xwg.Add(1)
	return p, nil
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
