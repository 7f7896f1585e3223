//go:build linux

package cma

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// fakeYama stands in for a host in Yama mode 1: a ptracer exception that
// records every change, and a kernel that lets this process read a peer
// only while that peer names this process its ptracer. Every agent of a
// test shares it, as the processes of one host share the kernel.
type fakeYama struct {
	set   *ptracerSet
	mu    sync.Mutex
	calls []uintptr
}

func newFakeYama() *fakeYama {
	y := &fakeYama{}
	// self -1: connections from this test process count as a peer's.
	y.set = &ptracerSet{pids: map[int]int{}, self: -1, set: func(v uintptr) error {
		y.mu.Lock()
		y.calls = append(y.calls, v)
		y.mu.Unlock()
		return nil
	}}
	return y
}

// hold pretends that another process is connected and named.
func (y *fakeYama) hold(pid int) {
	y.set.mu.Lock()
	defer y.set.mu.Unlock()
	y.set.pids[pid]++
	y.set.cur = uintptr(pid)
}

func (y *fakeYama) current() uintptr {
	y.set.mu.Lock()
	defer y.set.mu.Unlock()
	return y.set.cur
}

func (y *fakeYama) changes() []uintptr {
	y.mu.Lock()
	defer y.mu.Unlock()
	return append([]uintptr(nil), y.calls...)
}

func (y *fakeYama) readv(pid int, l []unix.Iovec, r []unix.RemoteIovec) (int, error) {
	if y.current() != uintptr(os.Getpid()) {
		return 0, unix.EPERM
	}
	return processVMReadv(pid, l, r)
}

// yamaAgent starts an agent with cma, then tcp, on the fake host.
func yamaAgent(t *testing.T, y *fakeYama, opts ...Option) (*agent.Agent, *Backend) {
	t.Helper()
	b := New(opts...)
	b.readScope = func() int { return 1 }
	b.ptracers = y.set
	b.readv = y.readv
	return backendtest.NewAgent(t, b, tcp.New()), b
}

const ptracerAnyValue = ^uintptr(0) // PR_SET_PTRACER_ANY

// Under ptrace_scope 1 a local process that presents no key, or a guessed
// one, gets no ptracer exception: the handshake alone names nobody.
func TestYamaStrangerGetsNoException(t *testing.T) {
	y := newFakeYama()
	a, b := yamaAgent(t, y)
	src := make([]byte, 4096)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	defer exp.Revoke()
	for _, c := range []struct {
		name string
		key  agent.Key
		acc  agent.Access
	}{
		{"NoKey", agent.Key{}, 0},
		{"GuessedKey", agent.NewKey(), agent.AccessRead},
		{"WrongAccess", exp.Key(), agent.AccessWrite},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := dialRaw(t, b)
			in, err := p.helloWithKey(c.key, c.acc, a)
			require.NoError(t, err)
			require.Equal(t, uint8(stOK), in.status)
			assert.Empty(t, y.changes(), "the ptracer exception changed for a dialler without a valid key")
			assert.Zero(t, y.current())
			assert.Equal(t, map[bool]uint8{true: ptrNoKey, false: ptrRefused}[c.key == agent.Key{}], in.ptracer)
		})
	}
}

// Yama keeps one exception per process. When another peer process holds
// it, a second one, even with a valid key, is not named, and nobody is
// ever named "any process".
func TestYamaOneExceptionNeverAny(t *testing.T) {
	y := newFakeYama()
	const other = 1 << 22 // a process ID no test process has
	y.hold(other)
	a, b := yamaAgent(t, y)
	src := make([]byte, 4096)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	defer exp.Revoke()
	p := dialRaw(t, b)
	in, err := p.helloWithKey(exp.Key(), agent.AccessRead, a)
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), in.status)
	assert.NotContains(t, y.changes(), ptracerAnyValue, "PR_SET_PTRACER_ANY lets every same-user process attach")
	assert.Equal(t, uintptr(other), y.current(), "the process named first keeps the exception")
	assert.Equal(t, uint8(ptrHeld), in.ptracer)
}

// A peer that presents a valid key is named while connected, and the
// exception is withdrawn when it leaves; its reads go over cma. While it is
// named, another process reading the same agent falls back to tcp, and
// says why.
func TestYamaKeyedPeerNamedOthersFallBack(t *testing.T) {
	y := newFakeYama()
	a, _ := yamaAgent(t, y)
	src, exp := exposeRead(t, a, 64<<10)

	// Without a key (a notification's choice) the peer names nobody.
	r1, rb := yamaAgent(t, y)
	err := rb.Reachable(context.Background(), a.Info())
	require.ErrorIs(t, err, errNotPermitted)
	require.ErrorIs(t, err, errNeedKey)
	assert.Contains(t, err.Error(), "presented none")
	assert.Zero(t, y.current())

	// With the transfer's key it is named, and reads over cma.
	x := readAll(t, r1, a, exp, src)
	assert.Equal(t, Name, x.Backend())
	assert.Equal(t, uintptr(os.Getpid()), y.current())
	assert.Equal(t, []uintptr{uintptr(os.Getpid())}, y.changes())

	// Another process, while this one holds the exception: tcp.
	y.set.mu.Lock()
	pids, cur := y.set.pids, y.set.cur
	const other = 1 << 22
	y.set.pids, y.set.cur = map[int]int{other: 1}, other
	y.set.mu.Unlock()
	var logs bytes.Buffer
	r2b := New()
	r2b.readScope, r2b.ptracers, r2b.readv = func() int { return 1 }, y.set, y.readv
	r2, err := agent.New(agent.WithBackends(r2b, tcp.New()), agent.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	require.NoError(t, err)
	defer r2.Close()
	x = readAll(t, r2, a, exp, src)
	assert.Equal(t, tcp.Name, x.Backend(), "a second process falls back")
	assert.Contains(t, logs.String(), "not permitted")
	assert.Contains(t, logs.String(), "held by another process")
	assert.NotContains(t, y.changes(), ptracerAnyValue)
	y.set.mu.Lock()
	y.set.pids, y.set.cur = pids, cur
	y.set.mu.Unlock()

	// The named peer leaves: the exception is withdrawn.
	require.NoError(t, r1.Close())
	require.Eventually(t, func() bool { return y.current() == 0 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []uintptr{uintptr(os.Getpid()), 0}, y.changes())
}
