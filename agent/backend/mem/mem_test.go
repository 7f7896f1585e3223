package mem_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backendtest"
)

func factory() ([]agent.Backend, error) { return []agent.Backend{mem.New()}, nil }

func TestMain(m *testing.M) { backendtest.Main(m, factory) }

func TestConformance(t *testing.T) {
	backendtest.Run(t, backendtest.Config{New: factory, CrossProcess: false})
}

func newAgent(t *testing.T) *agent.Agent {
	t.Helper()
	a, err := agent.New(agent.WithBackends(mem.New()))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, a.Close()) })
	return a
}

// A peer that closed is unreachable: the transfer fails before it starts,
// naming the loss.
func TestPostToClosedPeer(t *testing.T) {
	a := newAgent(t)
	p, err := agent.New(agent.WithBackends(mem.New()))
	require.NoError(t, err)
	buf := make([]byte, 64)
	e, err := p.Expose(agent.AccessRead, []agent.Local{agent.DRAM(buf)})
	require.NoError(t, err)
	require.NoError(t, p.Close())

	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: p.Info(), Key: e.Key(), Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 64)), Remote: agent.DRAM(buf).Region}}})
	require.ErrorIs(t, err, agent.ErrNoBackend)
	require.ErrorIs(t, err, agent.ErrRemoteLost)
	require.Nil(t, x)
	require.ErrorIs(t, a.Notify(context.Background(), p.Info(), e.Key(), []byte("x")), agent.ErrNoBackend)
}

// An agent whose mem backend fails to start, because another agent of this
// process already has its ID, must not make the other agents believe that
// the running agent with that ID is lost.
func TestFailedStartDoesNotReportLiveAgentLost(t *testing.T) {
	a, p := newAgent(t), newAgent(t)
	buf := make([]byte, 64)
	e, err := p.Expose(agent.AccessRead, []agent.Local{agent.DRAM(buf)})
	require.NoError(t, err)
	defer e.Revoke()
	x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: p.Info(), Key: e.Key(), Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 64)), Remote: agent.DRAM(buf).Region}}})
	require.NoError(t, err)
	<-x.Done()
	require.NoError(t, x.Err())
	require.Equal(t, a.ID(), e.Peer())

	_, err = agent.New(agent.WithID(a.ID()), agent.WithBackends(mem.New()))
	require.Error(t, err, "a second agent with a's ID")
	select {
	case ev := <-e.Events():
		t.Fatalf("exposure used by live agent %s got %+v", a.ID(), ev)
	default:
	}
}

// Device memory cannot be copied by the CPU: a request that reaches a VRAM
// exposure (whatever kind it claims) is refused, never "completed" with no
// byte moved.
func TestDeviceMemoryRefused(t *testing.T) {
	pa, err := agent.New(agent.WithBackends(mem.New()))
	require.NoError(t, err)
	defer pa.Close()
	aa, err := agent.New(agent.WithBackends(mem.New()))
	require.NoError(t, err)
	defer aa.Close()
	vram := agent.Device(0x7f0000000000, 4096, agent.KindVRAM, 0)
	exp, err := pa.Expose(agent.AccessWrite, []agent.Local{vram})
	require.NoError(t, err)
	x, err := aa.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: pa.Info(), Key: exp.Key(), Notify: []byte("done"),
		Segments: []agent.Segment{{Local: agent.DRAM(make([]byte, 4096)), Remote: agent.Region{Addr: vram.Addr, Len: 4096}}}})
	require.NoError(t, err)
	<-x.Done()
	require.ErrorIs(t, x.Err(), agent.ErrAccessDenied)
	select {
	case ev := <-exp.Events():
		t.Fatalf("the exposure heard %+v for a transfer that moved nothing", ev)
	default:
	}
}
