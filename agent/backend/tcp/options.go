package tcp

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/goxfer/goxfer/agent"
)

// ErrOutgoingLimit fails a transfer that needs a connection to an IP
// address to which this agent already holds [WithMaxOutgoingPerIP]
// connections, none of them idle. It says nothing about the peer, which
// may well be alive: it does not match [agent.ErrRemoteLost].
var ErrOutgoingLimit = errors.New("tcp: outgoing connections per address at the limit (tcp.WithMaxOutgoingPerIP)")

// Option configures a [Backend]; pass options to [New]. An invalid one
// makes Start fail with an error wrapping [agent.ErrInvalidOption].
type Option interface{ apply(*config) error }

type optionFunc func(*config) error

func (f optionFunc) apply(c *config) error { return f(c) }

type config struct {
	listen    string
	advertise string
	streams   int
	interval  time.Duration
	timeout   time.Duration
	chunk     int
	inflight  int
	maxPieces int
	maxFrame  int

	maxConnsPerPeer int
	maxConnsPerIP   int
	maxHandshakes   int

	maxOut int           // connections we dial to one address
	idle   time.Duration // a peer with nothing in flight this long is closed

	spin time.Duration // latency mode: how long a busy connection's reader polls; 0: off

	// Tests replace the network: an in-memory one runs inside a
	// testing/synctest bubble. Nil means TCP.
	testListen func(addr string) (net.Listener, error)
	testDial   func(ctx context.Context, addr string) (net.Conn, error)
}

func defaults() config {
	return config{
		listen:    "127.0.0.1:0",
		streams:   4,
		interval:  time.Second,
		timeout:   4 * time.Second,
		chunk:     2 << 20,
		inflight:  4,
		maxPieces: 1024,
		maxFrame:  16 << 20,

		maxConnsPerPeer: 256,
		maxConnsPerIP:   4096,
		maxHandshakes:   256,

		maxOut: 1024,
		idle:   30 * time.Second,
	}
}

// check reports options that conflict with each other.
func (c *config) check() error {
	if c.chunk > c.maxFrame {
		return fmt.Errorf("%w: tcp: chunk size %d exceeds the max frame size %d: this agent's own frames would be refused by its peers; lower WithChunkSize or raise WithMaxFrameSize", agent.ErrInvalidOption, c.chunk, c.maxFrame)
	}
	if c.maxConnsPerPeer > c.maxConnsPerIP {
		return fmt.Errorf("%w: tcp: %d connections per peer exceed the %d allowed per address", agent.ErrInvalidOption, c.maxConnsPerPeer, c.maxConnsPerIP)
	}
	if c.maxOut < c.streams+1 {
		return fmt.Errorf("%w: tcp: %d outgoing connections per address cannot carry %d streams and a control connection", agent.ErrInvalidOption, c.maxOut, c.streams)
	}
	if c.maxConnsPerPeer < c.streams+1 {
		return fmt.Errorf("%w: tcp: %d connections per peer cannot carry a peer's %d streams and its control connection", agent.ErrInvalidOption, c.maxConnsPerPeer, c.streams)
	}
	return nil
}

// WithListenAddr sets the address the backend listens on, as host:port.
// Default: "127.0.0.1:0", loopback on a free port, which only agents on the
// same host can reach; listen on a routable address (or ":0") to accept
// agents on other hosts.
func WithListenAddr(addr string) Option {
	return optionFunc(func(c *config) error {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("%w: tcp: listen address %q: %v", agent.ErrInvalidOption, addr, err)
		}
		c.listen = addr
		return nil
	})
}

// WithAdvertiseAddr sets the host:port published to remote agents, for a
// NAT, a proxy or another interface. Default: the bound listen address, or
// for an unspecified one (":0", "0.0.0.0") the host's first non-loopback
// IPv4 address and the bound port.
func WithAdvertiseAddr(addr string) Option {
	return optionFunc(func(c *config) error {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("%w: tcp: advertise address %q: %v", agent.ErrInvalidOption, addr, err)
		}
		c.advertise = addr
		return nil
	})
}

// WithStreams sets how many data connections carry transfers to each peer,
// besides one control connection for notifications; large transfers are
// pipelined over all of them. Add streams where one TCP connection cannot
// fill the path (docs/tcp.md, "At distance"). Default: 4.
func WithStreams(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 || n > 64 {
			return fmt.Errorf("%w: tcp: streams must be in [1, 64], got %d", agent.ErrInvalidOption, n)
		}
		c.streams = n
		return nil
	})
}

// WithKeepalive sets how often an idle connection sends a keepalive, and how
// long a peer may stay silent, or leave a request unanswered, before it is
// declared lost ([agent.ErrRemoteLost]); timeout must be at least twice
// interval (docs/tcp.md says why). Default: 1 s and 4 s.
func WithKeepalive(interval, timeout time.Duration) Option {
	return optionFunc(func(c *config) error {
		if interval <= 0 || timeout < 2*interval {
			return fmt.Errorf("%w: tcp: keepalive interval %v and timeout %v: need interval > 0 and timeout >= 2*interval", agent.ErrInvalidOption, interval, timeout)
		}
		c.interval, c.timeout = interval, timeout
		return nil
	})
}

// WithChunkSize sets the most bytes one frame carries: larger descriptors
// are split, smaller ones batched into one frame. Default: 2 MiB.
func WithChunkSize(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 4<<10 || n > 16<<20 {
			return fmt.Errorf("%w: tcp: chunk size must be in [4 KiB, 16 MiB], got %d", agent.ErrInvalidOption, n)
		}
		c.chunk = n
		return nil
	})
}

// WithInflight sets how many frames may await their answer on one stream.
// With [WithChunkSize] it sets a stream's window: a stream moves at most
// chunk × n bytes per round trip, so between hosts the streams' windows
// together should cover twice the path's bandwidth-delay product
// (docs/tcp.md, "At distance"). The window is shared by all transfers to
// the peer and needs no memory of the backend's own. Default: 4, an 8 MiB
// window with the default chunk.
func WithInflight(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 || n > 256 {
			return fmt.Errorf("%w: tcp: in-flight frames must be in [1, 256], got %d", agent.ErrInvalidOption, n)
		}
		c.inflight = n
		return nil
	})
}

// WithMaxFrameSize sets the most payload bytes one incoming READ or WRITE
// request may carry; a request over it closes the connection
// ([Stats].LimitRejected). It is announced to peers, which cut their frames
// to fit, and must be at least [WithChunkSize]. Default: 16 MiB, the largest
// chunk size (docs/tcp.md, "Limits and hostile peers").
func WithMaxFrameSize(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 4<<10 || n > 256<<20 {
			return fmt.Errorf("%w: tcp: max frame size must be in [4 KiB, 256 MiB], got %d", agent.ErrInvalidOption, n)
		}
		c.maxFrame = n
		return nil
	})
}

// WithMaxPieces sets the most pieces (address, length) one incoming READ or
// WRITE request may name; a request over it closes the connection
// ([Stats].LimitRejected). It is announced to peers, and bounds this agent's
// own requests too. Default: 1024, what one vectored system call takes
// (IOV_MAX).
func WithMaxPieces(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 16 || n > 65535 {
			return fmt.Errorf("%w: tcp: max pieces must be in [16, 65535], got %d", agent.ErrInvalidOption, n)
		}
		c.maxPieces = n
		return nil
	})
}

// WithMaxConnsPerPeer sets how many connections one remote agent may hold to
// this one at once, counted per claimed identity and remote address
// together; one over it is refused ([Stats].LimitRejected, and
// [agent.ErrRemoteLost] for the dialler). Default: 256, four times what the
// busiest honest peer holds (docs/tcp.md says why).
func WithMaxConnsPerPeer(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 2 || n > 1<<20 {
			return fmt.Errorf("%w: tcp: connections per peer must be in [2, 1048576], got %d", agent.ErrInvalidOption, n)
		}
		c.maxConnsPerPeer = n
		return nil
	})
}

// WithMaxConnsPerIP sets how many connections may come from one remote IP
// address at once, whatever identities they claim; one over it is closed as
// soon as it is accepted ([Stats].LimitRejected). Default: 4096 (docs/tcp.md
// says why).
func WithMaxConnsPerIP(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 2 || n > 1<<20 {
			return fmt.Errorf("%w: tcp: connections per address must be in [2, 1048576], got %d", agent.ErrInvalidOption, n)
		}
		c.maxConnsPerIP = n
		return nil
	})
}

// WithMaxHandshakes sets how many accepted connections may be in the
// handshake at once, from all addresses together; when full, the oldest
// unfinished handshake is closed to make room ([Stats].LimitRejected), so a
// slow-loris flood cannot lock honest peers out. Default: 256.
func WithMaxHandshakes(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 || n > 1<<20 {
			return fmt.Errorf("%w: tcp: handshakes in progress must be in [1, 1048576], got %d", agent.ErrInvalidOption, n)
		}
		c.maxHandshakes = n
		return nil
	})
}

// WithMaxOutgoingPerIP sets how many connections this agent keeps to one
// remote IP address, over all the agents there. Over it, the peers there
// idle the longest are closed to make room, or the transfer fails with
// [ErrOutgoingLimit]. Size it to ([WithStreams]+1) × the agents at one address
// busy at once (docs/tcp.md). Default: 1024.
func WithMaxOutgoingPerIP(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 2 || n > 1<<20 {
			return fmt.Errorf("%w: tcp: outgoing connections per address must be in [2, 1048576], got %d", agent.ErrInvalidOption, n)
		}
		c.maxOut = n
		return nil
	})
}

// WithIdleTimeout sets how long the connections to a peer stay open with no
// transfer or notification in flight; they are then closed with a goodbye
// that tells the peer this agent is not leaving, and the next transfer
// dials again. Default: 30 s.
func WithIdleTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("%w: tcp: idle timeout must be positive, got %v", agent.ErrInvalidOption, d)
		}
		c.idle = d
		return nil
	})
}

// DefaultLatencySpin is how long a connection's reader polls in latency
// mode when [WithLatencyMode] is given 0.
const DefaultLatencySpin = 50 * time.Microsecond

// WithLatencyMode trades CPU for latency: a connection that carried a READ
// or WRITE frame within the last spin keeps polling its socket
// (non-blocking reads, yielding the core between them) until spin after
// that frame before it blocks, as NIXL's progress thread and UCX do; back
// to back, small transfers then skip the wake-ups of the threads that
// would otherwise sleep between them. At most GOMAXPROCS-1 readers of a
// process poll at once. While transfers keep coming, it costs up to a core
// per process; on a machine with few cores to spare it makes transfers
// slower, not faster (docs/tcp.md, "Latency mode", gives the figures).
// Linux only: elsewhere it changes nothing. Give 0 for
// [DefaultLatencySpin]; at most 10 ms. Default: off, every reader blocks
// at once.
func WithLatencyMode(spin time.Duration) Option {
	return optionFunc(func(c *config) error {
		if spin < 0 || spin > 10*time.Millisecond {
			return fmt.Errorf("%w: tcp: latency-mode spin must be in [0, 10ms], got %v", agent.ErrInvalidOption, spin)
		}
		if spin == 0 {
			spin = DefaultLatencySpin
		}
		c.spin = spin
		return nil
	})
}
