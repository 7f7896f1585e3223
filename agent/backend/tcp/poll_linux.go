package tcp

import (
	"io"
	"net"
	"syscall"
)

// tryRead reads what the socket under c holds now, with one non-blocking
// read(2): nothing there gives (0, nil, true); end of stream gives io.EOF.
// It reports !ok, leaving them to the caller's blocking read, for a
// deadline passed (a fence raised), a closed connection, an error, or a
// connection with no file descriptor to read.
func tryRead(c net.Conn, b []byte) (n int, err error, ok bool) {
	sc, isSys := c.(syscall.Conn)
	if !isSys || len(b) == 0 {
		return 0, nil, false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return 0, nil, false
	}
	var rerr error
	if err := rc.Read(func(fd uintptr) bool {
		n, rerr = syscall.Read(int(fd), b)
		return true // never wait for the socket
	}); err != nil {
		return 0, nil, false
	}
	switch {
	case rerr == syscall.EAGAIN || rerr == syscall.EINTR:
		return 0, nil, true
	case rerr != nil:
		return 0, nil, false
	case n == 0:
		return 0, io.EOF, true
	}
	return n, nil, true
}

// yieldThread lets the other threads waiting for this core run
// (sched_yield(2)); the goroutine keeps its processor.
func yieldThread() { _, _, _ = syscall.RawSyscall(syscall.SYS_SCHED_YIELD, 0, 0, 0) }
