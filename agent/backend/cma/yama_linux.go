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
// (for its thread group leader, so every thread is covered), naming one
// process. The exception goes to the first peer process that presents a
// valid key (the handshake checks the key before claiming), for as long as
// it keeps a connection that did; while it holds it, other peer processes
// are not named and fall back to another backend. The exception never names
// any process (PR_SET_PTRACER_ANY): that would let every process of the
// same user attach, key or no key. The exception is process-wide, so the
// bookkeeping is too, across every backend of the process.
var ptracers = &ptracerSet{pids: map[int]int{}, self: os.Getpid(), set: setPtracer}

type ptracerSet struct {
	mu   sync.Mutex
	pids map[int]int // the named peer process → its connections that claimed; at most one process
	cur  uintptr     // the exception in force: 0 or a pid

	self int                 // this process, which may always read itself
	set  func(uintptr) error // prctl(PR_SET_PTRACER), or a test's stand-in
}

func setPtracer(v uintptr) error { return unix.Prctl(unix.PR_SET_PTRACER, v, 0, 0, 0) }

// claim names pid this process's ptracer for one more of its connections,
// and reports whether it is named: false while another process holds the
// exception, or when the kernel refuses it.
func (s *ptracerSet) claim(pid int) bool {
	if pid == s.self {
		return true // a process may always read itself
	}
	if pid <= 0 {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for other := range s.pids {
		if other != pid {
			return false
		}
	}
	if s.cur != uintptr(pid) {
		// EINVAL without Yama: the peer's probe then fails, and it falls
		// back, which is the right outcome.
		if err := s.set(uintptr(pid)); err != nil {
			return false
		}
		s.cur = uintptr(pid)
	}
	s.pids[pid]++
	return true
}

// release ends one claim of pid; the exception is withdrawn with the last.
func (s *ptracerSet) release(pid int) {
	if pid == s.self {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pids[pid]--; s.pids[pid] > 0 {
		return
	}
	delete(s.pids, pid)
	if len(s.pids) == 0 && s.cur != 0 && s.set(0) == nil {
		s.cur = 0
	}
}
