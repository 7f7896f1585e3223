package agent

import (
	"sync"
	"sync/atomic"
)

// Parts finishes a transfer that a backend moves in parts (frames, leases,
// chunks) from several goroutines, by the rules every backend keeps:
//
//   - the first error any part reports is the transfer's outcome;
//   - a transfer cancelled before it finished never reports success, even
//     if every part went through;
//   - [Work.Finish] is called exactly once, after the last part;
//   - the notification, if any, goes out only once every part is done and
//     successful, right after Finish, on the same goroutine: the active
//     side's waiter is released first (ARCHITECTURE semantic 2: the active
//     Wait returns, then the passive side is notified). [Agent.Close] waits
//     for it before it stops the backends. A notification that fails is
//     counted in [Stats].LostNotifications and logged; it cannot fail a
//     transfer that already succeeded, and the passive side learns of the
//     loss as of a lost peer (the failure that stopped the notification
//     breaks the connection to it).
//
// A backend embeds or allocates one per transfer and calls Init before
// sharing it. The zero value is not usable. Methods are safe for concurrent
// use.
type Parts struct {
	w        *Work
	notify   func(key Key, msg []byte) error
	finished func()
	refs     atomic.Int64

	mu  sync.Mutex
	err error
}

// Init prepares p for w with one reference, held by the caller (usually
// the goroutine that posts the parts), which it drops with Done like any
// part's. notify delivers w.Notify to the peer; it is not called when
// w.Notify is nil. finished, if not nil, runs after w.Finish, for example
// to mark a backend's goroutine or transfer done.
func (p *Parts) Init(w *Work, notify func(key Key, msg []byte) error, finished func()) {
	p.w, p.notify, p.finished = w, notify, finished
	p.refs.Store(1)
}

// Work returns the transfer p finishes.
func (p *Parts) Work() *Work { return p.w }

// Add counts one more part in flight; each Add is matched by one Done.
func (p *Parts) Add() { p.refs.Add(1) }

// Fail records err as the outcome unless an error came first. The
// transfer still finishes only once every part is done.
func (p *Parts) Fail(err error) {
	p.mu.Lock()
	if p.err == nil {
		p.err = err
	}
	p.mu.Unlock()
}

// Failed reports whether an error was recorded: parts not yet started
// need not be.
func (p *Parts) Failed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err != nil
}

// Done ends one part, with err if it failed. The last Done finishes the
// transfer on the calling goroutine: it calls [Work.Finish], then sends
// the notification, if any.
func (p *Parts) Done(err error) {
	if err != nil {
		p.Fail(err)
	}
	if p.refs.Add(-1) == 0 {
		p.finish()
	}
}

func (p *Parts) finish() {
	if p.finished != nil {
		defer p.finished()
	}
	p.mu.Lock()
	err := p.err
	p.mu.Unlock()
	w := p.w
	if err == nil {
		select {
		case <-w.Cancelled():
			err = w.CancelErr()
		default:
		}
	}
	if err == nil && w.Notify != nil {
		w.FinishNotify(p.notify)
		return
	}
	w.Finish(err)
}
