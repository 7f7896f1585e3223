package tcp_test

// Attack tests on the notification sent after success (commit 4ed8f1c,
// agent.Work.FinishNotify) over tcp.

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// ctrlStaller forwards every connection to upstream, and can stop reading
// what the dialler sends on its control connection (the connection whose
// handshake names stream index ctrlIdx), as a peer that stopped reading
// its control connection would, while the data streams go on.
type ctrlStaller struct {
	ln       net.Listener
	upstream chan string // the address, once known
	ctrlIdx  byte
	stall    chan struct{} // closed: the control connection is not read
	stop     chan struct{}
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
}

func newCtrlStaller(t *testing.T, ctrlIdx byte) *ctrlStaller {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &ctrlStaller{ln: ln, upstream: make(chan string, 1), ctrlIdx: ctrlIdx, stall: make(chan struct{}), stop: make(chan struct{})}
	s.wg.Add(1)
	go s.serve()
	t.Cleanup(s.close)
	return s
}

func (s *ctrlStaller) track(cs ...net.Conn) {
	s.mu.Lock()
	s.conns = append(s.conns, cs...)
	s.mu.Unlock()
}

func (s *ctrlStaller) close() {
	close(s.stop)
	_ = s.ln.Close()
	s.mu.Lock()
	for _, c := range s.conns {
		_ = c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

func (s *ctrlStaller) serve() {
	defer s.wg.Done()
	var upstream string
	select {
	case upstream = <-s.upstream:
	case <-s.stop:
		return
	}
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		_ = c.(*net.TCPConn).SetReadBuffer(4 << 10)
		u, err := net.Dial("tcp", upstream)
		if err != nil {
			_ = c.Close()
			continue
		}
		s.track(c, u)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			var hs [64]byte
			if _, err := io.ReadFull(c, hs[:]); err != nil {
				return
			}
			if _, err := u.Write(hs[:]); err != nil {
				return
			}
			ctrl := hs[5] == s.ctrlIdx
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				_, _ = io.Copy(c, u)
				_ = c.Close()
			}()
			buf := make([]byte, 512)
			for {
				if ctrl {
					select {
					case <-s.stall:
						<-s.stop // reads nothing more
						return
					default:
					}
				}
				n, err := c.Read(buf)
				if n > 0 {
					if _, werr := u.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					_ = u.Close()
					return
				}
			}
		}()
	}
}

// TestAttack19CloseWithStalledNotification measures how long Agent.Close
// takes while notifications of transfers that succeeded cannot be written:
// the exposing side stopped reading the control connection (its data
// streams still answer). Close waits for them (FinishNotify), and must
// stay within the keepalive timeout's bounds; each notification not sent
// is counted in LostNotifications.
func TestAttack19CloseWithStalledNotification(t *testing.T) {
	backendtest.Watchdog(t, 2*time.Minute)
	for _, streams := range []int{1, 4} {
		t.Run(fmt.Sprintf("streams=%d", streams), func(t *testing.T) { closeWithStalledNotification(t, streams) })
	}
}

func closeWithStalledNotification(t *testing.T, streams int) {
	const keepalive = 2 * time.Second
	prox := newCtrlStaller(t, byte(streams))
	pb := tcp.New(tcp.WithStreams(streams), tcp.WithAdvertiseAddr(prox.ln.Addr().String()))
	pas := backendtest.NewAgent(t, pb)
	prox.upstream <- pb.Addr().String()
	act, err := agent.New(agent.WithBackends(tcp.New(tcp.WithStreams(streams), tcp.WithKeepalive(keepalive/2, keepalive))))
	require.NoError(t, err)
	closed := false
	t.Cleanup(func() {
		if !closed {
			_ = act.Close()
		}
	})

	remote := make([]byte, 4096)
	exp, err := pas.Expose(agent.AccessRead, []agent.Local{agent.DRAM(remote)})
	require.NoError(t, err)
	defer exp.Revoke()
	read := func(note []byte) *agent.Xfer {
		x, err := act.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: pas.Info(), Key: exp.Key(), Notify: note,
			Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 4096)), Remote: agent.DRAM(remote).Region}}})
		require.NoError(t, err)
		return x
	}
	x := read([]byte("first"))
	<-x.Done()
	require.NoError(t, x.Err())
	ev := <-exp.Events()
	require.Equal(t, agent.EventNotify, ev.Kind)

	close(prox.stall)
	// One transfer after another until one does not finish: the stream's
	// reader, which finished the one before, is writing its notification
	// into sockets that no longer take any.
	note := make([]byte, 64<<10)
	n := 0
	for ; n < 1000; n++ {
		x := read(note)
		select {
		case <-x.Done():
			require.NoError(t, x.Err(), "transfer %d", n)
			continue
		case <-time.After(500 * time.Millisecond):
		}
		break
	}
	require.Less(t, n, 1000, "the sockets took 64 MiB of notifications")
	start := time.Now()
	require.NoError(t, act.Close())
	closed = true
	took := time.Since(start)
	lost := act.Stats().LostNotifications
	t.Logf("Close took %v with %d notifications of 64 KiB to a peer that stopped reading its control connection (keepalive timeout %v); %d counted lost",
		took.Round(time.Millisecond), n, keepalive, lost)
	assert.Less(t, took, 3*keepalive, "Close against a peer that stopped reading")
	assert.NotZero(t, lost, "notifications that could not be written are counted")
}
