package connect

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backend/tcp"
)

// A peer that none of the backends reaches gets an error naming each
// backend's reason, on one line, still matching ErrNoBackend.
func TestNoBackendErrorIsOneLine(t *testing.T) {
	passive := newConnector(t, WithBackends(tcp.New()))
	pop := expose(t, passive, KindRead, buffers([]int{4096}, 1))
	active := newConnector(t, WithBackends(mem.New(), cma.New()))
	_, err := active.BeginRead(t.Context(), pop.Metadata(), descriptors(buffers([]int{4096}, 0))...)
	require.ErrorIs(t, err, ErrNoBackend)
	t.Log(err)
	assert.NotContains(t, err.Error(), "\n")
	assert.Contains(t, err.Error(), "mem: peer has no mem backend; cma: peer has no cma backend")
}
