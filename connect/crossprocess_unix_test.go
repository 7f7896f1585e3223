//go:build unix

package connect

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/tcp"
)

// freeze stops the child with SIGSTOP: its connections stay open and
// silent. It is killed when the test ends.
func (c *child) freeze() {
	c.killed = true
	require.NoError(c.t, c.cmd.Process.Signal(syscall.SIGSTOP))
	c.t.Cleanup(func() { _ = c.cmd.Process.Kill() }) // runs before stop
}

// Keepalives catch a peer that hangs without closing its connections. Both
// sides use the same short keepalive: a peer's timeout must exceed the
// other's interval.
const (
	frozenInterval = 100 * time.Millisecond
	frozenTimeout  = time.Second
)

func TestCrossProcessPeerFrozen(t *testing.T) {
	keepalive := WithTCPOptions(tcp.WithKeepalive(frozenInterval, frozenTimeout))
	childKeepalive := fmt.Sprintf("%s=%v/%v", childKeepaliveEnv, frozenInterval, frozenTimeout)
	for _, kind := range kinds {
		t.Run("passive/"+kind.String(), func(t *testing.T) {
			retry(t, func(t *testing.T) bool {
				ctx := guarded(t)
				parent := newConnector(t, keepalive)
				c := startChild(t, childKeepalive)
				r := c.must(childRequest{Cmd: "expose", Kind: kind, Sizes: []int{largeTransfer}})
				md, err := ParseMetadata(r.Token)
				require.NoError(t, err)
				aop, err := begin(ctx, parent, md, [][]byte{make([]byte, largeTransfer)})
				require.NoError(t, err)
				c.must(childRequest{Cmd: "wait-access", ID: r.ID})
				if aop.Status() != StatusInProgress {
					return false
				}
				start := time.Now()
				c.freeze()
				err = aop.Wait(ctx)
				lost := time.Since(start)
				if err == nil {
					return false
				}
				t.Logf("%v failed %v after the passive process froze: %v", kind, lost, err)
				require.ErrorIs(t, err, ErrRemoteLost)
				assert.LessOrEqual(t, lost, lostWithin, "time to report the lost peer")
				return true
			})
		})
		t.Run("active/"+kind.String(), func(t *testing.T) {
			retry(t, func(t *testing.T) bool {
				ctx := guarded(t)
				parent := newConnector(t, keepalive)
				c := startChild(t, childKeepalive)
				pop := createOp(t, parent, kind, newSlab([]int{largeTransfer}))
				c.must(childRequest{Cmd: "begin", Token: pop.Metadata().String(), Async: true})
				awaitPeer(t, pop)
				start := time.Now()
				c.freeze()
				err := pop.Wait(ctx)
				lost := time.Since(start)
				if err == nil {
					return false
				}
				t.Logf("passive %v heard %v after the active process froze: %v", kind, lost, err)
				require.ErrorIs(t, err, ErrRemoteLost)
				assert.LessOrEqual(t, lost, lostWithin, "time to report the lost peer")
				return true
			})
		})
	}
}
