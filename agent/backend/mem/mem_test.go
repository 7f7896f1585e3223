package mem_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backendtest"
	"github.com/goxfer/goxfer/agent/devmem"
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

// Device memory is never touched by the CPU: the mem backend reaches a
// peer's device memory only through the peer's leases, which stage it
// through host buffers; an exposure of device memory the driver does not
// know is refused; and a peer that does not stage its device memory
// refuses a transfer into it, never "completing" it with no byte moved.
func TestDeviceMemory(t *testing.T) {
	const n = 64<<10 + 3
	sim := devmem.NewSim(1)
	newDevAgent := func(b agent.Backend) *agent.Agent {
		a, err := agent.New(agent.WithBackends(b), agent.WithDevice(sim))
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, a.Close()) })
		return a
	}
	src := make([]byte, n)
	for i := range src {
		src[i] = byte(i*7 + 1)
	}
	vram, err := sim.Alloc(0, n)
	require.NoError(t, err)
	defer func() { require.NoError(t, sim.Free(vram)) }()
	device := func() []byte {
		b := make([]byte, n)
		require.NoError(t, devmem.CopyToHost(sim, 0, b, vram))
		return b
	}
	write := func(aa, pa *agent.Agent, exp *agent.Exposure) error {
		x, err := aa.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: pa.Info(), Key: exp.Key(), Notify: []byte("done"),
			Segments: []agent.Segment{{Local: agent.DRAM(src), Remote: agent.Region{Addr: uint64(vram), Len: n, Kind: agent.KindVRAM}}}})
		require.NoError(t, err)
		<-x.Done()
		return x.Err()
	}

	t.Run("UnknownPointer", func(t *testing.T) {
		pa := newDevAgent(mem.New())
		_, err := pa.Expose(agent.AccessWrite, []agent.Local{agent.Device(0x7f0000000000, 4096, agent.KindVRAM, 0)})
		require.ErrorIs(t, err, agent.ErrInvalid)
		require.ErrorIs(t, err, devmem.ErrNotDevice)
	})

	t.Run("Staged", func(t *testing.T) {
		pa, aa := newDevAgent(mem.New()), newDevAgent(mem.New())
		exp, err := pa.Expose(agent.AccessWrite, []agent.Local{agent.Device(vram, n, agent.KindVRAM, 0)})
		require.NoError(t, err)
		defer exp.Revoke()
		require.NoError(t, write(aa, pa, exp))
		ev := <-exp.Events()
		require.Equal(t, agent.EventNotify, ev.Kind)
		require.NoError(t, ev.Err)
		require.Equal(t, src, device())
	})

	t.Run("PeerDoesNotStage", func(t *testing.T) {
		require.NoError(t, devmem.CopyToDevice(sim, 0, vram, make([]byte, n)))
		// The passive agent's mem backend, seen through a type that hides
		// agent.DeviceStager: its leases give the backend no bytes for
		// device memory, as an agent that cannot stage would.
		pa, aa := newDevAgent(struct{ agent.Backend }{mem.New()}), newDevAgent(mem.New())
		exp, err := pa.Expose(agent.AccessWrite, []agent.Local{agent.Device(vram, n, agent.KindVRAM, 0)})
		require.NoError(t, err)
		defer exp.Revoke()
		require.ErrorIs(t, write(aa, pa, exp), agent.ErrAccessDenied)
		select {
		case ev := <-exp.Events():
			t.Fatalf("the exposure heard %+v for a transfer that moved nothing", ev)
		default:
		}
		require.Equal(t, make([]byte, n), device(), "device memory after a refused WRITE")
	})
}

// Neighbouring blocks of one pool are copied as one where they follow each
// other on both sides; every byte lands where its segment says, whatever
// the order, in both directions, across the spans of 4 MiB the copy is
// cut into.
func TestPoolBlocks(t *testing.T) {
	const blocks, size = 128, 70001 // spans of 4 MiB end inside blocks
	orders := map[string]func(i int) int{
		"in order":          func(i int) int { return i },
		"remote reversed":   func(i int) int { return blocks - 1 - i },
		"pairs swapped":     func(i int) int { return i ^ 1 },
		"every other block": func(i int) int { return (2 * i) % blocks },
	}
	for name, remoteOf := range orders {
		for _, op := range []agent.Op{agent.OpRead, agent.OpWrite} {
			t.Run(name+"/"+op.String(), func(t *testing.T) {
				a, p := newAgent(t), newAgent(t)
				lpool, rpool := make([]byte, blocks*size), make([]byte, blocks*size)
				src := rpool
				if op == agent.OpWrite {
					src = lpool
				}
				for i := range src {
					src[i] = byte(i*7 + i/size)
				}
				rls := make([]agent.Local, blocks)
				for i := range rls {
					rls[i] = agent.DRAM(rpool[i*size : (i+1)*size])
				}
				e, err := p.Expose(op.Access(), rls)
				require.NoError(t, err)
				defer e.Revoke()
				segs := make([]agent.Segment, 0, blocks)
				for i := range blocks {
					if name == "every other block" && i >= blocks/2 {
						break
					}
					segs = append(segs, agent.Segment{Local: agent.DRAM(lpool[i*size : (i+1)*size]), Remote: rls[remoteOf(i)].Region})
				}
				x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: e.Key(), Segments: segs})
				require.NoError(t, err)
				<-x.Done()
				require.NoError(t, x.Err())
				for i := range segs {
					r := remoteOf(i)
					require.Equal(t, rpool[r*size:(r+1)*size], lpool[i*size:(i+1)*size], "segment %d", i)
				}
			})
		}
	}
}
