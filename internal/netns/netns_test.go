package netns_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/internal/netns"
)

// childEnv makes the test binary a child running the role it names, with
// the address in childAddr: "ns" prints its network namespace; "serve"
// listens on the address, prints it, and echoes a line on each connection
// until its stdin closes; "dial" dials the address, sends a line and
// prints the echo or the error.
const (
	childEnv  = "GOXFER_NETNS_TEST_CHILD"
	childAddr = "GOXFER_NETNS_TEST_ADDR"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(childEnv); role != "" {
		os.Exit(child(role, os.Getenv(childAddr)))
	}
	os.Exit(m.Run())
}

func child(role, addr string) int {
	switch role {
	case "ns":
		link, err := os.Readlink("/proc/self/ns/net")
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		fmt.Println(link)
	case "serve":
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		fmt.Println(ln.Addr())
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				go func() {
					defer c.Close()
					line, _ := bufio.NewReader(c).ReadString('\n')
					_, _ = io.WriteString(c, line)
				}()
			}
		}()
		_, _ = io.Copy(io.Discard, os.Stdin)
	case "dial":
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err != nil {
			fmt.Println("error:", err)
			return 0
		}
		defer c.Close()
		_, _ = io.WriteString(c, "ping\n")
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			fmt.Println("error:", err)
			return 0
		}
		fmt.Print(line)
	}
	return 0
}

// run runs the test binary as a child in role on h and returns the first
// line it prints.
func run(t *testing.T, h *netns.Host, role, addr string) string {
	t.Helper()
	cmd := h.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+role, childAddr+"="+addr)
	out, err := cmd.Output()
	require.NoError(t, err, "child %s on %s", role, h.Name)
	return strings.TrimSpace(string(out))
}

// serve starts an echo server on h's address and returns its address; it
// stops when the test ends.
func serve(t *testing.T, h *netns.Host) string {
	t.Helper()
	cmd := h.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=serve", childAddr+"="+h.AddrPort(0).String())
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = stdin.Close()
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err)
	line = strings.TrimSpace(line)
	require.NotContains(t, line, "error")

	// The process started is the server itself, in h's namespace: `ip
	// netns exec` replaced itself with it.
	link, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid))
	require.NoError(t, err)
	assert.Equal(t, run(t, h, "ns", ""), link, "the process started runs in the host's namespace")
	return line
}

func TestNetwork(t *testing.T) {
	n := netns.New(t, 3)
	require.Len(t, n.Hosts, 3)

	// Each host is a namespace of its own, none the test's.
	self, err := os.Readlink("/proc/self/ns/net")
	require.NoError(t, err)
	seen := map[string]bool{self: true}
	for _, h := range n.Hosts {
		ns := run(t, h, "ns", "")
		assert.False(t, seen[ns], "host %s shares namespace %s", h.Name, ns)
		seen[ns] = true
	}

	// The hosts' addresses are theirs alone: the root namespace has none.
	addrs, err := net.InterfaceAddrs()
	require.NoError(t, err)
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok {
			a, _ := netip.AddrFromSlice(ipn.IP.To4())
			assert.False(t, n.Prefix.Contains(a), "the root namespace holds %v", ipn)
		}
	}

	// Every host reaches every other over TCP.
	servers := make([]string, len(n.Hosts))
	for i, h := range n.Hosts {
		servers[i] = serve(t, h)
		assert.True(t, strings.HasPrefix(servers[i], h.Addr.String()+":"), "host %d listens on %s", i, servers[i])
	}
	for i, from := range n.Hosts {
		for j, to := range servers {
			if i != j {
				assert.Equal(t, "ping", run(t, from, "dial", to), "host %d → host %d", i, j)
			}
		}
	}

	// A host whose link is down reaches nobody; the others still reach
	// each other; up again, it does too.
	require.NoError(t, n.Hosts[1].SetLink(false))
	assert.Contains(t, run(t, n.Hosts[1], "dial", servers[0]), "error", "host 1, link down → host 0")
	assert.Contains(t, run(t, n.Hosts[0], "dial", servers[1]), "error", "host 0 → host 1, link down")
	assert.Equal(t, "ping", run(t, n.Hosts[2], "dial", servers[0]), "host 2 → host 0, host 1's link down")
	require.NoError(t, n.Hosts[1].SetLink(true))
	assert.Equal(t, "ping", run(t, n.Hosts[1], "dial", servers[0]), "host 1, link up again → host 0")
}

// The namespaces go when the test ends, and a second network at the same
// time is another one.
func TestNetworkRemoved(t *testing.T) {
	var names []string
	t.Run("network", func(t *testing.T) {
		a, b := netns.New(t, 1), netns.New(t, 1)
		assert.NotEqual(t, a.Hosts[0].Name, b.Hosts[0].Name)
		for _, h := range append(a.Hosts, b.Hosts...) {
			_, err := os.Stat("/run/netns/" + h.Name)
			require.NoError(t, err)
			names = append(names, h.Name)
		}
	})
	if len(names) == 0 {
		t.Skip("no network was built")
	}
	for _, name := range names {
		_, err := os.Stat("/run/netns/" + name)
		assert.True(t, os.IsNotExist(err), "namespace %s outlived its test: %v", name, err)
	}
}

// Wrap keeps what the command was given besides its path and arguments.
func TestWrap(t *testing.T) {
	h := &netns.Host{Name: "x"}
	cmd := exec.Command("sh", "-c", "true")
	cmd.Env, cmd.Dir = []string{"A=1"}, "/tmp"
	h.Wrap(cmd)
	require.Len(t, cmd.Args, 7)
	assert.Equal(t, []string{"ip", "netns", "exec", "x"}, cmd.Args[:4])
	assert.Equal(t, "sh", filepath.Base(cmd.Args[4]))
	assert.Equal(t, []string{"-c", "true"}, cmd.Args[5:])
	assert.Equal(t, "ip", filepath.Base(cmd.Path))
	assert.Equal(t, []string{"A=1"}, cmd.Env)
	assert.Equal(t, "/tmp", cmd.Dir)
}
