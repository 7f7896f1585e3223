package serve

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/goxfer/goxfer/agent"
)

// The sentinels as the backends declare them: errLimit wraps errProtocol.
var (
	errProtocol = errors.New("x: protocol violation")
	errLimit    = fmt.Errorf("%w: over a limit", errProtocol)
	errStalled  = errors.New("x: request unanswered")
	classes     = Classes{Limit: errLimit, Protocol: errProtocol, Timeouts: []error{errStalled}}
)

func TestClassesKind(t *testing.T) {
	deadline := &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
	for _, tc := range []struct {
		name        string
		err         error
		inHandshake bool
		want        Kind // 0: none
	}{
		{"nil", nil, false, 0},
		{"nil in a handshake", nil, true, 0},
		{"limit", fmt.Errorf("%w: 2000 pieces", errLimit), false, LimitRejected},
		{"limit in a handshake", fmt.Errorf("%w: peer holds 8", errLimit), true, LimitRejected},
		{"deadline", deadline, false, TimedOut},
		{"deadline in a handshake", deadline, true, TimedOut},
		{"wrapped deadline", fmt.Errorf("x: keepalive: %w", deadline), false, TimedOut},
		{"another timeout", fmt.Errorf("%w: for 4s", errStalled), false, TimedOut},
		{"protocol", fmt.Errorf("%w: frame type 9", errProtocol), false, ProtocolError},
		{"protocol in a handshake", fmt.Errorf("%w: bad magic", errProtocol), true, HandshakeFailure},
		{"short handshake", io.ErrUnexpectedEOF, true, HandshakeFailure},
		{"handshake hung up", io.EOF, true, HandshakeFailure},
		{"hung up", io.EOF, false, 0},
		{"reset", &net.OpError{Op: "read", Err: os.NewSyscallError("read", syscall.ECONNRESET)}, false, 0},
		{"closed by us", net.ErrClosed, false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k, ok := classes.Kind(tc.err, tc.inHandshake)
			assert.Equal(t, tc.want != 0, ok)
			assert.Equal(t, tc.want, k)

			var c Counters
			c.Classes = classes
			k, ok = c.Dropped(tc.err, tc.inHandshake)
			assert.Equal(t, tc.want, k)
			assert.Equal(t, tc.want != 0, ok)
			want := agent.BackendStats{}
			switch tc.want {
			case HandshakeFailure:
				want = agent.BackendStats{Disconnected: 1, HandshakeFailures: 1}
			case ProtocolError:
				want = agent.BackendStats{Disconnected: 1, ProtocolErrors: 1}
			case LimitRejected:
				want = agent.BackendStats{Disconnected: 1, LimitRejected: 1}
			case TimedOut:
				want = agent.BackendStats{Disconnected: 1, Timeouts: 1}
			}
			assert.Equal(t, want, c.Stats())
		})
	}
}

// The zero Classes know no sentinel: only deadlines and handshakes count.
func TestZeroClasses(t *testing.T) {
	var c Counters
	_, ok := c.Dropped(errLimit, false)
	assert.False(t, ok)
	k, _ := c.Dropped(errLimit, true)
	assert.Equal(t, HandshakeFailure, k)
	k, _ = c.Dropped(os.ErrDeadlineExceeded, false)
	assert.Equal(t, TimedOut, k)
	assert.Equal(t, agent.BackendStats{Disconnected: 2, HandshakeFailures: 1, Timeouts: 1}, c.Stats())
}

func TestCountersDropAndDeny(t *testing.T) {
	var c Counters
	c.Drop(HandshakeFailure)
	c.Drop(ProtocolError)
	c.Drop(LimitRejected)
	c.Drop(LimitRejected)
	c.Drop(TimedOut)
	c.Deny()
	c.Deny()
	assert.Equal(t, agent.BackendStats{Disconnected: 5, HandshakeFailures: 1, ProtocolErrors: 1, LimitRejected: 2, Timeouts: 1, Denied: 2}, c.Stats())
	assert.Panics(t, func() { c.Drop(0) })
	assert.Panics(t, func() { c.Drop(TimedOut + 1) })
}

// Disconnected is the sum of the kinds in every snapshot, even one taken
// while drops are counted.
func TestCountersSnapshotsAgree(t *testing.T) {
	var c Counters
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			s := c.Stats()
			if s.Disconnected != s.HandshakeFailures+s.ProtocolErrors+s.LimitRejected+s.Timeouts {
				t.Errorf("a snapshot disagrees with itself: %+v", s)
				return
			}
		}
	})
	var drops sync.WaitGroup
	for w := range 8 {
		drops.Go(func() {
			for i := range 2000 {
				c.Drop(Kind(1 + (w+i)%4))
				if i%5 == 0 {
					c.Deny()
				}
			}
		})
	}
	drops.Wait()
	close(stop)
	wg.Wait()
	s := c.Stats()
	assert.Equal(t, uint64(8*2000), s.Disconnected)
	assert.Equal(t, uint64(8*2000/4), s.Timeouts)
	assert.Equal(t, uint64(8*400), s.Denied)
}

func TestDelta(t *testing.T) {
	before := agent.BackendStats{Disconnected: 3, HandshakeFailures: 1, ProtocolErrors: 1, LimitRejected: 1, Denied: 4}
	after := agent.BackendStats{Disconnected: 5, HandshakeFailures: 1, ProtocolErrors: 1, LimitRejected: 2, Timeouts: 1, Denied: 6}
	assert.Equal(t, agent.BackendStats{Disconnected: 2, LimitRejected: 1, Timeouts: 1, Denied: 2}, Delta(after, before))
}

func TestKindString(t *testing.T) {
	assert.Equal(t, "limit rejected", LimitRejected.String())
	assert.Equal(t, "timeout", TimedOut.String())
	assert.Equal(t, "Kind(9)", Kind(9).String())
}
