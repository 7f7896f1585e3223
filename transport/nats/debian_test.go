package nats

import (
	"net"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// debianServer is where Debian installs nats-server (2.9 in bookworm).
const debianServer = "/usr/sbin/nats-server"

// The registry needs nothing beyond nats-server 2.9: run it against the
// system's server when there is one.
func TestRegistryOnTheSystemServer(t *testing.T) {
	if _, err := exec.LookPath(debianServer); err != nil {
		t.Skip("no", debianServer)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())
	cmd := exec.Command(debianServer, "-a", "127.0.0.1", "-p", strconv.Itoa(port), "-js", "-sd", t.TempDir())
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	url := "nats://127.0.0.1:" + strconv.Itoa(port)
	var nc *nats.Conn
	require.Eventually(t, func() bool {
		nc, err = nats.Connect(url)
		return err == nil
	}, hangGuard, 20*time.Millisecond, "system nats-server did not start")
	t.Cleanup(nc.Close)
	t.Logf("system nats-server %s", nc.ConnectedServerVersion())

	r1 := openRegistry(t, nc)
	w := r1.Watch(guarded(t))
	nc2, err := nats.Connect(url)
	require.NoError(t, err)
	t.Cleanup(nc2.Close)

	a := newConnector(t)
	ma := join(t, r1, a)
	b := newMortal(t, nc2)
	got := map[bool]int{}
	for range 2 {
		got[next(t, w).Departed]++
	}
	assert.Equal(t, map[bool]int{false: 2}, got)
	info, err := r1.Resolve(guarded(t), b.id())
	require.NoError(t, err)
	assert.Equal(t, b.c.AgentInfo(), info)

	nc2.Close() // b goes silent
	assert.Equal(t, b.departure(), next(t, w))
	require.NoError(t, ma.Leave(guarded(t)))
	assert.Equal(t, Presence{ID: a.AgentInfo().ID(), Info: a.AgentInfo(), Departed: true}, next(t, w))
}
