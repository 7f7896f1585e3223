//go:build !unix

package tcp

import (
	"net"
	"syscall"
)

// tryWriteRaw is not available here: tryWrite waits a millisecond at most.
func tryWriteRaw(net.Conn, syscall.Conn, []byte) (int, error) { return 0, errNoRaw }
