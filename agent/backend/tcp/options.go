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
// address to which this agent already holds WithMaxOutgoingPerIP
// connections, none of them idle. It says nothing about the peer, which
// may well be alive: it does not match agent.ErrRemoteLost.
var ErrOutgoingLimit = errors.New("tcp: outgoing connections per address at the limit (tcp.WithMaxOutgoingPerIP)")

// Option configures a Backend.
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

// WithAdvertiseAddr sets the host:port published to remote agents. Default:
// the bound listen address; when listening on an unspecified address (":0",
// "0.0.0.0"), the host's first non-loopback IPv4 address and the bound port.
// Set it when peers must reach this agent through a NAT, a proxy or a
// different interface.
func WithAdvertiseAddr(addr string) Option {
	return optionFunc(func(c *config) error {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("%w: tcp: advertise address %q: %v", agent.ErrInvalidOption, addr, err)
		}
		c.advertise = addr
		return nil
	})
}

// WithStreams sets how many data connections carry transfers to each peer;
// large transfers are split into chunks pipelined over all of them. A
// separate control connection carries notifications. Default: 4.
func WithStreams(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 || n > 64 {
			return fmt.Errorf("%w: tcp: streams must be in [1, 64], got %d", agent.ErrInvalidOption, n)
		}
		c.streams = n
		return nil
	})
}

// WithKeepalive sets how often an idle connection sends a keepalive and how
// long a peer may stay silent, or leave a request unanswered, before it is
// declared lost (ErrRemoteLost). Keepalives on an idle connection can be up
// to 1.5 intervals apart, so timeout must be at least twice interval.
// Default: 1 s and 4 s.
func WithKeepalive(interval, timeout time.Duration) Option {
	return optionFunc(func(c *config) error {
		if interval <= 0 || timeout < 2*interval {
			return fmt.Errorf("%w: tcp: keepalive interval %v and timeout %v: need interval > 0 and timeout >= 2*interval", agent.ErrInvalidOption, interval, timeout)
		}
		c.interval, c.timeout = interval, timeout
		return nil
	})
}

// WithChunkSize sets the most bytes one frame carries; larger descriptors are
// split, smaller ones batched into one frame up to this size. Default: 2 MiB.
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
// Default: 4.
func WithInflight(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 || n > 256 {
			return fmt.Errorf("%w: tcp: in-flight frames must be in [1, 256], got %d", agent.ErrInvalidOption, n)
		}
		c.inflight = n
		return nil
	})
}

// WithMaxFrameSize sets the most payload bytes one READ or WRITE request may
// carry: the sum of its pieces' lengths. A request over it closes the
// connection and is counted in Stats.LimitRejected. The limit is announced
// in the handshake, and a peer running this version cuts its frames to fit;
// it must be at least this agent's own chunk size (WithChunkSize), which New
// checks. Default: 16 MiB, the largest chunk size, so that it never refuses
// a peer of any configuration.
func WithMaxFrameSize(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 4<<10 || n > 256<<20 {
			return fmt.Errorf("%w: tcp: max frame size must be in [4 KiB, 256 MiB], got %d", agent.ErrInvalidOption, n)
		}
		c.maxFrame = n
		return nil
	})
}

// WithMaxPieces sets the most pieces (address, length) one READ or WRITE
// request may name, and so the size of the table the exposing agent reads
// for it (16 bytes a piece). A request over it closes the connection and is
// counted in Stats.LimitRejected. This agent's own requests use at most as
// many, and at most what each peer announces in its handshake. Default:
// 1024, the pieces a vectored system call takes at once (IOV_MAX).
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
// this one at once. Each connection has at most one request being served, so
// this also bounds the requests, leases and serving goroutines a peer can
// occupy. An agent's identity is only claimed in the handshake, so the limit
// counts connections per identity and remote address together: a stranger
// elsewhere who claims a peer's identity cannot use up that peer's share. A
// connection over the limit is closed at once and counted in
// Stats.LimitRejected; the dialler sees agent.ErrRemoteLost. Default: 256,
// four times what the busiest legitimate peer holds (64 streams and a
// control connection), which leaves room for a peer reconnecting while its
// old connections are still being torn down and for a peer that reaches
// this agent under two advertised addresses.
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
// address at once, in the handshake or past it. It bounds what one host can
// hold however many identities it claims. A connection over the limit is
// closed as soon as it is accepted, before a byte is read, and counted in
// Stats.LimitRejected. Default: 4096: sixteen agents on one host (or behind
// one NAT address) each with 64 streams and reconnecting, or hundreds with
// the default 4 streams.
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
// handshake at once, from all addresses together. A handshake must complete
// within the keepalive timeout; when a new connection finds the limit
// reached, the oldest unfinished handshake is closed to make room and
// counted in Stats.LimitRejected. A flood of connections that never
// handshake (slow-loris) thus holds a bounded number of goroutines and
// sockets, and cannot lock legitimate peers out: their handshakes complete
// in one round trip, long before a flood pushes them out. Default: 256; a
// legitimate agent dials its connections one after another, so this is 256
// agents connecting in the same round trip.
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
// remote IP address, over all the agents there: tokens name any identity at
// any address, so a token issuer must not make this agent hoard
// connections. When a transfer needs a new connection over the limit, the
// agents at that address idle the longest are closed to make room; if none
// is idle, the transfer fails with ErrOutgoingLimit, not
// agent.ErrRemoteLost: the peer may well be alive. Each agent this agent
// transfers with at once holds WithStreams+1 connections, so size it to
// (streams+1) × the agents at one address busy at once, with room for
// reconnects. Default: 1024, about two hundred busy agents at one address
// at the default 4 streams, or fifteen at 64.
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
