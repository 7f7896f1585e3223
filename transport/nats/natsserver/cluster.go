package natsserver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// clusterOpts are what a server of a Cluster needs to join it.
type clusterOpts struct {
	name   string     // the cluster's name; "" for a lone server
	port   int        // the server's route port, the same across restarts
	routes []*url.URL // the other servers' route URLs
}

// clusterName names every Cluster's servers' cluster; each server is
// named clusterName-i.
const clusterName = "goxfer"

// portTries bounds how many sets of route ports StartCluster tries: the
// ports it picks are free when picked, but another process may take one
// before its server listens on it.
const portTries = 3

// formedPoll is how often StartCluster and Cluster.Restart look at the
// servers while they wait for the cluster to form: nats-server reports
// route and JetStream state only when asked.
const formedPoll = 20 * time.Millisecond

// Cluster is N embedded NATS servers on this machine routed into one
// cluster (full mesh), each with JetStream in its own store directory, so
// that a JetStream stream or key-value bucket can be replicated on up to N
// of them: the real topology of a NATS deployment, for tests and
// single-machine demos. Its methods are safe for concurrent use.
type Cluster struct {
	servers []*Server
	tempDir string // holds the servers' stores; removed by Shutdown; "" with WithStoreDir

	mu sync.Mutex // serializes Kill, Restart and Shutdown
}

// StartCluster starts a cluster of n servers (n from 1 to 16), each with
// JetStream, on random loopback ports (WithHost sets another interface),
// with routes from each server to all the others, and returns once every
// server is routed to every other and, with JetStream, a JetStream meta
// leader is elected that sees all n servers online: a stream with up to n
// replicas can be created then. ctx bounds the whole start (10 s if it
// has no deadline); a cluster not formed by then is shut down and the
// error says what was missing.
//
// Options: WithHost, WithStoreDir (server i keeps its store in
// dir/goxfer-i; default: fresh temporary directories, removed by
// Shutdown), WithoutJetStream, and WithServerOptions, whose functions see
// each server's options with ServerName ("goxfer-i"), Cluster and Routes
// already set and may change them (route through a proxy, say); they are
// called again on every restart. WithPort fails: each server has its own
// ports. Server logging is off.
func StartCluster(ctx context.Context, n int, opts ...Option) (*Cluster, error) {
	if n < 1 || n > 16 {
		return nil, fmt.Errorf("natsserver: StartCluster(%d servers): want 1 to 16", n)
	}
	o := options{host: "127.0.0.1", jetStream: true}
	for _, opt := range opts {
		if opt == nil {
			return nil, errors.New("natsserver: nil Option")
		}
		if err := opt.apply(&o); err != nil {
			return nil, err
		}
	}
	if o.port != 0 {
		return nil, fmt.Errorf("natsserver: StartCluster: WithPort(%d): the servers of a cluster each listen on a random port", o.port)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, readyWithin)
		defer cancel()
	}
	c := &Cluster{}
	base := o.storeDir
	if o.jetStream && base == "" {
		dir, err := os.MkdirTemp("", "goxfer-nats-cluster-*")
		if err != nil {
			return nil, fmt.Errorf("natsserver: JetStream store: %w", err)
		}
		c.tempDir, base = dir, dir
	}
	var err error
	for try := 1; try <= portTries; try++ {
		err = c.start(ctx, n, o, base)
		if err == nil {
			break
		}
		c.stopAll()
		if !errors.Is(err, syscall.EADDRINUSE) || ctx.Err() != nil {
			break
		}
		if c.tempDir != "" {
			// The next try is a new cluster: no peers remembered from this one.
			for i := range n {
				_ = os.RemoveAll(filepath.Join(base, clusterName+"-"+strconv.Itoa(i)))
			}
		}
	}
	if err != nil {
		c.removeTemp()
		return nil, err
	}
	if err := c.waitFormed(ctx, -1); err != nil {
		c.Shutdown()
		return nil, err
	}
	return c, nil
}

// start starts n servers on fresh route ports, storing under base.
func (c *Cluster) start(ctx context.Context, n int, o options, base string) error {
	ports, err := freePorts(o.host, n)
	if err != nil {
		return err
	}
	c.servers = make([]*Server, 0, n)
	for i := range n {
		so := o
		so.name = clusterName + "-" + strconv.Itoa(i)
		so.configure = append([]func(*server.Options){}, o.configure...)
		so.cluster = clusterOpts{name: clusterName, port: ports[i]}
		for j, p := range ports {
			if j != i {
				so.cluster.routes = append(so.cluster.routes, &url.URL{Scheme: "nats-route", Host: net.JoinHostPort(o.host, strconv.Itoa(p))})
			}
		}
		if o.jetStream {
			so.storeDir = filepath.Join(base, so.name)
		}
		s := &Server{o: so, port: server.RANDOM_PORT}
		if err := s.start(ctx); err != nil {
			return fmt.Errorf("natsserver: cluster server %d of %d: %w", i, n, err)
		}
		c.servers = append(c.servers, s)
	}
	return nil
}

// freePorts returns n distinct ports free on host now.
func freePorts(host string, n int) ([]int, error) {
	ports := make([]int, n)
	ls := make([]net.Listener, 0, n)
	defer func() {
		for _, l := range ls {
			_ = l.Close()
		}
	}()
	for i := range ports {
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			return nil, fmt.Errorf("natsserver: pick a route port on %s: %w", host, err)
		}
		ls = append(ls, l)
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return ports, nil
}

// waitFormed waits until every running server is routed to every other
// running one and, with JetStream, a meta leader sees them all online and
// every one of them follows it; restarted is the server just restarted
// (-1: none), named in the error. c.mu is held or c is not yet shared.
func (c *Cluster) waitFormed(ctx context.Context, restarted int) error {
	t := time.NewTicker(formedPoll)
	defer t.Stop()
	for {
		missing := c.missing()
		if missing == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			what := "cluster"
			if restarted >= 0 {
				what = fmt.Sprintf("server %d rejoining the cluster", restarted)
			}
			return fmt.Errorf("natsserver: %s: not formed: %s: %w", what, missing, context.Cause(ctx))
		case <-t.C:
		}
	}
}

// missing says what the cluster lacks to be formed; "" if nothing.
func (c *Cluster) missing() string {
	var live []*server.Server
	var names []string
	for _, s := range c.servers {
		s.mu.Lock()
		if !s.down && s.srv != nil {
			live = append(live, s.srv)
			names = append(names, s.o.name)
		}
		s.mu.Unlock()
	}
	for i, srv := range live {
		rz, err := srv.Routez(nil)
		if err != nil {
			return fmt.Sprintf("%s: routes: %v", names[i], err)
		}
		remotes := map[string]bool{}
		for _, r := range rz.Routes {
			remotes[r.RemoteName] = true
		}
		for j, other := range names {
			if j != i && !remotes[other] {
				return fmt.Sprintf("%s has no route to %s", names[i], other)
			}
		}
	}
	if len(live) == 0 || !c.servers[0].o.jetStream {
		return ""
	}
	var leader *server.Server
	for i, srv := range live {
		if srv.JetStreamIsLeader() {
			leader = srv
		}
		if !srv.JetStreamIsCurrent() {
			return fmt.Sprintf("%s does not follow a JetStream meta leader", names[i])
		}
	}
	if leader == nil {
		return "no JetStream meta leader"
	}
	online := map[string]bool{}
	for _, name := range leader.JetStreamClusterPeers() {
		online[name] = true
	}
	for _, name := range names {
		if !online[name] {
			return fmt.Sprintf("the JetStream meta leader %s does not see %s online", leader.Name(), name)
		}
	}
	return ""
}

// Len returns how many servers the cluster has, running or killed.
func (c *Cluster) Len() int { return len(c.servers) }

// Server returns server i (0 to Len()-1) of the cluster; it panics for
// another i. Its URL stays the same across Kill and Restart. Use the
// Cluster's Kill, Restart and Shutdown rather than the Server's: they keep
// the cluster's bookkeeping.
func (c *Cluster) Server(i int) *Server { return c.servers[i] }

// MetaLeader returns the index of the server that leads the JetStream
// meta group now (it places streams and consumers: while it is being
// re-elected, creating them waits), or -1 if no running server leads it,
// or the cluster runs without JetStream.
func (c *Cluster) MetaLeader() int {
	for i, s := range c.servers {
		s.mu.Lock()
		leads := !s.down && s.srv != nil && s.srv.JetStreamIsLeader()
		s.mu.Unlock()
		if leads {
			return i
		}
	}
	return -1
}

// URLs returns every server's client URL, such as
// "nats://127.0.0.1:4222", in server order, in a fresh slice. They stay the
// same across Kill and Restart.
func (c *Cluster) URLs() []string {
	urls := make([]string, len(c.servers))
	for i, s := range c.servers {
		urls[i] = s.URL()
	}
	return urls
}

// ClientURL returns every server's client URL joined by commas, as
// nats.Connect takes them: a client connects to one of them and fails
// over to the others.
func (c *Cluster) ClientURL() string { return strings.Join(c.URLs(), ",") }

// Connect dials the cluster (ClientURL) with nats.go's defaults and opts;
// the caller owns the connection and closes it.
func (c *Cluster) Connect(opts ...nats.Option) (*nats.Conn, error) {
	return nats.Connect(c.ClientURL(), opts...)
}

// Kill shuts server i down, as a server stopped for maintenance or lost
// would be: its clients lose their connections and reconnect to the
// others (if their connection knows them: ClientURL), its routes close,
// and its JetStream leaderships move to the servers left (it steps them
// down first, as a nats-server shutting down does; a crash would leave the
// others to elect new leaders, seconds later). Its store directory stays
// for Restart. Killing a killed server does nothing; Kill after Shutdown
// fails.
func (c *Cluster) Kill(i int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, err := c.server("Kill", i)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stop()
	return nil
}

// Restart shuts server i down if it runs and starts it again on the same
// client and route ports with the same JetStream store, and returns once
// the cluster is formed again (as StartCluster waits for it) with the
// servers running now; ctx bounds the wait (10 s if it has no deadline).
// It fails after Shutdown.
func (c *Cluster) Restart(ctx context.Context, i int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, err := c.server("Restart", i)
	if err != nil {
		return err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, readyWithin)
		defer cancel()
	}
	s.mu.Lock()
	s.stop()
	err = s.waitPortsFree()
	if err == nil {
		err = s.start(ctx)
	}
	s.mu.Unlock()
	if err != nil {
		return fmt.Errorf("natsserver: restart cluster server %d: %w", i, err)
	}
	return c.waitFormed(ctx, i)
}

// server returns server i for call, or an error if there is none or the
// cluster is shut down; c.mu is held.
func (c *Cluster) server(call string, i int) (*Server, error) {
	if i < 0 || i >= len(c.servers) {
		return nil, fmt.Errorf("natsserver: Cluster.%s(%d): want 0 to %d", call, i, len(c.servers)-1)
	}
	s := c.servers[i]
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shut {
		return nil, fmt.Errorf("natsserver: Cluster.%s(%d) after Shutdown", call, i)
	}
	return s, nil
}

// Shutdown stops every server and waits for them, then removes their
// temporary store directories (not those under WithStoreDir's). Idempotent.
func (c *Cluster) Shutdown() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, s := range c.servers {
		s.Shutdown()
	}
	c.removeTemp()
}

// stopAll shuts down the servers of a failed start; c is not yet shared.
func (c *Cluster) stopAll() {
	for _, s := range c.servers {
		s.Shutdown()
	}
	c.servers = nil
}

func (c *Cluster) removeTemp() {
	if c.tempDir != "" {
		_ = os.RemoveAll(c.tempDir)
		c.tempDir = ""
	}
}
