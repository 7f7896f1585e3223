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

// TestReadQuietWokenFromAnotherGoroutine checks what the exposing side's
// other goroutines do to a read that waits: the stager moves its deadline
// (server.hold) or sets one in the past (server.abort), and Close ends
// it, each as they would end c.Read.
func TestReadQuietWokenFromAnotherGoroutine(t *testing.T) {
	a, _ := unixPair(t)
	buf := make([]byte, 8)
	wait := func(wake func()) (time.Duration, error) {
		go func() {
			time.Sleep(20 * time.Millisecond)
			wake()
		}()
		start := time.Now()
		_, err := readQuiet(a, buf)
		return time.Since(start), err
	}

	// A deadline set while the read waits with none.
	took, err := wait(func() { _ = a.SetReadDeadline(time.Now().Add(20 * time.Millisecond)) })
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.GreaterOrEqual(t, took, 35*time.Millisecond)
	require.Less(t, took, 2*time.Second)

	// A far deadline brought forward, into the past (abort).
	require.NoError(t, a.SetReadDeadline(time.Now().Add(time.Hour)))
	took, err = wait(func() { _ = a.SetReadDeadline(time.Unix(1, 0)) })
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.Less(t, took, 2*time.Second)
	var ne net.Error
	require.ErrorAs(t, err, &ne)
	require.True(t, ne.Timeout())
	require.NoError(t, a.SetReadDeadline(time.Time{}))

	// Close.
	took, err = wait(func() { _ = a.Close() })
	require.ErrorIs(t, err, net.ErrClosed)
	require.Less(t, took, 2*time.Second)
}

// TestReadQuietDropsPassedDescriptors checks that a file descriptor a
// hostile peer attaches (SCM_RIGHTS) to what it sends the exposing side,
// which expects none, is discarded by the kernel, as c.Read's read(2) did:
// the bytes arrive, and no copy of the descriptor lives on in this
// process (the pipe it was the only reader of is broken once it is read).
func TestReadQuietDropsPassedDescriptors(t *testing.T) {
	a, b := unixPair(t)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer w.Close()
	_, _, err = b.WriteMsgUnix([]byte("fd"), unix.UnixRights(int(r.Fd())), nil)
	require.NoError(t, err)
	require.NoError(t, r.Close())
	// In flight, the descriptor still reads the pipe.
	_, err = w.Write([]byte("x"))
	require.NoError(t, err)

	buf := make([]byte, 8)
	n, err := readQuiet(a, buf)
	require.NoError(t, err)
	require.Equal(t, "fd", string(buf[:n]))
	_, err = w.Write([]byte("x"))
	require.ErrorIs(t, err, unix.EPIPE, "the passed descriptor survived the read")
}

// TestReadQuietPartialFrames checks that a peer trickling a frame a byte at
// a time is read as it comes, each read returning what is there.
func TestReadQuietPartialFrames(t *testing.T) {
	a, b := unixPair(t)
	go func() {
		for _, c := range []byte("frame") {
			time.Sleep(2 * time.Millisecond)
			_, _ = b.Write([]byte{c})
		}
	}()
	var got []byte
	buf := make([]byte, 8)
	for len(got) < 5 {
		n, err := readQuiet(a, buf)
		require.NoError(t, err)
		require.Positive(t, n)
		got = append(got, buf[:n]...)
	}
	require.Equal(t, "frame", string(got))
}

// TestReadQuietOrdersForTheRaceDetector checks that a read happens after
// the write(2) it reads as the race detector sees it, as with c.Read:
// under -race, what the writing goroutine did before its write is no race
// with what the reader does after its read.
func TestReadQuietOrdersForTheRaceDetector(t *testing.T) {
	a, b := unixPair(t)
	var before int
	go func() {
		before = 1
		_, _ = b.Write([]byte("go"))
	}()
	buf := make([]byte, 2)
	for n := 0; n < len(buf); {
		k, err := readQuiet(a, buf[n:])
		require.NoError(t, err)
		n += k
	}
	require.Equal(t, 1, before)
}
