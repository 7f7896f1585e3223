//go:build linux

package cma

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// unixPair returns two connected Unix sockets, as net.UnixConns on the
// runtime's poller.
func unixPair(t *testing.T) (a, b *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "pair")
		defer f.Close()
		c, err := net.FileConn(f)
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

// TestReadQuiet checks that the exposing side's reads, made without the
// runtime's system call bookkeeping, behave as net.Conn's: data, a wait
// for data that comes later, deadlines, the peer's close and its own.
func TestReadQuiet(t *testing.T) {
	a, b := unixPair(t)
	buf := make([]byte, 8)

	_, err := b.Write([]byte("frame"))
	require.NoError(t, err)
	n, err := readQuiet(a, buf)
	require.NoError(t, err)
	require.Equal(t, "frame", string(buf[:n]))

	n, err = readQuiet(a, buf[:0])
	require.NoError(t, err)
	require.Zero(t, n)

	// Nothing there yet: it waits on the poller until data comes.
	go func() {
		time.Sleep(20 * time.Millisecond)
		_, _ = b.Write([]byte("later"))
	}()
	start := time.Now()
	n, err = readQuiet(a, buf)
	require.NoError(t, err)
	require.Equal(t, "later", string(buf[:n]))
	require.GreaterOrEqual(t, time.Since(start), 15*time.Millisecond)

	// A deadline ends the wait with a timeout, as c.Read's would.
	require.NoError(t, a.SetReadDeadline(time.Now().Add(10*time.Millisecond)))
	_, err = readQuiet(a, buf)
	var ne net.Error
	require.ErrorAs(t, err, &ne)
	require.True(t, ne.Timeout())
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.NoError(t, a.SetReadDeadline(time.Time{}))

	// The peer's close reads as the end of the stream, after what it sent.
	_, err = b.Write([]byte("last"))
	require.NoError(t, err)
	require.NoError(t, b.Close())
	n, err = readQuiet(a, buf)
	require.NoError(t, err)
	require.Equal(t, "last", string(buf[:n]))
	_, err = readQuiet(a, buf)
	require.ErrorIs(t, err, io.EOF)

	// Its own close, as net.ErrClosed.
	require.NoError(t, a.Close())
	_, err = readQuiet(a, buf)
	require.ErrorIs(t, err, net.ErrClosed)
}

// TestReadQuietReset checks that a failed read(2) comes back as an error
// naming it, not as the end of the stream.
func TestReadQuietReset(t *testing.T) {
	a, b := unixPair(t)
	// Closing with unread data makes the other end's next read fail with
	// ECONNRESET on a Unix stream socket.
	_, err := a.Write([]byte("unread"))
	require.NoError(t, err)
	require.NoError(t, b.Close())
	_, err = readQuiet(a, make([]byte, 8))
	require.Error(t, err)
	require.False(t, errors.Is(err, io.EOF), "%v", err)
	require.ErrorIs(t, err, unix.ECONNRESET)
}
