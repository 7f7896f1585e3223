package nats

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/netns"
	"github.com/goxfer/goxfer/internal/pattern"
	"github.com/goxfer/goxfer/internal/testproc"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// Hosts in network namespaces (internal/netns): each child process of
// these tests runs in a namespace of its own, or shares one, and so meets
// the others as a process of another host, or of the same host, does.
// The test binary is the child: hostChildEnv makes it one (see init), and
// hostConfigEnv says what it runs.
const (
	hostChildEnv  = "GOXFER_NATS_HOST_CHILD"
	hostConfigEnv = "GOXFER_NATS_HOST_CONFIG"
)

// hostHeartbeat is the registry heartbeat of the children: departures
// take two of them.
const hostHeartbeat = 250 * time.Millisecond

// The children start from init, before TestMain: TestMain belongs to
// main_test.go and serves the package's other children.
func init() {
	if os.Getenv(hostChildEnv) != "" {
		os.Exit(runHostChild())
	}
}

// hostConfig is what a child runs: Role "server" runs an embedded NATS
// server listening on Listen; Role "peer" runs a Connector whose tcp
// backend listens on Listen (and advertises Advertise, if set), joins the
// registry in Bucket at URL, and serves KV blocks on Subject.
type hostConfig struct {
	Role      string
	Listen    string
	Advertise string
	URL       string
	Bucket    string
	Subject   string
}

// hostHello is a child's first answer.
type hostHello struct {
	URL   string // a server's
	Agent string // a peer's agent ID
	Err   string
}

// hostCmd asks a peer to read a block of Size bytes of Seed's pattern
// from the peer serving Subject ("read"), or to wait until the registry
// reports agent ID departed ("departed").
type hostCmd struct {
	Op      string
	Subject string
	Size    int
	Seed    uint64
	ID      string
}

// hostAnswer answers a hostCmd: for a read, the path and backend that
// moved the bytes and whether the token was compact; for a departure,
// when the peer heard of it.
type hostAnswer struct {
	Path, Backend string
	Compact       bool
	At            time.Time
	Err           string
}

// blockRequest is what a reader asks the serving peer for, over NATS.
type blockRequest struct {
	Size int
	Seed uint64
}

func runHostChild() int {
	var cfg hostConfig
	if err := json.Unmarshal([]byte(os.Getenv(hostConfigEnv)), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "host child: config:", err)
		return 2
	}
	out := json.NewEncoder(os.Stdout)
	// Once the parent closes stdin, whatever the network, the child is
	// gone within a few seconds: a peer whose link is down cannot say
	// goodbye.
	stop := func(closers ...func()) int {
		_, _ = io.Copy(io.Discard, os.Stdin)
		time.AfterFunc(5*time.Second, func() { os.Exit(0) })
		for _, c := range closers {
			c()
		}
		return 0
	}
	switch cfg.Role {
	case "server":
		srv, err := natsserver.Start(context.Background(), natsserver.WithHost(cfg.Listen), natsserver.WithPort(4222))
		if err != nil {
			_ = out.Encode(hostHello{Err: err.Error()})
			return 1
		}
		_ = out.Encode(hostHello{URL: srv.URL()})
		return stop(srv.Shutdown)
	case "peer":
		p, err := startHostPeer(cfg)
		if err != nil {
			_ = out.Encode(hostHello{Err: err.Error()})
			return 1
		}
		_ = out.Encode(hostHello{Agent: p.conn.AgentInfo().ID().String()})
		in := json.NewDecoder(os.Stdin)
		for {
			var c hostCmd
			if err := in.Decode(&c); err != nil {
				break
			}
			_ = out.Encode(p.do(c))
		}
		return stop(p.close)
	}
	fmt.Fprintf(os.Stderr, "host child: role %q\n", cfg.Role)
	return 2
}

// hostPeer is a peer child's state.
type hostPeer struct {
	nc   *nats.Conn
	reg  *Registry
	conn *connect.Connector
	svc  *Service

	mu       sync.Mutex
	departed map[uuid.UUID]time.Time
	changed  chan struct{} // closed and replaced when departed grows
	cancel   context.CancelFunc
	wg       sync.WaitGroup
}

func startHostPeer(cfg hostConfig) (*hostPeer, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	p := &hostPeer{departed: map[uuid.UUID]time.Time{}, changed: make(chan struct{})}
	var err error
	if p.nc, err = nats.Connect(cfg.URL); err != nil {
		return nil, err
	}
	if p.reg, err = OpenRegistry(ctx, p.nc, WithBucket(cfg.Bucket), WithHeartbeat(hostHeartbeat), WithLogger(log)); err != nil {
		return nil, err
	}
	tcpOpts := []tcp.Option{tcp.WithListenAddr(cfg.Listen)}
	if cfg.Advertise != "" {
		tcpOpts = append(tcpOpts, tcp.WithAdvertiseAddr(cfg.Advertise))
	}
	if p.conn, err = connect.NewConnector(connect.WithLogger(log), connect.WithResolver(p.reg), connect.WithTCPOptions(tcpOpts...)); err != nil {
		return nil, err
	}
	if _, err = p.reg.Join(ctx, p.conn); err != nil {
		return nil, err
	}
	var watchCtx context.Context
	watchCtx, p.cancel = context.WithCancel(context.Background())
	events := p.reg.Watch(watchCtx)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for ev := range events {
			if ev.Departed {
				p.mu.Lock()
				p.departed[ev.ID] = time.Now()
				close(p.changed)
				p.changed = make(chan struct{})
				p.mu.Unlock()
			}
		}
	}()
	// Each request gets a block of its own, filled with its pattern and
	// exposed until the reader is done; the token in the reply is compact.
	p.svc, err = Serve(p.nc, cfg.Subject, func(ctx context.Context, req *ServiceRequest) (*Reply, error) {
		var br blockRequest
		if err := json.Unmarshal(req.Data, &br); err != nil {
			return nil, err
		}
		block := make([]byte, br.Size)
		pattern.Fill(block, br.Seed, 0, 0)
		op, err := p.conn.CreateReadable(ctx, connect.NewDescriptor(block))
		if err != nil {
			return nil, err
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			wctx, cancel := context.WithTimeout(watchCtx, 30*time.Second)
			defer cancel()
			_ = op.Wait(wctx)
			_ = op.Close()
		}()
		return &Reply{Metadata: op.Metadata().Compact()}, nil
	}, WithLogger(log))
	return p, err
}

func (p *hostPeer) do(c hostCmd) hostAnswer {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	fail := func(err error) hostAnswer { return hostAnswer{Err: err.Error()} }
	switch c.Op {
	case "read":
		data, _ := json.Marshal(blockRequest{Size: c.Size, Seed: c.Seed})
		rep, err := Request(ctx, p.nc, c.Subject, data)
		if err != nil {
			return fail(err)
		}
		dst := make([]byte, c.Size)
		rop, err := p.conn.BeginRead(ctx, rep.Metadata, connect.NewDescriptor(dst))
		if err != nil {
			return fail(err)
		}
		a := hostAnswer{Path: rop.Path(), Backend: rop.Backend(), Compact: rep.Metadata.IsCompact()}
		if err := rop.Wait(ctx); err != nil {
			a.Err = err.Error()
		} else if err := pattern.Check(dst, c.Seed, 0, 0); err != nil {
			a.Err = err.Error()
		}
		return a
	case "departed":
		id, err := uuid.Parse(c.ID)
		if err != nil {
			return fail(err)
		}
		for {
			p.mu.Lock()
			at, ok := p.departed[id]
			changed := p.changed
			p.mu.Unlock()
			if ok {
				return hostAnswer{At: at}
			}
			select {
			case <-changed:
			case <-ctx.Done():
				return fail(fmt.Errorf("agent %s not reported departed: %w", id, ctx.Err()))
			}
		}
	}
	return fail(fmt.Errorf("unknown op %q", c.Op))
}

func (p *hostPeer) close() {
	p.cancel()
	_ = p.svc.Close()
	_ = p.conn.Close()
	_ = p.reg.Close()
	p.nc.Close()
	p.wg.Wait()
}

// hostProc is the parent's handle on a child in a namespace.
type hostProc struct {
	t     *testing.T
	host  *netns.Host
	proc  *testproc.Proc
	hello hostHello
	in    *json.Encoder
}

// startOnHost runs a child with cfg on h; it stops when the test ends.
func startOnHost(t *testing.T, h *netns.Host, cfg hostConfig) *hostProc {
	t.Helper()
	raw, err := json.Marshal(cfg)
	require.NoError(t, err)
	hp := &hostProc{t: t, host: h}
	hp.proc = testproc.Spawn(t, hostChildEnv, &hp.hello, func(cmd *exec.Cmd) {
		cmd.Env = append(cmd.Env, hostConfigEnv+"="+string(raw))
		h.Wrap(cmd)
	})
	t.Cleanup(func() {
		if err := hp.proc.Stop(); err != nil {
			t.Errorf("%s on %s: %v; stderr:\n%s", cfg.Role, h.Name, err, hp.proc.Stderr())
		}
	})
	require.Empty(t, hp.hello.Err, "%s on %s", cfg.Role, h.Name)
	hp.in = json.NewEncoder(hp.proc.Stdin)
	return hp
}

// do sends c to the peer and returns its answer; it fails the test if none
// comes within a minute.
func (hp *hostProc) do(c hostCmd) hostAnswer {
	hp.t.Helper()
	require.NoError(hp.t, hp.in.Encode(c))
	got := make(chan error, 1)
	var a hostAnswer
	go func() { got <- hp.proc.Stdout.Decode(&a) }()
	select {
	case err := <-got:
		require.NoError(hp.t, err, "answer from %s; stderr:\n%s", hp.host.Name, hp.proc.Stderr())
	case <-time.After(time.Minute):
		hp.t.Fatalf("no answer from %s to %+v in a minute; stderr:\n%s", hp.host.Name, c, hp.proc.Stderr())
	}
	return a
}

// read has hp read a block of size bytes from the peer serving subject.
func (hp *hostProc) read(subject string, size int) hostAnswer {
	hp.t.Helper()
	return hp.do(hostCmd{Op: "read", Subject: subject, Size: size, Seed: pattern.NextSeed()})
}

// Peers on hosts of their own (network namespaces joined by a bridge, NATS
// on a fourth): compact tokens go through NATS and resolve through the
// registry, the bytes go over tcp to the advertised addresses (cma cannot
// reach another network namespace; it does within one), a peer
// advertising loopback is refused with an error naming the options that
// fix it, and a host whose link goes down is reported departed by the
// registry on the others.
func TestHostsInNetworkNamespaces(t *testing.T) {
	n := netns.New(t, 4)
	natsHost, hostA, hostB, hostL := n.Hosts[0], n.Hosts[1], n.Hosts[2], n.Hosts[3]
	srv := startOnHost(t, natsHost, hostConfig{Role: "server", Listen: natsHost.Addr.String()})
	require.Equal(t, "nats://"+natsHost.AddrPort(4222).String(), srv.hello.URL)
	peer := func(h *netns.Host, name, listen, advertise string) *hostProc {
		return startOnHost(t, h, hostConfig{Role: "peer", URL: srv.hello.URL, Bucket: "hosts", Subject: "kv." + name,
			Listen: listen, Advertise: advertise})
	}
	// a listens on its address, b on all of its addresses with an
	// advertised one, a2 shares a's host, l advertises loopback (tcp's
	// default listen address), d shares l's host and listens on all of
	// its addresses, advertising the one tcp picks.
	a := peer(hostA, "a", hostA.AddrPort(0).String(), "")
	b := peer(hostB, "b", ":7000", hostB.AddrPort(7000).String())
	a2 := peer(hostA, "a2", hostA.AddrPort(0).String(), "")
	l := peer(hostL, "l", "127.0.0.1:0", "")
	peer(hostL, "d", ":0", "")
	const size = 4 << 20

	t.Run("tcp between hosts", func(t *testing.T) {
		for _, c := range []struct {
			name    string
			reader  *hostProc
			subject string
		}{{"b reads a's", b, "kv.a"}, {"a reads b's", a, "kv.b"}, {"l reads a's", l, "kv.a"}, {"a reads d's", a, "kv.d"}} {
			got := c.reader.read(c.subject, size)
			assert.Empty(t, got.Err, c.name)
			assert.Equal(t, "tcp", got.Path, c.name)
			assert.Equal(t, "tcp", got.Backend, c.name)
			assert.True(t, got.Compact, "%s: the token is compact, resolved through the registry", c.name)
		}
	})

	t.Run("cma within a host", func(t *testing.T) {
		got := a2.read("kv.a", size)
		assert.Empty(t, got.Err)
		// One region: copied inside cma's lease table (cma+table) when it
		// fits one call, else under leases.
		assert.Contains(t, []string{"cma", "cma+table"}, got.Path, "a and a2 share a network namespace")
		assert.Equal(t, "cma", got.Backend)
	})

	t.Run("loopback advertisement refused", func(t *testing.T) {
		got := a.read("kv.l", size)
		t.Logf("reading from the peer advertising loopback: %s", got.Err)
		assert.Contains(t, got.Err, "loopback")
		assert.Contains(t, got.Err, "tcp.WithListenAddr")
		assert.Contains(t, got.Err, "tcp.WithAdvertiseAddr")
		assert.Empty(t, got.Path, "no transfer began")
	})

	t.Run("link down: departed", func(t *testing.T) {
		cut := time.Now()
		require.NoError(t, hostB.SetLink(false))
		// Up again before b stops, so that it can leave as it should.
		t.Cleanup(func() { assert.NoError(t, hostB.SetLink(true)) })
		for _, w := range []*hostProc{a, a2, l} {
			got := w.do(hostCmd{Op: "departed", ID: b.hello.Agent})
			require.Empty(t, got.Err, w.host.Name)
			after := got.At.Sub(cut)
			t.Logf("%s heard b departed %v after its link went down (heartbeat %v)", w.host.Name, after.Round(time.Millisecond), hostHeartbeat)
			// Two heartbeats of silence from b's last put, at most one
			// heartbeat before the cut (half of one: a put late on a busy
			// machine).
			assert.GreaterOrEqual(t, after, hostHeartbeat/2, "departed before a heartbeat could be missed")
			assert.LessOrEqual(t, after, departBound, "departure reported late")
		}
		// The others carry on between themselves.
		got := l.read("kv.a", size)
		assert.Empty(t, got.Err)
		assert.Equal(t, "tcp", got.Path)
	})
}

// departBound is how soon the registry must report a host departed once
// its link is down: two heartbeats of silence, then slack for a loaded
// machine.
const departBound = 2*hostHeartbeat + 3*time.Second
