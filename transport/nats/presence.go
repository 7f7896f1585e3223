package nats

import (
	"context"
	"sync"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/connect"
)

// Presence is an arrival (Departed false) or departure of an agent, as
// [Registry.Watch] reports it; a plain value. Info is the zero
// [connect.AgentInfo] for a departure of an agent the Registry never saw
// arrive.
type Presence struct {
	ID       uuid.UUID
	Info     connect.AgentInfo
	Departed bool
}

// Watch reports arrivals and departures on the returned channel, starting
// with an arrival for every agent present now (sorted by ID), until ctx is
// done or the Registry closes; then the channel is closed (at once after
// Close). Events are queued for a slow reader, never dropped, so keep
// reading until the channel closes or ctx is done: the queue is unbounded.
// Each Watch owns a goroutine, ended with its channel. Safe for concurrent
// use.
func (r *Registry) Watch(ctx context.Context) <-chan Presence {
	q := &presenceQueue{ch: make(chan Presence), wake: make(chan struct{}, 1)}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		close(q.ch)
		return q.ch
	}
	for _, id := range r.liveIDsLocked() {
		q.push(Presence{ID: id, Info: r.live[id].info})
	}
	r.watches[q] = struct{}{}
	r.wg.Add(1)
	r.mu.Unlock()
	go r.forward(ctx, q)
	return q.ch
}

// notifyLocked queues p for every Watch; r.mu is held.
func (r *Registry) notifyLocked(p Presence) {
	for q := range r.watches {
		q.push(p)
	}
}

// forward is a Watch's goroutine: it hands queued events to the reader.
func (r *Registry) forward(ctx context.Context, q *presenceQueue) {
	defer r.wg.Done()
	defer close(q.ch)
	defer func() {
		r.mu.Lock()
		delete(r.watches, q)
		r.mu.Unlock()
	}()
	for {
		for {
			p, ok := q.pop()
			if !ok {
				break
			}
			select {
			case q.ch <- p:
			case <-ctx.Done():
				return
			case <-r.ctx.Done():
				return
			}
		}
		select {
		case <-q.wake:
		case <-ctx.Done():
			return
		case <-r.ctx.Done():
			return
		}
	}
}

// presenceQueue is an unbounded queue of events for one Watch.
type presenceQueue struct {
	ch   chan Presence
	wake chan struct{}

	mu sync.Mutex
	q  []Presence
}

func (q *presenceQueue) push(p Presence) {
	q.mu.Lock()
	q.q = append(q.q, p)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *presenceQueue) pop() (Presence, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.q) == 0 {
		return Presence{}, false
	}
	p := q.q[0]
	q.q[0] = Presence{}
	q.q = q.q[1:]
	return p, true
}
