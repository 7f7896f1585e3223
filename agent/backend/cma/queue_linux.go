//go:build linux

package cma

import (
	"context"
	"fmt"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
)

// send queues one frame for the writer: header, table, payload. It never
// waits for the socket. Frames of a failed peer are dropped: the end of
// the connection says what they would have.
func (p *peer) send(h *header, table func(b []byte) []byte, payload []byte) {
	p.qmu.Lock()
	defer p.qmu.Unlock()
	if p.broken.Load() {
		return
	}
	p.enqueue(h, table, payload)
}

// enqueue appends a frame to the queue and wakes the writer. The caller
// holds p.qmu.
func (p *peer) enqueue(h *header, table func(b []byte) []byte, payload []byte) {
	n := len(p.q)
	p.q = slices.Grow(p.q, hdrSize+len(payload))[:n+hdrSize]
	h.put(p.q[n:])
	if table != nil {
		p.q = table(p.q)
	}
	p.q = append(p.q, payload...)
	if p.qwake == nil {
		p.qwake = make(chan struct{}, 1)
	}
	select {
	case p.qwake <- struct{}{}:
	default:
	}
}

// writer sends the queued frames, in order, until the peer fails. The
// queue holds at most a request and an end per lease request in flight
// (limit), the notifications of finished transfers, and at most
// maxQueuedNotify bytes of Notify's.
func (p *peer) writer() {
	defer p.b.wg.Done()
	p.qmu.Lock()
	if p.qwake == nil {
		p.qwake = make(chan struct{}, 1)
	}
	wake := p.qwake
	p.qmu.Unlock()
	var out []byte
	for {
		select {
		case <-wake:
		case <-p.dead:
			return
		}
		p.qmu.Lock()
		if p.writing {
			p.qmu.Unlock()
			continue // sendNow writes; it wakes us after if frames wait
		}
		out, p.q = p.q, out[:0]
		notes := p.qnew
		p.qnew = 0
		p.writing = len(out) > 0
		p.qmu.Unlock()
		if len(out) == 0 {
			continue
		}
		_ = p.c.SetWriteDeadline(time.Now().Add(p.b.cfg.timeout))
		if p.broken.Load() { // after the deadline: fail's wins
			return
		}
		if _, err := p.c.Write(out); err != nil {
			if !p.broken.Load() {
				p.b.dropped(err, false, "peer", p.id)
			}
			p.fail(fmt.Errorf("cma: write to peer %s: %w: %w", p.id, agent.ErrRemoteLost, err))
			return
		}
		p.qmu.Lock()
		p.writing = false
		if notes > 0 {
			p.qnote -= notes
			if p.qroom != nil {
				close(p.qroom)
				p.qroom = nil
			}
			if p.qnote == 0 {
				p.notesSentLocked()
			}
		}
		more := len(p.q) > 0
		p.qmu.Unlock()
		if more {
			select {
			case wake <- struct{}{}:
			default:
			}
		}
		if cap(out) > 1<<20 {
			out = nil // a burst passed; do not keep its buffer
		}
	}
}

// maxQueuedNotify bounds the bytes of notifications Notify queues for one
// peer's connection: a peer that stops reading does not grow this process
// without bound. A transfer's own notification is queued past it (it is
// bounded by the transfers in flight, and the goroutine finishing a
// transfer may be the connection's reader, which must never wait).
const maxQueuedNotify = 4 << 20

// notify queues a transfer's notification, without waiting.
func (p *peer) notify(key agent.Key, msg []byte) error {
	return p.queueNotify(context.Background(), key, msg, false)
}

// queueNotify queues a notification. If wait, it first waits, for at most
// the timeout and until ctx is done, until the notifications already queued
// leave room for it under maxQueuedNotify.
func (p *peer) queueNotify(ctx context.Context, key agent.Key, msg []byte, wait bool) error {
	if len(msg) > p.b.cfg.maxNotify {
		return fmt.Errorf("%w: notification of %d bytes, at most %d", agent.ErrInvalid, len(msg), p.b.cfg.maxNotify)
	}
	var timer *time.Timer
	for {
		p.qmu.Lock()
		if p.broken.Load() {
			p.qmu.Unlock()
			return p.failure()
		}
		if !wait && !p.writing && len(p.q) == 0 {
			// An idle socket: the notification goes out from this
			// goroutine, with no writer to wake.
			p.sendNow(&header{typ: tNotify, length: uint32(len(msg)), key: key}, msg)
			p.qmu.Unlock()
			return nil
		}
		if !wait || p.qnote == 0 || p.qnote+len(msg) <= maxQueuedNotify {
			// Queued after the ends of the transfer's leases: the exposing
			// side handles frames in order, so the notification never
			// overtakes them.
			p.enqueue(&header{typ: tNotify, length: uint32(len(msg)), key: key}, nil, msg)
			p.qnote += hdrSize + len(msg)
			p.qnew += hdrSize + len(msg)
			p.qmu.Unlock()
			return nil
		}
		if p.qroom == nil {
			p.qroom = make(chan struct{})
		}
		room, queued := p.qroom, p.qnote
		p.qmu.Unlock()
		if timer == nil {
			timer = time.NewTimer(p.b.cfg.timeout)
			defer timer.Stop()
		}
		select {
		case <-room:
		case <-p.dead:
			return p.failure()
		case <-timer.C:
			return fmt.Errorf("cma: peer %s: %d bytes of notifications still queued after %v, at most %d may be: %w",
				p.id, queued, p.b.cfg.timeout, maxQueuedNotify, agent.ErrRemoteLost)
		case <-ctx.Done():
			return fmt.Errorf("cma: notify peer %s: %d bytes of notifications still queued, at most %d may be: %w",
				p.id, queued, maxQueuedNotify, context.Cause(ctx))
		}
	}
}

// Notify implements [agent.Backend]. It queues msg for the connection's
// writer and returns; it never connects (the agent chose cma because
// Reachable found the peer connected, and Notify fails at once if that
// connection ended since). While 4 MiB of notifications to the peer are
// still unsent it waits for room, for at most WithTimeout, and returns once
// ctx is done with an error wrapping context.Cause(ctx). msg is copied
// before Notify returns. Safe for concurrent use.
func (b *Backend) Notify(ctx context.Context, info agent.Info, key agent.Key, msg []byte) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("cma: notify peer %s: %w", info.ID, context.Cause(ctx))
	}
	p, err := b.usable(info)
	if err != nil {
		return err
	}
	defer b.xwg.Done()
	return p.queueNotify(ctx, key, msg, true)
}

// sendNow writes one frame (h, payload) to the socket from the calling
// goroutine, without waiting: what the socket does not take at once is
// queued for the writer, ahead of any frame queued meanwhile. The caller
// holds p.qmu, with the queue empty and no write under way; sendNow
// releases it and takes it back.
func (p *peer) sendNow(h *header, payload []byte) {
	var buf [hdrSize + 256]byte
	b := buf[:hdrSize]
	h.put(b)
	b = append(b, payload...)
	p.writing = true
	p.qmu.Unlock()
	n := 0
	if rc, err := p.c.SyscallConn(); err == nil {
		_ = rc.Write(func(fd uintptr) bool {
			for n < len(b) {
				k, err := unix.SendmsgN(int(fd), b[n:], nil, nil, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
				if err == unix.EINTR {
					continue
				}
				if err != nil || k <= 0 {
					break
				}
				n += k
			}
			return true
		})
	}
	p.qmu.Lock()
	p.writing = false
	if n < len(b) {
		// The rest (all of it, on any failure: the writer reports that),
		// before anything queued since: notification bytes still to send.
		p.q = append(append([]byte(nil), b[n:]...), p.q...)
		p.qnote += len(b) - n
		p.qnew += len(b) - n
	}
	if len(p.q) > 0 {
		if p.qwake == nil {
			p.qwake = make(chan struct{}, 1)
		}
		select {
		case p.qwake <- struct{}{}:
		default:
		}
	}
}

// notesSentLocked tells flush that no notification is queued or being
// written by the writer. The caller holds p.qmu.
func (p *peer) notesSentLocked() {
	if p.qidle != nil {
		close(p.qidle)
		p.qidle = nil
	}
}

// flush waits until the notifications queued for the peer (those of
// transfers that already succeeded, above all) have been written, the
// peer fails, or deadline passes: Close calls it before it closes the
// connections, so that a Close right after a transfer's Wait does not cut
// off its notification (agent.Work.FinishNotify). A notification written
// straight to an idle socket (sendNow) was whole when its transfer's
// notify returned.
func (p *peer) flush(deadline time.Time) {
	p.qmu.Lock()
	if p.broken.Load() || p.qnote == 0 {
		p.qmu.Unlock()
		return
	}
	if p.qidle == nil {
		p.qidle = make(chan struct{})
	}
	idle := p.qidle
	p.qmu.Unlock()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-idle:
	case <-p.dead:
	case <-t.C:
	}
}
