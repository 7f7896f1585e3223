//go:build ucx

package ucx

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

const thawChild = "GOXFER_UCX_THAW_CHILD"

// A frozen peer that thaws after a connecting agent closed finds that
// agent's UCX wireup request still queued, from a worker that no longer
// exists; it must survive it. UCX 1.21 and later over posix alone do not:
// the request's transport selection fails (posix probes the sender's
// segment, which is gone) and UCX's failure path reads the configuration
// of an endpoint that has none (SIGSEGV in ucp_ep_set_lanes_failed, from
// ucp_worker_progress). The backend adds sysv beside posix
// (WithSysvBesidePosix), which makes selection succeed and the endpoint
// fail cleanly. The test runs the scenario in a child process; a crash
// fails it. The scenario is
// TestDepartedPeerFailsAtOnce's without its thaw before Close.
func TestPeerThawsAfterConnectorClosed(t *testing.T) {
	if os.Getenv(thawChild) == "1" {
		thawScenario(t)
		return
	}
	exe, err := os.Executable()
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, "-test.run=^TestPeerThawsAfterConnectorClosed$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), thawChild+"=1")
	out, err := cmd.CombinedOutput()
	if err == nil {
		return
	}
	c := defaults()
	if strings.Contains(string(out), "SIGSEGV") && strings.Contains(string(out), "_Cfunc_gx_progress") {
		t.Fatalf("child crashed in ucp_worker_progress (UCX_TLS %q, sysv beside posix: %q): %v\n%s",
			os.Getenv("UCX_TLS"), c.ucxTLS(), err, out)
	}
	t.Fatalf("child: %v\n%s", err, out)
}

func thawScenario(t *testing.T) {
	peer, host := backendtest.StartStuck(t, New(WithTimeout(time.Minute)))
	a, err := agent.New(agent.WithBackends(New(WithTimeout(time.Minute))))
	require.NoError(t, err)
	dst := make([]byte, 1<<20)
	post := func() *agent.Xfer {
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpWrite, Peer: peer, Key: agent.NewKey(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: 1 << 20}}}})
		require.NoError(t, err)
		return x
	}
	x := post() // the peer freezes in Open
	time.Sleep(200 * time.Millisecond)
	a.PeerDeparted(peer.ID, errors.New("registry: gone"))
	<-x.Done()
	x = post() // a new endpoint: its wireup request waits in the frozen peer's queue
	time.Sleep(200 * time.Millisecond)
	a.PeerDeparted(peer.ID, errors.New("registry: gone again"))
	<-x.Done()
	require.NoError(t, a.Close())
	host.Thaw()
	time.Sleep(500 * time.Millisecond) // the peer handles its queue
}
