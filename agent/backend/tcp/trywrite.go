package tcp

import (
	"errors"
	"net"
	"syscall"
	"time"
)

// errNoRaw is tryWriteRaw's answer where it cannot write without waiting.
var errNoRaw = errors.New("tcp: no non-blocking write")

// tryWrite writes what of b the connection takes at once: a full socket
// takes nothing (0, nil). The keepalive loop writes pings with it, so that
// no peer that stops reading holds the loop up. A TCP connection is
// written without waiting at all (tryWriteRaw, where the platform has
// it); any other waits a millisecond at most.
func tryWrite(c net.Conn, b []byte) (int, error) {
	if sc, ok := c.(syscall.Conn); ok {
		if n, err := tryWriteRaw(c, sc, b); err != errNoRaw {
			return n, err
		}
	}
	_ = c.SetWriteDeadline(time.Now().Add(time.Millisecond))
	n, err := c.Write(b)
	if isTimeout(err) {
		err = nil
	}
	return n, err
}
