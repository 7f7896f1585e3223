package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/internal/netns"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// hostsNATSEnv, set to an address, makes the test binary an embedded NATS
// server listening on it, port 4222, until its stdin closes: the NATS host
// of TestExampleAcrossHosts where no nats-server is installed. It starts
// from init, before TestMain, which belongs to main_test.go.
const hostsNATSEnv = "PREFILL_DECODE_HOSTS_NATS"

func init() {
	if addr := os.Getenv(hostsNATSEnv); addr != "" {
		srv, err := natsserver.Start(context.Background(), natsserver.WithHost(addr), natsserver.WithPort(4222))
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		fmt.Println("ready", srv.URL())
		_, _ = io.Copy(io.Discard, os.Stdin)
		srv.Shutdown()
		os.Exit(0)
	}
}

// hostsSmall keeps each request's KV cache small (2 layers × K,V × 4
// blocks of 4 KiB), as the other tests of the example do.
var hostsSmall = []string{"-layers", "2", "-kv-heads", "2", "-head-dim", "64", "-prompt-tokens", "64"}

// hostProc is a process on a host of a netns network, its stdout and
// stderr read line by line.
type hostProc struct {
	t     *testing.T
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	mu    sync.Mutex
	out   bytes.Buffer
	lines chan string   // every line, until done
	done  chan struct{} // closed once it has exited; err is then set
	err   error
}

// startOnHost starts cmd, already made to run on a host; it is killed, if
// still running, when the test ends.
func startOnHost(t *testing.T, name string, cmd *exec.Cmd) *hostProc {
	t.Helper()
	p := &hostProc{t: t, name: name, cmd: cmd, lines: make(chan string, 4096), done: make(chan struct{})}
	r, w, err := os.Pipe()
	require.NoError(t, err)
	cmd.Stdout, cmd.Stderr = w, w
	p.stdin, err = cmd.StdinPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start(), "start %s", name)
	w.Close()
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			p.mu.Lock()
			p.out.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
			select {
			case p.lines <- sc.Text():
			default:
			}
		}
		r.Close()
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s's output:\n%s", name, p.output())
		}
	})
	return p
}

func (p *hostProc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// await returns the first line, from now on, that holds want; it fails the
// test if none comes within d or the process exits first.
func (p *hostProc) await(want string, d time.Duration) string {
	p.t.Helper()
	timeout := time.After(d)
	for {
		select {
		case line := <-p.lines:
			if strings.Contains(line, want) {
				return line
			}
		case <-p.done:
			p.t.Fatalf("%s exited (%v) before printing %q; output:\n%s", p.name, p.err, want, p.output())
		case <-timeout:
			p.t.Fatalf("%s did not print %q within %v; output:\n%s", p.name, want, d, p.output())
		}
	}
}

// exit waits up to d for the process to exit and returns its status; it
// fails the test if it does not.
func (p *hostProc) exit(d time.Duration) int {
	p.t.Helper()
	select {
	case <-p.done:
	case <-time.After(d):
		p.t.Fatalf("%s still running after %v; output:\n%s", p.name, d, p.output())
	}
	var ee *exec.ExitError
	switch {
	case p.err == nil:
		return 0
	case errors.As(p.err, &ee):
		return ee.ExitCode()
	}
	p.t.Fatalf("%s: %v", p.name, p.err)
	return -1
}

// startNATS starts a NATS server with JetStream on h, port 4222, and
// returns its URL: Debian's nats-server where it is installed (or the
// embedded server, a child of this test binary, with embedded set).
func startNATS(t *testing.T, h *netns.Host, embedded bool) string {
	t.Helper()
	if path, err := exec.LookPath("nats-server"); err == nil && !embedded {
		p := startOnHost(t, "nats-server", h.Command(path, "-js", "-a", h.Addr.String(), "-p", "4222", "-sd", t.TempDir()))
		p.await("Server is ready", 30*time.Second)
		return "nats://" + h.AddrPort(4222).String()
	}
	cmd := h.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), hostsNATSEnv+"="+h.Addr.String())
	p := startOnHost(t, "embedded NATS server", cmd)
	t.Cleanup(func() { _ = p.stdin.Close() })
	return strings.TrimPrefix(p.await("ready ", 30*time.Second), "ready ")
}

// worker runs the example (this test binary acting as main) on h with args.
func worker(t *testing.T, h *netns.Host, name string, args ...string) *hostProc {
	t.Helper()
	cmd := h.Command(os.Args[0], append(args, hostsSmall...)...)
	cmd.Env = append(os.Environ(), envRunMain+"=1")
	return startOnHost(t, name, cmd)
}

// The example across hosts: NATS on one (network namespaces joined by a
// bridge, internal/netns), a prefill worker on each of two more (one
// listening on its address, the other on :0), a decode worker on a fourth,
// listening on :0 as the package documentation has it (tcp advertises the
// host's address, which the WRITEs reach); READ then WRITE, every byte
// verified, over tcp (the hosts share no network namespace, so cma cannot
// reach across), with compact tokens resolved through the registry.
func TestExampleAcrossHosts(t *testing.T) {
	servers := []string{"embedded"}
	if _, err := exec.LookPath("nats-server"); err == nil {
		servers = append([]string{"nats-server"}, servers...)
	} else {
		t.Log("no nats-server installed: the NATS host runs the embedded server only")
	}
	for _, server := range servers {
		t.Run(server, func(t *testing.T) {
			n := netns.New(t, 4)
			natsHost, decodeHost := n.Hosts[0], n.Hosts[3]
			url := startNATS(t, natsHost, server == "embedded")

			// Two prefill hosts, one queue group: one listens on its
			// address, the other on :0.
			var prefills []*hostProc
			for i, listen := range []string{n.Hosts[1].AddrPort(0).String(), ":0"} {
				name := fmt.Sprintf("prefill %d", i+1)
				prefills = append(prefills, worker(t, n.Hosts[1+i], name, "-role", "prefill", "-name", name, "-nats", url, "-listen", listen))
			}
			for _, p := range prefills {
				p.await("ready", 30*time.Second)
			}

			const requests = 8
			readPath := regexp.MustCompile(`backend=(\S+) path=(\S+)`)
			for _, mode := range []string{"read", "write"} {
				decode := worker(t, decodeHost, "decode "+mode, "-role", "decode", "-nats", url, "-listen", ":0",
					"-mode", mode, "-requests", fmt.Sprint(requests))
				require.Equal(t, 0, decode.exit(2*time.Minute), "decode, %s mode; output:\n%s", mode, decode.output())
				out := decode.output()
				t.Logf("decode's output, %s mode:\n%s", mode, out)
				assert.Contains(t, out, fmt.Sprintf("summary: %d of %d requests verified, 0 mismatched, 0 failed", requests, requests), mode)
				if mode == "read" {
					paths := readPath.FindAllStringSubmatch(out, -1)
					assert.Len(t, paths, requests, "one backend and path per request")
					for _, m := range paths {
						assert.Equal(t, []string{"tcp", "tcp"}, m[1:], "backend and path of a READ across hosts")
					}
				}
			}

			var writes, tokens [][]string
			for _, p := range prefills {
				require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
				assert.Equal(t, 0, p.exit(30*time.Second), "%s, asked to stop", p.name)
				t.Logf("%s's output:\n%s", p.name, p.output())
				writes = append(writes, regexp.MustCompile(`wrote .* via (\S+), path (\S+)`).FindAllStringSubmatch(p.output(), -1)...)
				tokens = append(tokens, regexp.MustCompile(`exposed with a (\d+) B token \((\d+) B full\)`).FindAllStringSubmatch(p.output(), -1)...)
			}
			// Every WRITE went from a prefill host to decode's over tcp.
			assert.Len(t, writes, requests, "the prefill workers' WRITEs")
			for _, m := range writes {
				assert.Equal(t, []string{"tcp", "tcp"}, m[1:], "backend and path of a WRITE across hosts")
			}
			// READ tokens were compact: the decode worker resolved the
			// prefill workers' agents through the registry, across hosts.
			assert.Len(t, tokens, requests, "the prefill workers' READ exposures")
			for _, m := range tokens {
				compact, _ := strconv.Atoi(m[1])
				full, _ := strconv.Atoi(m[2])
				assert.Less(t, compact, full, "a compact token is shorter than the full one")
			}
		})
	}
}
