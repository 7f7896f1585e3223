// Package netns builds small networks of Linux network namespaces for
// tests, so that processes of one machine meet as processes of different
// hosts do: each host is a network namespace with its own loopback and one
// link, eth0, holding the only address it has; the links meet at a bridge
// in a namespace of their own (the switch). The root namespace gets no
// address and no route, so nothing reaches the hosts but the hosts.
//
//	n := netns.New(t, 3)                     // skips t where namespaces cannot be made
//	cmd := n.Hosts[1].Command(bin, "-listen", n.Hosts[1].Addr.String()+":0")
//	err := n.Hosts[1].SetLink(false)         // host 1's cable pulled
//
// Commands run in a host through `ip netns exec`, which replaces itself with
// the command, so the process started is the command's and a signal sent
// to it reaches the command. Every namespace is removed when the test ends,
// failed or not; names hold the process ID and a random part, so test
// binaries running at once do not meet, and namespaces left by a test
// binary that was killed are removed by the next New.
//
// It needs Linux, root and the ip command (Debian: apt-get install
// iproute2); [Usable] says which is missing.
package netns

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// prefix starts the name of every namespace this package makes: the
// process ID and a random part follow, then "-sw" for the switch or
// "-hN" for host N.
const prefix = "gxt"

// Link is the name of each host's link, inside its namespace.
const Link = "eth0"

// Network is a set of hosts joined by a switch. Its fields are read-only.
type Network struct {
	// Hosts are the hosts, in the order of their addresses.
	Hosts []*Host
	// Prefix is the hosts' subnet: 10.77.0.0/24, host i at 10.77.0.(i+1).
	Prefix netip.Prefix
	sw     string // the switch's namespace
}

// Host is one host of a [Network]: a network namespace.
type Host struct {
	// Name is the namespace's name, as `ip netns` knows it.
	Name string
	// Addr is the host's address, on its link [Link]; the host has no
	// other but loopback.
	Addr netip.Addr
}

// Usable returns nil where this process can build a [Network], or an
// error saying why not: another system than Linux, a user other than
// root, or no ip command. Namespaces may still be refused (a container
// without the privilege); [New] finds that out by trying.
func Usable() error {
	if runtime.GOOS != "linux" {
		return fmt.Errorf("network namespaces need Linux, not %s", runtime.GOOS)
	}
	if uid := os.Geteuid(); uid != 0 {
		return fmt.Errorf("network namespaces need root, and this process runs as uid %d", uid)
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return errors.New("no ip command in PATH (Debian: apt-get install iproute2)")
	}
	return nil
}

// New builds a network of n hosts (1 to 250) and removes it when t ends. It
// skips t, saying why, where [Usable] says no or the system refuses to
// make a namespace, a bridge, a veth pair or to run a command in one; it
// fails t on any later error.
func New(t testing.TB, n int) *Network {
	t.Helper()
	if n < 1 || n > 250 {
		t.Fatalf("netns.New: %d hosts: want 1 to 250", n)
	}
	if err := Usable(); err != nil {
		t.Skipf("netns: %v", err)
	}
	removeStale()
	var r [4]byte
	_, _ = rand.Read(r[:])
	base := fmt.Sprintf("%s%d-%s", prefix, os.Getpid(), hex.EncodeToString(r[:]))
	nw := &Network{Prefix: netip.MustParsePrefix("10.77.0.0/24"), sw: base + "-sw"}

	// The switch: every refusal here is the system's, so it skips.
	if out, err := ip("netns", "add", nw.sw); err != nil {
		t.Skipf("netns: the system refused a network namespace: %v", cmdErr(err, out))
	}
	t.Cleanup(func() { remove(t, nw.sw) })
	if out, err := exec.Command("ip", "netns", "exec", nw.sw, "true").CombinedOutput(); err != nil {
		t.Skipf("netns: the system refused to run a command in a network namespace (ip netns exec): %v", cmdErr(err, out))
	}
	if out, err := ip("-n", nw.sw, "link", "add", "dev", "br0", "type", "bridge"); err != nil {
		t.Skipf("netns: the system refused a bridge: %v", cmdErr(err, out))
	}
	mustIP(t, "-n", nw.sw, "link", "set", "dev", "br0", "up")

	for i := range n {
		h := &Host{Name: fmt.Sprintf("%s-h%d", base, i), Addr: netip.AddrFrom4([4]byte{10, 77, 0, byte(i + 1)})}
		if out, err := ip("netns", "add", h.Name); err != nil {
			t.Fatalf("netns: add host %d: %v", i, cmdErr(err, out))
		}
		t.Cleanup(func() { remove(t, h.Name) })
		port := "p" + strconv.Itoa(i) // the switch's end, named in the switch's namespace
		if out, err := ip("-n", nw.sw, "link", "add", "dev", port, "type", "veth", "peer", "name", Link, "netns", h.Name); err != nil {
			t.Skipf("netns: the system refused a veth pair: %v", cmdErr(err, out))
		}
		mustIP(t, "-n", nw.sw, "link", "set", "dev", port, "master", "br0", "up")
		mustIP(t, "-n", h.Name, "link", "set", "dev", "lo", "up")
		mustIP(t, "-n", h.Name, "addr", "add", netip.PrefixFrom(h.Addr, nw.Prefix.Bits()).String(), "dev", Link)
		mustIP(t, "-n", h.Name, "link", "set", "dev", Link, "up")
		nw.Hosts = append(nw.Hosts, h)
	}
	return nw
}

// Command returns a command that runs name with args on h, as
// [exec.Command] would here. The process started is the command's own.
func (h *Host) Command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	h.Wrap(cmd)
	return cmd
}

// Wrap makes cmd, not yet started, run on h: its path and arguments
// become those of `ip netns exec` with h's namespace. Its environment,
// directory, files and other attributes stay as they are.
func (h *Host) Wrap(cmd *exec.Cmd) {
	path := cmd.Path
	if len(cmd.Args) > 0 && !strings.ContainsRune(path, '/') {
		path = cmd.Args[0]
	}
	args := []string{path}
	if len(cmd.Args) > 1 {
		args = append(args, cmd.Args[1:]...)
	}
	ipPath, err := exec.LookPath("ip")
	if err != nil {
		ipPath = "ip" // Usable said it is there; Start will say it is not
	}
	cmd.Path = ipPath
	cmd.Args = append([]string{"ip", "netns", "exec", h.Name}, args...)
	cmd.Err = nil
}

// SetLink sets h's link up or down, inside h: down, the host's routes to
// the others go, its sockets see the network unreachable, and nothing it
// sends reaches them; up again, its address and route come back.
func (h *Host) SetLink(up bool) error {
	state := "down"
	if up {
		state = "up"
	}
	if out, err := ip("-n", h.Name, "link", "set", "dev", Link, state); err != nil {
		return fmt.Errorf("netns: set %s's link %s: %w", h.Name, state, cmdErr(err, out))
	}
	return nil
}

// AddrPort returns h's address with port.
func (h *Host) AddrPort(port uint16) netip.AddrPort { return netip.AddrPortFrom(h.Addr, port) }

// ip runs the ip command with args and returns its combined output.
func ip(args ...string) ([]byte, error) {
	return exec.Command("ip", args...).CombinedOutput()
}

func mustIP(t testing.TB, args ...string) {
	t.Helper()
	if out, err := ip(args...); err != nil {
		t.Fatalf("netns: ip %s: %v", strings.Join(args, " "), cmdErr(err, out))
	}
}

// cmdErr joins a command's error with what it printed.
func cmdErr(err error, out []byte) error {
	if out = bytes.TrimSpace(out); len(out) > 0 {
		return fmt.Errorf("%w: %s", err, out)
	}
	return err
}

// remove deletes the namespace name; its links go with it.
func remove(t testing.TB, name string) {
	if out, err := ip("netns", "delete", name); err != nil {
		t.Errorf("netns: delete namespace %s: %v", name, cmdErr(err, out))
	}
}

// removeStale deletes the namespaces of test binaries no longer running:
// those of a binary killed before its cleanup ran.
func removeStale() {
	entries, err := os.ReadDir("/run/netns")
	if err != nil {
		return
	}
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), prefix)
		if !ok {
			continue
		}
		pidText, _, ok := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidText)
		if !ok || err != nil || pid <= 0 || alive(pid) {
			continue
		}
		_, _ = ip("netns", "delete", e.Name())
	}
}

// alive reports whether process pid exists.
func alive(pid int) bool {
	_, err := os.Stat("/proc/" + strconv.Itoa(pid))
	return err == nil
}
