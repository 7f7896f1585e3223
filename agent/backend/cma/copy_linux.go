//go:build linux

package cma

import (
	"errors"
	"fmt"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
)

// dispatch cuts w into chunks of at most chunk bytes and IOV_MAX pieces.
// A span of one chunk is copied on the driver's goroutine.
func (w *window) dispatch(chunk uint64) {
	st := w.st
	segs := st.x.Segments
	end := w.start
	var t task
	w.dispatched = true
	w.tasks.Store(1)
	for left := w.n; left > 0; {
		t = task{w: w, start: end}
		end, t.n, t.pieces = agent.Span(segs, end, min(chunk, left), iovMax)
		left -= t.n
		if left == 0 && w.tasks.Load() == 1 {
			break // a single chunk: copy it here
		}
		w.tasks.Add(1)
		select {
		case st.b.tasks <- t:
		case <-st.b.stop:
			w.short.Store(true)
			w.taskDone(agent.ErrClosed)
		}
		t = task{}
	}
	if t.w != nil {
		st.b.copyTask(t, nil)
	}
	w.taskDone(nil)
}

func (w *window) taskDone(err error) {
	if err != nil {
		w.st.Fail(err)
	}
	if w.tasks.Add(-1) == 0 {
		w.done(nil)
	}
}

// iovMax is the most iovecs one process_vm_readv/writev takes (IOV_MAX).
const iovMax = 1024

// task is one chunk of a window: one system call, unless it is partial.
type task struct {
	w      *window
	start  cursor
	n      uint64
	pieces int
}

// iovecs are a worker's reusable system call arguments.
type iovecs struct {
	local  [iovMax]unix.Iovec
	remote [iovMax]unix.RemoteIovec
}

func (b *Backend) worker() {
	defer b.wg.Done()
	v := new(iovecs)
	for {
		select {
		case t := <-b.tasks:
			b.copyTask(t, v)
		case <-b.stop:
			return
		}
	}
}

var driverIovecs = sync.Pool{New: func() any { return new(iovecs) }}

// copyTask copies one chunk with one system call (more if the kernel copies
// part of it) and reports it done to its window.
func (b *Backend) copyTask(t task, v *iovecs) {
	w := t.w
	st := w.st
	var err error
	copied := false
	select {
	case <-st.x.Cancelled():
		err = st.x.CancelErr()
	case <-st.p.dead: // stop before the next chunk: the connection waits for this one
		err = st.p.failure()
	default:
		if st.Failed() {
			break
		}
		if v == nil {
			v = driverIovecs.Get().(*iovecs)
			defer driverIovecs.Put(v)
		}
		err = st.copyChunk(t, v)
		copied = err == nil
	}
	if !copied {
		w.short.Store(true)
	}
	w.taskDone(err)
}

func (st *xstate) copyChunk(t task, v *iovecs) error {
	if t.w.devs != nil || st.localDev {
		return st.copyDevice(t)
	}
	l, r := v.local[:t.pieces], v.remote[:t.pieces]
	i, seg := 0, t.start.Seg
	for pc := range st.x.Pieces(t.start, t.n) {
		l[i] = unix.Iovec{Base: &pc.Local()[0]}
		l[i].SetLen(int(pc.Len))
		r[i] = unix.RemoteIovec{Base: t.w.remoteAddr(seg, pc), Len: int(pc.Len)}
		i++
		if pc.Off+pc.Len == pc.Seg.Local.Len {
			seg++
		}
	}
	err := vmCopy(int(st.p.ci.pid), st.write, l, r, t.n)
	clear(l) // hold no reference to local memory between chunks
	if err != nil {
		return st.copyError(err)
	}
	return nil
}

// vmCopy moves total bytes between the local and remote iovecs, resuming
// after partial copies.
func vmCopy(pid int, write bool, l []unix.Iovec, r []unix.RemoteIovec, total uint64) error {
	for total > 0 {
		var n int
		var err error
		if write {
			n, err = unix.ProcessVMWritev(pid, l, r, 0)
		} else {
			n, err = unix.ProcessVMReadv(pid, l, r, 0)
		}
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n <= 0 {
			return fmt.Errorf("copied 0 of %d bytes", total)
		}
		total -= uint64(n)
		if total > 0 {
			l, r = skipLocal(l, n), skipRemote(r, n)
		}
	}
	return nil
}

func skipLocal(l []unix.Iovec, n int) []unix.Iovec {
	for n > 0 && len(l) > 0 {
		if int(l[0].Len) > n {
			l[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(l[0].Base), n))
			l[0].Len -= uint64(n)
			return l
		}
		n -= int(l[0].Len)
		l = l[1:]
	}
	return l
}

func skipRemote(r []unix.RemoteIovec, n int) []unix.RemoteIovec {
	for n > 0 && len(r) > 0 {
		if r[0].Len > n {
			r[0].Base += uintptr(n)
			r[0].Len -= n
			return r
		}
		n -= r[0].Len
		r = r[1:]
	}
	return r
}

// copyError classifies a failed copy: a vanished process or address space
// is a lost peer; a refused one means permission was withdrawn after the
// probe, and the peer's verdict is dropped so the next transfer probes (and
// may fall back) afresh.
func (st *xstate) copyError(err error) error {
	p := st.p
	var errno syscall.Errno
	errors.As(err, &errno)
	switch errno {
	case unix.ESRCH, unix.EFAULT, unix.ENOMEM:
		return fmt.Errorf("cma: %v of process %d: %w: %w", st.x.Op, p.ci.pid, agent.ErrRemoteLost, err)
	case unix.EPERM, unix.EACCES:
		perr := fmt.Errorf("cma: %v of process %d: %w: permission withdrawn after the probe: %w", st.x.Op, p.ci.pid, agent.ErrAccessDenied, err)
		p.fail(perr)
		return perr
	}
	return fmt.Errorf("cma: %v of process %d: %w", st.x.Op, p.ci.pid, err)
}
