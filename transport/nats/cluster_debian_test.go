package nats

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// systemCluster is a cluster of the system's nats-server processes, each
// started separately on its own client and route ports with its own store,
// routed to all the others, as a deployment would run them.
type systemCluster struct {
	urls  []string
	names []string
	args  [][]string
	cmds  []*exec.Cmd
}

// startSystemCluster starts n nats-server processes; they are killed when
// the test ends. It returns once an R3 stream can be created: every
// server's JetStream is part of the cluster.
func startSystemCluster(t *testing.T, n int) *systemCluster {
	t.Helper()
	ports := loopbackPorts(t, 2*n)
	sc := &systemCluster{cmds: make([]*exec.Cmd, n)}
	var routes []string
	for i := range n {
		routes = append(routes, "nats-route://127.0.0.1:"+strconv.Itoa(ports[n+i]))
	}
	for i := range n {
		name := fmt.Sprintf("system-%d", i)
		sc.names = append(sc.names, name)
		sc.urls = append(sc.urls, "nats://127.0.0.1:"+strconv.Itoa(ports[i]))
		sc.args = append(sc.args, []string{
			"-a", "127.0.0.1", "-p", strconv.Itoa(ports[i]), "-n", name,
			"--cluster_name", "goxfer", "--cluster", routes[i], "--routes", strings.Join(routes, ","),
			"-js", "-sd", filepath.Join(t.TempDir(), name),
		})
	}
	t.Cleanup(func() {
		for i := range sc.cmds {
			sc.kill(i)
		}
	})
	for i := range n {
		sc.start(t, i)
	}
	nc := dialFirst(t, sc.urls, 0)
	t.Logf("system nats-server %s, %d processes", nc.ConnectedServerVersion(), n)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	// A JetStream request sent before the meta leader is elected gets no
	// answer at all: each attempt has its own timeout.
	for deadline := time.Now().Add(hangGuard); ; time.Sleep(100 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "probe", Replicas: n})
		if err == nil {
			err = js.DeleteStream(ctx, "probe")
		}
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the system cluster's JetStream did not form: %v", err)
		}
	}
	return sc
}

// loopbackPorts returns n distinct ports free on 127.0.0.1 now.
func loopbackPorts(t *testing.T, n int) []int {
	t.Helper()
	var ports []int
	var ls []net.Listener
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	for _, l := range ls {
		require.NoError(t, l.Close())
	}
	return ports
}

// start starts process i, with the same ports and store every time, and
// returns once it accepts connections.
func (sc *systemCluster) start(t *testing.T, i int) {
	t.Helper()
	cmd := exec.Command(debianServer, sc.args[i]...)
	require.NoError(t, cmd.Start())
	sc.cmds[i] = cmd
	addr := strings.TrimPrefix(sc.urls[i], "nats://")
	require.Eventually(t, func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	}, hangGuard, 20*time.Millisecond, "%s did not listen on %s", sc.names[i], addr)
}

// kill kills process i with SIGKILL, a crash: no goodbye to its clients or
// routes, no JetStream leadership handed over; the kernel closes its
// sockets.
func (sc *systemCluster) kill(i int) {
	if cmd := sc.cmds[i]; cmd != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		sc.cmds[i] = nil
	}
}

// A cluster of three of the system's nats-server processes (Debian's 2.9)
// runs the registry (R3) and request/serve through the crash (SIGKILL) of
// one server, then its restart: no request is lost, the clients it served
// fail over, the registry keeps resolving and declares nobody departed.
// The crashed server does not lead the registry bucket's stream
// (follower), or it does (bucket-leader): then the others elect a leader
// first (4 to 9 s), during which nobody's heartbeat is stored; the
// registries count that silence as everybody's, not against the crashed
// server's agent (which reconnected to the others at once), as they did
// once (issue 18).
func TestClusterOfSystemServers(t *testing.T) {
	if _, err := exec.LookPath(debianServer); err != nil {
		t.Skip("no", debianServer)
	}
	for _, leads := range []bool{false, true} {
		name := "follower"
		if leads {
			name = "bucket-leader"
		}
		t.Run(name, func(t *testing.T) { crashSystemServer(t, leads) })
	}
}

// crashSystemServer runs TestClusterOfSystemServers, crashing the bucket's
// leader if leads, else another server.
func crashSystemServer(t *testing.T, leads bool) {
	sc := startSystemCluster(t, 3)
	var agents []*clusterAgent
	for i := range 3 {
		agents = append(agents, startAgent(t, sc.urls, i, "worker-"+strconv.Itoa(i)))
	}
	dumpOnFailure(t, agents...)
	live := agentNames(agents...)
	js, err := jetstream.New(agents[0].nc)
	require.NoError(t, err)
	s, err := js.Stream(guarded(t), "KV_"+defaultBucket)
	require.NoError(t, err)
	assert.Equal(t, 3, s.CachedInfo().Config.Replicas, "R3 by default on a cluster")
	l := startLoad(t, sc.urls)
	time.Sleep(500 * time.Millisecond)

	leader := bucketLeader(t, agents[0].nc)
	victim := 0
	for (sc.names[victim] == leader) != leads {
		victim++
	}
	served := l.on(sc.names[victim])
	require.NotEmpty(t, served)
	start := time.Now()
	sc.kill(victim)
	for i, d := range recovery(t, served, start, sc.names[victim], time.Time{}) {
		t.Logf("SIGKILL of %s (bucket leader %s) to first success of %s: %v", sc.names[victim], leader, served[i].name, d.Round(time.Millisecond))
	}
	requireHealthy(t, agents...)
	t.Logf("registries healthy %v after the crash", time.Since(start).Round(time.Millisecond))
	fresh := openFresh(t, dialFirst(t, sc.urls, (victim+1)%3))
	for _, a := range agents {
		info, err := fresh.Resolve(guarded(t), a.id())
		require.NoError(t, err, a.name)
		assert.Equal(t, a.c.AgentInfo(), info)
	}
	time.Sleep(time.Second)

	restarted := time.Now()
	sc.start(t, victim)
	t.Logf("%s listening %v after its restart", sc.names[victim], time.Since(restarted).Round(time.Millisecond))
	time.Sleep(2 * time.Second)
	requireHealthy(t, agents...)
	sent := l.requireNoneLost(t)
	t.Logf("%d requests through the crash and restart, none lost", sent)
	requireNoDepartures(t, live, agents...)
}
