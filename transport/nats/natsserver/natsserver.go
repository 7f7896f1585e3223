// Package natsserver runs an embedded NATS server, with JetStream, inside
// the process: for single-machine deployments, examples and tests of code
// that uses goxfer's transport/nats. It is the only goxfer package that
// imports nats-server; programs that do not import it do not link it.
//
//	srv, err := natsserver.Start(ctx)
//	if err != nil { ... }
//	defer srv.Shutdown()
//	nc, err := srv.Connect()
//
// [StartCluster] runs N such servers routed into one cluster, each with
// JetStream, the topology of a real deployment on one machine: a stream
// or the goxfer registry's bucket can be replicated on three of them, and
// a test can kill and restart any one.
//
//	c, err := natsserver.StartCluster(ctx, 3)
//	if err != nil { ... }
//	defer c.Shutdown()
//	nc, err := c.Connect(nats.MaxReconnects(-1)) // any server, failing over to the others
package natsserver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// readyWithin bounds how long Start (when its ctx has no earlier deadline)
// and Restart wait for the server to accept connections.
const readyWithin = 10 * time.Second

// Option configures Start.
type Option interface{ apply(*options) error }

type optionFunc func(*options) error

func (f optionFunc) apply(o *options) error { return f(o) }

type options struct {
	host      string
	port      int
	storeDir  string
	jetStream bool
	configure []func(*server.Options)
	// Set by StartCluster for each of its servers; zero for a lone one.
	name    string      // the server's name, unique in its cluster
	cluster clusterOpts // its cluster; cluster.name "" for a lone server
}

// WithPort makes the server listen on port. Default: a random free port.
func WithPort(port int) Option {
	return optionFunc(func(o *options) error {
		if port < 1 || port > 65535 {
			return fmt.Errorf("natsserver: WithPort(%d): want 1 to 65535", port)
		}
		o.port = port
		return nil
	})
}

// WithHost makes the server listen on host. Default: "127.0.0.1", reachable
// from this machine only.
func WithHost(host string) Option {
	return optionFunc(func(o *options) error {
		if host == "" {
			return errors.New("natsserver: WithHost needs a host")
		}
		o.host = host
		return nil
	})
}

// WithStoreDir makes JetStream keep its data in dir, which survives
// Shutdown. Default: a fresh temporary directory, removed by Shutdown.
func WithStoreDir(dir string) Option {
	return optionFunc(func(o *options) error {
		if dir == "" {
			return errors.New("natsserver: WithStoreDir needs a directory")
		}
		o.storeDir = dir
		return nil
	})
}

// WithoutJetStream runs the server without JetStream (no presence
// registry then). Default: JetStream on.
func WithoutJetStream() Option {
	return optionFunc(func(o *options) error {
		o.jetStream = false
		return nil
	})
}

// WithServerOptions lets f adjust the server's options after the others
// are applied: users and permissions, limits such as MaxPayload, TLS. f is
// called again on every Restart. Default: none.
func WithServerOptions(f func(*server.Options)) Option {
	return optionFunc(func(o *options) error {
		if f == nil {
			return errors.New("natsserver: WithServerOptions needs a function")
		}
		o.configure = append(o.configure, f)
		return nil
	})
}

// Server is an embedded NATS server. Its methods are safe for concurrent
// use.
type Server struct {
	o       options
	tempDir string // removed by Shutdown; "" with WithStoreDir

	mu   sync.Mutex
	srv  *server.Server
	port int
	down bool // stopped, by Shutdown or within Restart
	shut bool // Shutdown was called
}

// Start starts a server, by default on 127.0.0.1, on a random port, with
// JetStream storing in a fresh temporary directory, and returns once it
// accepts connections; ctx bounds the wait (10 s if it has no deadline),
// and a server not ready by then is shut down. A port that is taken
// ([WithPort]) fails at once with an error saying "address in use" that
// matches [syscall.EADDRINUSE]. Its logging is off.
func Start(ctx context.Context, opts ...Option) (*Server, error) {
	o := options{host: "127.0.0.1", jetStream: true}
	for _, opt := range opts {
		if opt == nil {
			return nil, errors.New("natsserver: nil Option")
		}
		if err := opt.apply(&o); err != nil {
			return nil, err
		}
	}
	s := &Server{o: o, port: o.port}
	if o.jetStream && o.storeDir == "" {
		dir, err := os.MkdirTemp("", "goxfer-nats-*")
		if err != nil {
			return nil, fmt.Errorf("natsserver: JetStream store: %w", err)
		}
		s.tempDir = dir
	}
	if s.port == 0 {
		s.port = server.RANDOM_PORT
	}
	if err := s.start(ctx); err != nil {
		s.removeTemp()
		return nil, err
	}
	return s, nil
}

// start runs a fresh server on s.port (random the first time) and records
// the port it got, so that Restart comes back on it. s.mu is held or s is
// not yet shared.
func (s *Server) start(ctx context.Context) error {
	so := &server.Options{
		Host:      s.o.host,
		Port:      s.port,
		JetStream: s.o.jetStream,
		StoreDir:  s.o.storeDir,
		NoLog:     true,
		NoSigs:    true,
	}
	if s.o.cluster.name != "" {
		so.ServerName = s.o.name
		so.Cluster = server.ClusterOpts{Name: s.o.cluster.name, Host: s.o.host, Port: s.o.cluster.port}
		so.Routes = s.o.cluster.routes
	}
	if s.tempDir != "" {
		so.StoreDir = s.tempDir
	}
	for _, f := range s.o.configure {
		f(so)
	}
	addr := net.JoinHostPort(s.o.host, strconv.Itoa(s.port))
	srv, err := server.NewServer(so)
	if err != nil {
		return fmt.Errorf("natsserver: %w", err)
	}
	// The server reports a failure to listen only to its logger, and would
	// otherwise be waited for until readyWithin.
	fatal := &fatalLogger{}
	srv.SetLogger(fatal, false, false)
	stop := func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
	started := make(chan struct{})
	go func() {
		defer close(started)
		srv.Start() // returns once it listens, or failed to
	}()
	select {
	case <-started:
	case <-ctx.Done():
		<-started
	}
	if ctx.Err() != nil {
		stop()
		return fmt.Errorf("natsserver: start on %s: %w", addr, context.Cause(ctx))
	}
	if err := fatal.failure(); err != nil {
		stop()
		if errors.Is(err, syscall.EADDRINUSE) {
			if s.o.cluster.name != "" {
				return fmt.Errorf("natsserver: listen on %s or its route port %d: address in use: %w", addr, s.o.cluster.port, err)
			}
			return fmt.Errorf("natsserver: listen on %s: address in use: %w", addr, err)
		}
		return fmt.Errorf("natsserver: start on %s: %w", addr, err)
	}
	wait := readyWithin
	if dl, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(dl))
	}
	if !srv.ReadyForConnections(wait) {
		stop()
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("natsserver: start on %s: %w", addr, context.Cause(ctx))
		}
		return fmt.Errorf("natsserver: server on %s not ready within %v", addr, wait)
	}
	if a, ok := srv.Addr().(*net.TCPAddr); ok {
		s.port = a.Port
	}
	s.srv = srv
	s.down = false
	return nil
}

// fatalLogger is the server's logger: it drops everything but the first
// fatal error, such as a port already taken.
type fatalLogger struct {
	mu  sync.Mutex
	err error
}

func (l *fatalLogger) failure() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// Fatalf records the first fatal error: the error among v if there is
// one (the listener's, say, so that errors.Is sees the errno), else the
// message.
func (l *fatalLogger) Fatalf(format string, v ...any) {
	err := errors.New(fmt.Sprintf(format, v...))
	for _, a := range v {
		if e, ok := a.(error); ok {
			err = e
			break
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err == nil {
		l.err = err
	}
}

func (*fatalLogger) Noticef(string, ...any) {}
func (*fatalLogger) Warnf(string, ...any)   {}
func (*fatalLogger) Errorf(string, ...any)  {}
func (*fatalLogger) Debugf(string, ...any)  {}
func (*fatalLogger) Tracef(string, ...any)  {}

// URL returns the server's client URL, such as "nats://127.0.0.1:4222".
// It stays the same across Restart.
func (s *Server) URL() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return "nats://" + net.JoinHostPort(s.o.host, strconv.Itoa(s.port))
}

// Name returns the server's name in its cluster, "goxfer-i" for server i
// of a [Cluster]; "" for a server started alone.
func (s *Server) Name() string { return s.o.name }

// Connect dials the server with nats.go's defaults and opts; the caller
// owns the connection and closes it.
func (s *Server) Connect(opts ...nats.Option) (*nats.Conn, error) {
	return nats.Connect(s.URL(), opts...)
}

// Shutdown stops the server and waits for it, then removes its temporary
// store directory (not one given with WithStoreDir). Idempotent.
func (s *Server) Shutdown() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.shut = true
	s.stop()
	s.removeTemp()
}

func (s *Server) stop() {
	if s.down || s.srv == nil {
		return
	}
	s.srv.Shutdown()
	s.srv.WaitForShutdown()
	s.down = true
}

func (s *Server) removeTemp() {
	if s.tempDir != "" {
		_ = os.RemoveAll(s.tempDir)
		s.tempDir = ""
	}
}

// Restart shuts the server down and starts it again on the same port with
// the same JetStream store, as a server restart in production would: its
// clients lose their connections and reconnect. It fails after Shutdown.
func (s *Server) Restart() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shut {
		return errors.New("natsserver: Restart after Shutdown")
	}
	s.stop()
	if err := s.waitPortsFree(); err != nil {
		return err
	}
	return s.start(context.Background())
}

// waitPortsFree waits, up to readyWithin, until the ports of the server
// just stopped can be listened on again, should its old listeners still
// hold them.
func (s *Server) waitPortsFree() error {
	addrs := []string{net.JoinHostPort(s.o.host, strconv.Itoa(s.port))}
	if s.o.cluster.name != "" {
		addrs = append(addrs, net.JoinHostPort(s.o.host, strconv.Itoa(s.o.cluster.port)))
	}
	deadline := time.Now().Add(readyWithin)
	for _, addr := range addrs {
		for {
			l, err := net.Listen("tcp", addr)
			if err == nil {
				_ = l.Close()
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("natsserver: restart: port still busy: %w", err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nil
}
