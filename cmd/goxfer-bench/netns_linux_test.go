package main

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/internal/netns"
)

// netnsProc is the command running on a host of a netns network; its
// stdout and stderr are kept, stderr's lines also sent on lines.
type netnsProc struct {
	cmd    *exec.Cmd
	stdout bytes.Buffer // complete once done is closed
	mu     sync.Mutex
	stderr bytes.Buffer
	lines  chan string
	done   chan struct{} // closed once it has exited; err is then set
	err    error
}

// startBench runs the command (this test binary acting as main) on h with
// args; it is killed, if still running, when the test ends.
func startBench(t *testing.T, h *netns.Host, args ...string) *netnsProc {
	t.Helper()
	p := &netnsProc{cmd: h.Command(os.Args[0], args...), lines: make(chan string, 1024), done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), asMainEnv+"=1")
	p.cmd.Stdout = &p.stdout // read once it has exited
	stderr, err := p.cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, p.cmd.Start())
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			p.mu.Lock()
			p.stderr.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
			select {
			case p.lines <- sc.Text():
			default:
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// output returns what p wrote so far on stderr, and on stdout once it
// has exited.
func (p *netnsProc) output() (stdout, stderr string) {
	select {
	case <-p.done:
		stdout = p.stdout.String()
	default:
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return stdout, p.stderr.String()
}

// exit waits up to d for p to exit and returns its status.
func (p *netnsProc) exit(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(d):
		_, stderr := p.output()
		t.Fatalf("still running after %v; stderr:\n%s", d, stderr)
	}
	var ee *exec.ExitError
	if p.err != nil && !errors.As(p.err, &ee) {
		t.Fatalf("wait: %v", p.err)
	}
	return p.cmd.ProcessState.ExitCode()
}

// The two-host flow of the package documentation, on two hosts made of
// network namespaces (internal/netns): the initiator on one, its embedded
// NATS server on its address, the target on the other, listening on its
// address; a small tcp run with every byte checked goes over tcp.
func TestTargetOnAnotherHost(t *testing.T) {
	n := netns.New(t, 2)
	initHost, targetHost := n.Hosts[0], n.Hosts[1]
	jsonPath := filepath.Join(t.TempDir(), "r.json")
	const session = "netns"
	initiator := startBench(t, initHost, "-role", "initiator", "-listen", initHost.AddrPort(0).String(), "-session", session,
		"-backends", "tcp", "-blocks", "64K,1M", "-iters", "4", "-warmup", "1", "-check", "-baselines=false", "-control=false",
		"-ucx", "off", "-progress", "off", "-timeout", "30s", "-o", jsonPath)

	// The initiator says where its NATS server is, and how to start the
	// target.
	natsAt := regexp.MustCompile(`embedded NATS server at (nats://\S+);`)
	var url string
	timeout := time.After(30 * time.Second)
	for url == "" {
		select {
		case line := <-initiator.lines:
			if m := natsAt.FindStringSubmatch(line); m != nil {
				url = m[1]
			}
		case <-initiator.done:
			_, stderr := initiator.output()
			t.Fatalf("the initiator exited (%v) before naming its NATS server; stderr:\n%s", initiator.err, stderr)
		case <-timeout:
			_, stderr := initiator.output()
			t.Fatalf("the initiator named no NATS server within 30 s; stderr:\n%s", stderr)
		}
	}
	assert.Regexp(t, `^nats://`+regexp.QuoteMeta(initHost.Addr.String())+`:\d+$`, url, "the NATS server listens on the initiator's address")

	target := startBench(t, targetHost, "-role", "target", "-nats", url, "-session", session, "-listen", targetHost.AddrPort(0).String())
	code := initiator.exit(t, 2*time.Minute)
	stdout, stderr := initiator.output()
	require.Equal(t, 0, code, "initiator; stdout:\n%s\nstderr:\n%s", stdout, stderr)
	t.Logf("initiator's table:\n%s", stdout)
	targetCode := target.exit(t, 30*time.Second)
	_, targetErr := target.output()
	assert.Equal(t, 0, targetCode, "the target, told to quit; stderr:\n%s", targetErr)

	_, results := readResults(t, jsonPath)
	rows := 0
	for _, r := range results {
		if r.Kind != "goxfer" {
			continue
		}
		rows++
		assert.Equal(t, "tcp", r.Name, r)
		assert.Equal(t, "tcp", r.Path, "the path of %s %s across hosts", r.Op, r.Shape)
		assert.True(t, r.Checked, r)
		assert.False(t, r.InProcess, r)
		assert.Positive(t, r.GBps, r)
	}
	assert.Equal(t, 4, rows, "READ and WRITE of 64 KiB and 1 MiB")
}
