//go:build unix

package tcp

import (
	"net"
	"syscall"
	"time"
)

// tryWriteRaw writes what of b the socket under c takes at once, with one
// non-blocking write(2): a full socket takes nothing (0, nil). It returns
// errNoRaw if c has no file descriptor to write to.
func tryWriteRaw(c net.Conn, sc syscall.Conn, b []byte) (int, error) {
	rc, err := sc.SyscallConn()
	if err != nil {
		return 0, errNoRaw
	}
	// A deadline in the past, left by an earlier write, would refuse even
	// the attempt.
	_ = c.SetWriteDeadline(time.Time{})
	var n int
	var werr error
	if err := rc.Write(func(fd uintptr) bool {
		n, werr = syscall.Write(int(fd), b)
		return true // never wait for the socket to drain
	}); err != nil {
		return 0, err
	}
	if werr == syscall.EAGAIN || werr == syscall.EWOULDBLOCK || werr == syscall.EINTR {
		return 0, nil
	}
	if werr != nil {
		return 0, werr
	}
	return n, nil
}
