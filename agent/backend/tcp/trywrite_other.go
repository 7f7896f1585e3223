//go:build !unix

package tcp

import (
	"net"
	"time"
)

// tryWrite writes what of b the socket takes within a millisecond: a full
// socket takes nothing (0, nil). The keepalive loop writes pings with it,
// so that no peer that stops reading holds the loop up for long.
func tryWrite(c *net.TCPConn, b []byte) (int, error) {
	_ = c.SetWriteDeadline(time.Now().Add(time.Millisecond))
	n, err := c.Write(b)
	if isTimeout(err) {
		err = nil
	}
	return n, err
}
