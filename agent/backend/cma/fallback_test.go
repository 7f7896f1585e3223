//go:build linux

package cma_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/internal/testproc"
)

// nobody is the unprivileged user the fallback child runs as.
const nobody = 65534

// TestFallbackWhenNotPermitted runs a peer as another, unprivileged user:
// the kernel then refuses its process_vm_readv of this (root) process, for
// real. Its READs of this process's memory must fall back to tcp, say so on
// the transfer, and log why once. The other direction stays on cma: root
// may read the unprivileged process, so the probe is per direction.
func TestFallbackWhenNotPermitted(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to start a child as another user")
	}
	bin := copyExecutable(t)

	var logs bytes.Buffer
	a, err := agent.New(agent.WithBackends(cma.New(), tcp.New()), agent.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	require.NoError(t, err)
	defer a.Close()
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i * 5)
	}
	e, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(buf)})
	require.NoError(t, err)
	defer e.Revoke()

	var hello exposure
	c := testproc.Spawn(t, fallbackChildEnv, &hello, func(cmd *exec.Cmd) {
		cmd.Path, cmd.Args[0] = bin, bin
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	})
	defer func() { require.NoError(t, c.Stop(), "child stderr: %s", c.Stderr()) }()

	// This process (root) reads the unprivileged child: cma.
	dst := make([]byte, hello.Size)
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: hello.Info, Key: hello.Key, Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: hello.Addr, Len: uint64(hello.Size)}}}})
	require.NoError(t, err)
	<-x.Done()
	require.NoError(t, x.Err())
	assert.Equal(t, cma.Name, x.Backend(), "root reads an unprivileged process with cma")
	for i := range dst {
		if dst[i] != byte(i*3) {
			t.Fatalf("byte %d read from the child is %d", i, dst[i])
		}
	}
	assert.NotContains(t, logs.String(), "preferred backends unavailable")

	// The child reads this process: denied by the kernel, so tcp.
	require.NoError(t, json.NewEncoder(c.Stdin).Encode(exposure{Info: a.Info(), Key: e.Key(), Addr: agent.DRAM(buf).Addr, Size: len(buf)}))
	var res fallbackResult
	require.NoError(t, c.Stdout.Decode(&res))
	t.Logf("child's log:\n%s", res.Log)
	require.Empty(t, res.Errs)
	assert.Equal(t, []string{tcp.Name, tcp.Name}, res.Backends, "transfers fell back to tcp and say so")
	assert.True(t, res.DataOK, "the bytes arrived over tcp")
	assert.Equal(t, 1, strings.Count(res.Log, "preferred backends unavailable"), "the fallback is logged once")
	assert.Contains(t, res.Log, "cma: peer")
	assert.Contains(t, res.Log, "not permitted")
	assert.Equal(t, cma.Name, hello.Info.Conns[0].Backend)
}

// copyExecutable copies the test binary where another user may run it:
// go test builds it in a directory only its owner may enter.
func copyExecutable(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "goxfer-cma-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	src, err := os.Open(os.Args[0])
	require.NoError(t, err)
	defer src.Close()
	bin := filepath.Join(dir, "cma.test")
	dst, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY, 0o755)
	require.NoError(t, err)
	_, err = io.Copy(dst, src)
	require.NoError(t, err)
	require.NoError(t, dst.Close())
	return bin
}
