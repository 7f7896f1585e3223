//go:build linux

package cma

import (
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// ptracers keeps this process's Yama ptracer exception (prctl
// PR_SET_PTRACER) in step with the peers connected to its cma backends,
// when kernel.yama.ptrace_scope is 1. Yama keeps one exception per process
// (for its thread group leader, so every thread is covered): the connected
// peer's process ID while there is one, any process while there are
// several, none when none is connected. The exception is process-wide, so
// the bookkeeping is too, across every backend of the process.
var ptracers = &ptracerSet{pids: map[int]int{}, self: os.Getpid(), set: setPtracer}

type ptracerSet struct {
	mu   sync.Mutex
	pids map[int]int // connected peer process → connections
	cur  uintptr     // the exception in force: 0, a pid, or any

	self int                 // this process, which may always read itself
	set  func(uintptr) error // prctl(PR_SET_PTRACER), or a test's stand-in
}

func setPtracer(v uintptr) error { return unix.Prctl(unix.PR_SET_PTRACER, v, 0, 0, 0) }

const ptracerAny = ^uintptr(0) // PR_SET_PTRACER_ANY

func (s *ptracerSet) add(pid int) {
	if pid == s.self {
		return // a process may always read itself
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pids[pid]++
	s.apply()
}

func (s *ptracerSet) remove(pid int) {
	if pid == s.self {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pids[pid]--; s.pids[pid] <= 0 {
		delete(s.pids, pid)
	}
	s.apply()
}

func (s *ptracerSet) apply() {
	var want uintptr
	switch len(s.pids) {
	case 0:
	case 1:
		for pid := range s.pids {
			want = uintptr(pid)
		}
	default:
		want = ptracerAny
	}
	if want == s.cur {
		return
	}
	// EINVAL without Yama; a failure leaves the peer's probe to fail, and
	// the peer to fall back, which is the right outcome.
	if err := s.set(want); err == nil {
		s.cur = want
	}
}
