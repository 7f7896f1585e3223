package tcp

import (
	"errors"
	"net"
	"os"
	"sync/atomic"
	"time"
)

// minProgress is the fewest bytes a frame in flight must move per keepalive
// timeout. A frame is not held to one deadline as a whole: on a slow but
// live link a 2 MiB chunk may take longer than the timeout to cross, and
// cutting it would declare a working peer lost. Instead a read or write
// that times out is given another timeout whenever at least minProgress
// bytes moved since the last one. A peer trickling bytes slower than that
// (slow-loris) is still cut within one timeout of falling behind, and a
// stalled one within one timeout. At the default 4 s timeout the floor is
// 16 KiB/s per connection.
const minProgress = 64 << 10

func isTimeout(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }

// patientConn is the reading side of a connection, under its bufio.Reader:
// reads time out only when a whole timeout passes with fewer than
// minProgress bytes read since the connection was last armed or extended.
// It is used by one reading goroutine.
type patientConn struct {
	c       *net.TCPConn
	rx      *atomic.Uint64 // the connection's bytes read, for keepalives
	timeout time.Duration
	moved   int
}

// arm gives the next frame a fresh timeout.
func (p *patientConn) arm() {
	p.moved = 0
	_ = p.c.SetReadDeadline(time.Now().Add(p.timeout))
}

func (p *patientConn) Read(b []byte) (int, error) {
	for {
		n, err := p.c.Read(b)
		p.moved += n
		p.rx.Add(uint64(n))
		if err == nil || !isTimeout(err) || p.moved < minProgress {
			return n, err
		}
		p.arm()
		if n > 0 {
			return n, nil
		}
	}
}

// writeFrame writes out to c, which the caller holds, under the same rule:
// each timeout that passes with at least minProgress bytes written grants
// another. It returns once out is written or the peer fell behind.
func writeFrame(c *net.TCPConn, out *net.Buffers, timeout time.Duration) error {
	for {
		_ = c.SetWriteDeadline(time.Now().Add(timeout))
		n, err := out.WriteTo(c) // consumes what it wrote
		if err == nil || !isTimeout(err) || n < minProgress {
			return err
		}
	}
}
