//go:build unix

package tcp

import (
	"net"
	"syscall"
	"time"
)

// tryWrite writes what of b the socket takes at once, without waiting: a
// full socket takes nothing (0, nil). The keepalive loop writes pings with
// it, so that no peer that stops reading holds the loop up.
func tryWrite(c *net.TCPConn, b []byte) (int, error) {
	// A deadline in the past, left by an earlier write, would refuse even
	// the attempt.
	_ = c.SetWriteDeadline(time.Time{})
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
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
