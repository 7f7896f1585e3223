package ucx

import (
	"fmt"
	"strings"
	"time"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/internal/oneline"
)

// Option configures a [Backend]; [New] applies them in order, later ones
// winning. An Option holds no state and may be reused for several backends.
// docs/ucx.md (Options) explains each in full.
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

// WithTransports sets the UCX transports of this backend's context alone, in
// UCX_TLS syntax ("tcp,self", "rc,sm,self", "^tcp"); the process
// environment is left alone. Default: UCX_TLS from the environment, else
// every transport UCX finds.
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

// WithConfig sets the UCX variable UCX_<key> ("NET_DEVICES", "RNDV_THRESH")
// for this backend's context alone, over the environment's; a later setting
// of a key wins, and "TLS" is [WithTransports]. Default: none.
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

// WithTimeout bounds how long the backend waits for a peer's answer to a
// connection or lease request, and for any sign of life from a connected
// peer; a peer silent for longer is lost ([agent.ErrRemoteLost]). At least
// 100 ms. Default: 3 s.
func WithTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d < 100*time.Millisecond {
			return fmt.Errorf("%w: ucx: timeout must be at least 100ms, got %v", agent.ErrInvalidOption, d)
		}
		c.timeout = d
		return nil
	})
}

// WithLeaseSize sets the most bytes one lease covers, in [64 KiB, 1 GiB]:
// revoking an exposure waits for about two leases per transfer in flight.
// Default: 16 MiB.
func WithLeaseSize(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 64<<10 || n > 1<<30 {
			return fmt.Errorf("%w: ucx: lease size must be in [64 KiB, 1 GiB], got %d", agent.ErrInvalidOption, n)
		}
		c.lease = n
		return nil
	})
}

// WithGetReads makes a READ a ucp_get_nbx by the reading agent, as NIXL
// does, instead of a ucp_put_nbx by the exposing agent into the reader's
// memory; for transports that get in hardware (rc, dc, cma) only, since
// UCX's software get can abort the exposing process. Default: false.
func WithGetReads(on bool) Option {
	return optionFunc(func(c *config) error {
		c.getReads = on
		return nil
	})
}

// WithInlineSize sets the largest transfer (all its segments together,
// host memory on both sides) whose bytes travel in the control messages
// instead of by RMA: one round trip, no remote key. 0 turns it off.
// Default and maximum: 16 KiB.
func WithInlineSize(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 0 || n > maxInline {
			return fmt.Errorf("%w: ucx: inline size must be in [0, %d], got %d", agent.ErrInvalidOption, maxInline, n)
		}
		c.inline = n
		return nil
	})
}

// WithSysvBesidePosix adds sysv to a transport list (of [WithTransports] or
// UCX_TLS) that names posix but not sysv, and not starting with "^": it
// avoids a crash of UCX 1.21 and later over posix alone. Default: true.
func WithSysvBesidePosix(on bool) Option {
	return optionFunc(func(c *config) error {
		c.noSysv = !on
		return nil
	})
}

// CheckOptions reports invalid options as [New]'s backend would from Start,
// without creating anything: an error wrapping [agent.ErrInvalidOption], or
// nil. Safe for concurrent use.
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
		return c, oneline.Join(errs...)
	}
	return c, nil
}
