package tcp

import (
	"time"
)

// wlock is a connection's write lock: whoever holds it writes whole frames.
// It is a one-slot semaphore rather than a mutex so that a goroutine
// waiting for it can give up (its transfer cancelled, its peer failed, its
// lease's time up) instead of waiting at the pace of a peer that does not
// read what another frame is writing. It may be released by a goroutine
// other than the one that took it.
type wlock chan struct{}

func newWlock() wlock { return make(wlock, 1) }

func (l wlock) lock() { l <- struct{}{} }

func (l wlock) unlock() { <-l }

func (l wlock) tryLock() bool {
	select {
	case l <- struct{}{}:
		return true
	default:
		return false
	}
}

// lockOr takes the lock, or gives up when one of a, b and c (a nil one
// never) is closed first, and reports that it did.
func (l wlock) lockOr(a, b, c <-chan struct{}) bool {
	if l.tryLock() {
		return true
	}
	select {
	case l <- struct{}{}:
		return true
	case <-a:
	case <-b:
	case <-c:
	}
	return false
}

// lockBy takes the lock, or gives up at deadline and reports that it did.
func (l wlock) lockBy(deadline time.Time) bool {
	if l.tryLock() {
		return true
	}
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case l <- struct{}{}:
		return true
	case <-t.C:
		return false
	}
}
