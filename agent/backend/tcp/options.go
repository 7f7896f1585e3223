package tcp

import (
	"errors"
	"fmt"
	"net"
	"time"
)

// ErrInvalidOption reports an option value the backend cannot use. The
// agent's constructor returns it from Start.
var ErrInvalidOption = errors.New("tcp: invalid option")

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
	}
}

// WithListenAddr sets the address the backend listens on, as host:port.
// Default: "127.0.0.1:0", loopback on a free port, which only agents on the
// same host can reach; listen on a routable address (or ":0") to accept
// agents on other hosts.
func WithListenAddr(addr string) Option {
	return optionFunc(func(c *config) error {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("%w: listen address %q: %v", ErrInvalidOption, addr, err)
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
			return fmt.Errorf("%w: advertise address %q: %v", ErrInvalidOption, addr, err)
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
			return fmt.Errorf("%w: streams must be in [1, 64], got %d", ErrInvalidOption, n)
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
			return fmt.Errorf("%w: keepalive interval %v and timeout %v: need interval > 0 and timeout >= 2*interval", ErrInvalidOption, interval, timeout)
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
			return fmt.Errorf("%w: chunk size must be in [4 KiB, 16 MiB], got %d", ErrInvalidOption, n)
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
			return fmt.Errorf("%w: in-flight frames must be in [1, 256], got %d", ErrInvalidOption, n)
		}
		c.inflight = n
		return nil
	})
}
