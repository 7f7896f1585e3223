package ucx

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/goxfer/goxfer/agent"
)

// Option configures a Backend.
type Option interface{ apply(*config) error }

type optionFunc func(*config) error

func (f optionFunc) apply(c *config) error { return f(c) }

type config struct {
	tls       string
	settings  [][2]string // WithConfig, in order
	timeout   time.Duration
	lease     int
	maxNotify int
	maxRanges int
	getReads  bool
	inline    int
	noSysv    bool // WithSysvBesidePosix(false)
}

func defaults() config {
	return config{
		timeout:   3 * time.Second,
		lease:     16 << 20,
		maxNotify: 64 << 10,
		maxRanges: 4096,
		inline:    maxInline,
	}
}

// WithTransports sets the UCX transports this backend's context may use, in
// UCX_TLS syntax ("tcp,self", "posix,self", "rc,sm,self", "^tcp"). It
// applies to this backend only: the process environment is left alone.
// Default: UCX's own choice, that is UCX_TLS from the environment, or all
// transports UCX finds.
func WithTransports(tls string) Option {
	return optionFunc(func(c *config) error {
		tls = strings.TrimSpace(tls)
		if tls == "" || strings.ContainsAny(tls, " \t\n=") {
			return fmt.Errorf("%w: ucx: transports %q: want a UCX_TLS list such as \"tcp,self\"", agent.ErrInvalidOption, tls)
		}
		c.tls = tls
		return nil
	})
}

// WithConfig sets one UCX configuration variable for this backend's
// context, named without the UCX_ prefix ("NET_DEVICES", "RNDV_THRESH"),
// as the environment variable UCX_<key> would. It overrides the
// environment for this backend only. Later settings of a key win; TLS is
// WithTransports. Default: none.
func WithConfig(key, value string) Option {
	return optionFunc(func(c *config) error {
		key = strings.TrimPrefix(strings.TrimSpace(key), "UCX_")
		if key == "" || strings.ContainsAny(key, " \t\n=") || strings.ToUpper(key) != key {
			return fmt.Errorf("%w: ucx: configuration key %q: want an upper-case UCX variable name", agent.ErrInvalidOption, key)
		}
		if key == "TLS" {
			return WithTransports(value).apply(c)
		}
		c.settings = append(c.settings, [2]string{key, value})
		return nil
	})
}

// WithTimeout bounds how long the backend waits for a peer: for the answer
// to a connection or lease request, and for any sign of life from a
// connected peer (each side hears from the other at least four times per
// timeout while connected). A peer silent for longer is lost
// (agent.ErrRemoteLost). Shared-memory transports report no failure of a
// peer that dies (a killed process leaves its segments mapped), so this is
// how long such a loss takes to surface. Default: 3 s.
func WithTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d < 100*time.Millisecond {
			return fmt.Errorf("%w: ucx: timeout must be at least 100ms, got %v", agent.ErrInvalidOption, d)
		}
		c.timeout = d
		return nil
	})
}

// WithLeaseSize sets the most bytes one lease covers. The exposing agent
// checks and grants each lease before its bytes move and the transferring
// agent ends it once they have, so revoking an exposure waits for at most
// about two leases' worth of transfer per transfer in flight. Default:
// 16 MiB.
func WithLeaseSize(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 64<<10 || n > 1<<30 {
			return fmt.Errorf("%w: ucx: lease size must be in [64 KiB, 1 GiB], got %d", agent.ErrInvalidOption, n)
		}
		c.lease = n
		return nil
	})
}

// WithGetReads makes a READ a one-sided ucp_get_nbx by the reading agent,
// as NIXL does, instead of a ucp_put_nbx by the exposing agent into the
// reader's memory (after the same checks of the lease). UCX 1.13 emulates
// get in software over tcp (and over shared memory for memory it did not
// allocate): the exposing process serves each get from its progress
// thread, and aborts (ucp_get_req_handler: "unexpected error") when the
// reading process dies with gets in flight. Turn it on with transports
// that get in hardware (rc, dc, cma). Default: false.
func WithGetReads(on bool) Option {
	return optionFunc(func(c *config) error {
		c.getReads = on
		return nil
	})
}

// WithInlineSize sets the largest transfer (in bytes, all its descriptors
// together, host memory on both sides) that travels in the control
// messages instead of by RMA: the bytes of a WRITE go in the lease
// request and the exposing agent copies them in after checking their
// ranges; those of a READ come back in its answer. Such a transfer takes
// one round trip instead of two or three, hands out no remote key, and the
// exposing agent checks every byte. 0 turns it off. Default and maximum:
// 16 KiB.
func WithInlineSize(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 0 || n > maxInline {
			return fmt.Errorf("%w: ucx: inline size must be in [0, %d], got %d", agent.ErrInvalidOption, maxInline, n)
		}
		c.inline = n
		return nil
	})
}

// WithSysvBesidePosix adds UCX's sysv transport to a transport list that
// names posix but not sysv ("posix,self" becomes "posix,self,sysv", from
// WithTransports or UCX_TLS alike). Both are UCX's shared-memory (mm)
// transports, with the same FIFOs and copies; with both loaded UCX prefers
// sysv, as it does for "sm" or by default. posix alone lets UCX 1.21 and
// later crash a process whose progress was held up while a peer that had
// just asked to connect closed or exited (docs/ucx.md, Limitations):
// posix can then reach no one, while sysv's reachability depends on the
// host only, so UCX fails that request's endpoint instead of crashing.
// Lists starting with "^" are left as they are. Default: true.
func WithSysvBesidePosix(on bool) Option {
	return optionFunc(func(c *config) error {
		c.noSysv = !on
		return nil
	})
}

// CheckOptions reports invalid options as New's backend would from Start,
// without creating anything: an error wrapping agent.ErrInvalidOption, or nil.
func CheckOptions(opts ...Option) error {
	_, err := newConfig(opts)
	return err
}

// newConfig applies opts to the defaults.
func newConfig(opts []Option) (config, error) {
	c := defaults()
	var errs []error
	for _, o := range opts {
		if o == nil {
			errs = append(errs, fmt.Errorf("%w: ucx: nil option", agent.ErrInvalidOption))
			continue
		}
		if err := o.apply(&c); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return c, errors.Join(errs...)
	}
	return c, nil
}
