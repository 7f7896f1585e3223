package serve

import (
	"io"
	"sync"
)

// Set tracks what a backend's Close must end: its live connections (of any
// comparable type: a net.Conn, or the backend's own wrapper of one) and the
// goroutines that serve them. Until Stop, Add, Serve, Admit and Go take new
// ones; from Stop on they refuse them, Stop hands back the members for the caller
// to close (its own way: a goodbye first, say), and Wait waits for the
// goroutines.
//
// A backend's Close thus reads:
//
//	members, first := set.Stop()
//	if !first {
//		return nil
//	}
//	for _, c := range members {
//		_ = c.Close()
//	}
//	… // whatever else must end before the goroutines do
//	set.Wait()
//
// The zero Set is empty and ready to use. A Set must not be copied after
// first use. Safe for concurrent use; its methods never call out while they
// hold its lock, so a caller may use it under a lock of its own. (Admit
// takes a Gate's lock under the Set's; a Gate never takes a Set's.)
type Set[C comparable] struct {
	mu      sync.Mutex
	members map[C]struct{}
	running int           // goroutines started by Go and Serve, not yet returned
	stopped bool          // Stop was called
	done    chan struct{} // closed by Stop; made on demand
	idle    chan struct{} // closed once stopped with none running; made on demand
}

// Add tracks c, unless the set is stopped: it reports whether it did. A
// member stays until Remove, or until the goroutine Serve started for it
// returns. Adding a member twice tracks it once.
func (s *Set[C]) Add(c C) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return false
	}
	s.addLocked(c)
	return true
}

func (s *Set[C]) addLocked(c C) {
	if s.members == nil {
		s.members = map[C]struct{}{}
	}
	s.members[c] = struct{}{}
}

// Remove stops tracking c; Stop will not hand it back. It does nothing if c
// is not a member.
func (s *Set[C]) Remove(c C) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.members, c)
}

// Go runs f on a goroutine of its own, which Wait waits for, unless the set
// is stopped: it reports whether it did. f may call Go itself, and is
// refused as anyone else is once the set is stopped.
func (s *Set[C]) Go(f func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return false
	}
	s.running++
	go func() {
		defer s.exit()
		f()
	}()
	return true
}

// Serve tracks c and runs f(c) on a goroutine of its own, which Wait waits
// for, unless the set is stopped: it reports whether it did, and either
// does both or neither. c stops being a member when f returns, if not
// before (Remove). If Serve reports false, c is still the caller's to
// close.
func (s *Set[C]) Serve(c C, f func(C)) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return false
	}
	s.addLocked(c)
	s.running++
	go func() {
		defer s.exitMember(c)
		f(c)
	}()
	return true
}

// Admit admits an accepted connection c in one step that Stop is ordered
// against: unless the set is stopped, c enters the handshake gate g (conn
// is what g closes to evict it: c itself, or the connection c wraps), and
// f(c, pass) runs on a goroutine of its own, c tracked meanwhile, as Serve
// does. If g was full, the oldest connection inside is evicted to make room
// (Gate.Enter), which Admit closes before it returns and reports: the
// eviction is the caller's to count and report, as Enter's is.
//
// If the set is stopped, Admit does nothing, reports !ok, and c is still
// the caller's to close. So once Stop has returned, no admission evicts a
// connection, nor is counted against its peer: the connections in their
// handshake are the closing backend's to close (Stop hands them back), and
// an eviction Admit reports happened before Stop.
func (s *Set[C]) Admit(g *Gate, c C, conn io.Closer, f func(C, *Pass)) (evicted, ok bool) {
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		return false, false
	}
	p, victim := g.enter(conn)
	s.addLocked(c)
	s.running++
	go func() {
		defer s.exitMember(c)
		f(c, p)
	}()
	s.mu.Unlock()
	if victim != nil {
		_ = victim.Close()
	}
	return victim != nil, true
}

func (s *Set[C]) exitMember(c C) {
	s.mu.Lock()
	delete(s.members, c)
	s.exitLocked()
	s.mu.Unlock()
}

func (s *Set[C]) exit() {
	s.mu.Lock()
	s.exitLocked()
	s.mu.Unlock()
}

// exitLocked uncounts a goroutine that returns. The caller holds s.mu.
func (s *Set[C]) exitLocked() {
	if s.running--; s.running == 0 && s.stopped {
		close(s.idleLocked())
	}
}

func (s *Set[C]) idleLocked() chan struct{} {
	if s.idle == nil {
		s.idle = make(chan struct{})
	}
	return s.idle
}

func (s *Set[C]) doneLocked() chan struct{} {
	if s.done == nil {
		s.done = make(chan struct{})
	}
	return s.done
}

// Len returns how many members the set tracks.
func (s *Set[C]) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.members)
}

// Members returns the set's members at this instant, in no particular
// order: a copy, which the caller may keep.
func (s *Set[C]) Members() []C {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]C, 0, len(s.members))
	for c := range s.members {
		out = append(out, c)
	}
	return out
}

// Stop stops the set: from now on Add, Serve, Admit and Go refuse, Stopping
// reports true and Done is closed. It returns the members at that instant, for the
// caller to close, and whether this call stopped the set; a later call
// returns no members and false. The members stay tracked until they are
// removed or their goroutines return.
func (s *Set[C]) Stop() (members []C, first bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return nil, false
	}
	s.stopped = true
	close(s.doneLocked())
	if s.running == 0 {
		close(s.idleLocked())
	}
	members = make([]C, 0, len(s.members))
	for c := range s.members {
		members = append(members, c)
	}
	return members, true
}

// Stopping reports whether Stop was called: a connection that ends from then
// on ends because the backend is closing, not by its peer's fault, and is
// counted nowhere. It is a snapshot: Stop may be called just after it
// reported false, so a caller that must not act once the set is stopped
// acts through Admit, Serve, Add or Go, which check under the same lock as
// Stop; a count of something that happened before the call, though, may
// rest on it (the set was not stopped then either).
func (s *Set[C]) Stopping() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stopped
}

// Done returns a channel that is closed when Stop is called, for a
// goroutine that must end with the backend to select on.
func (s *Set[C]) Done() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.doneLocked()
}

// Wait waits until the set is stopped and every goroutine that Go and Serve
// started has returned. It does not close anything: Stop's caller closes
// the members, which ends the goroutines that serve them.
func (s *Set[C]) Wait() {
	s.mu.Lock()
	idle := s.idleLocked()
	s.mu.Unlock()
	<-idle
}
