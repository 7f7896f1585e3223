//go:build unix

package connect

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/tcp"
)

// freeze stops the child with SIGSTOP: its connections stay open and
// silent. It is killed when the test ends.
func (c *child) freeze() {
	require.NoError(c.t, c.Signal(syscall.SIGSTOP))
	c.t.Cleanup(c.Kill) // runs before the child's own cleanup
}

// Keepalives catch a peer that hangs without closing its connections. Both
// sides use the same short keepalive: a peer's timeout must exceed the
// other's interval.
const (
	frozenInterval = 100 * time.Millisecond
	frozenTimeout  = time.Second
)

func TestCrossProcessPeerFrozen(t *testing.T) {
	// A frozen peer holds its sockets open and silent; over tcp, keepalives
	// tell. (Over cma a frozen peer is noticed by the active side's lease
	// timeout, or by a presence registry.)
	keepalive := []Option{WithTCPOptions(tcp.WithKeepalive(frozenInterval, frozenTimeout)), WithoutCMA()}
	childKeepalive := fmt.Sprintf("%s=%v/%v", childKeepaliveEnv, frozenInterval, frozenTimeout)
	retryKinds(t, "passive/", func(t *testing.T, kind OperationKind) bool {
		_, hit := cutPassive(t, kind, (*child).freeze, "froze", keepalive, childKeepalive)
		return hit
	})
	retryKinds(t, "active/", func(t *testing.T, kind OperationKind) bool {
		_, hit := cutActive(t, kind, (*child).freeze, "froze", keepalive, childKeepalive)
		return hit
	})
}
