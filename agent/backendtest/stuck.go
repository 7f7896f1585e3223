package backendtest

import (
	"context"
	"log/slog"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
)

// StuckHost is an [agent.Host] for an exposing side that never grants a
// lease, as a frozen process would: [StuckHost.Open] blocks until
// [StuckHost.Thaw], and then refuses with [agent.ErrRemoteLost].
// Notifications are taken and dropped, lost links and refusals ignored; it
// logs to [slog.Default], and its Context is never done. Safe for
// concurrent use. [StartStuck] makes one.
type StuckHost struct {
	id      uuid.UUID
	release chan struct{}
	once    sync.Once
}

// StartStuck starts b on a fresh [StuckHost] and returns the agent
// information that reaches it, and the host. When the test ends the host
// is thawed and b closed (Close must succeed).
func StartStuck(t testing.TB, b agent.Backend) (agent.Info, *StuckHost) {
	t.Helper()
	h := &StuckHost{id: uuid.New(), release: make(chan struct{})}
	ci, err := b.Start(h)
	require.NoError(t, err)
	t.Cleanup(func() {
		h.Thaw()
		assert.NoError(t, b.Close())
	})
	return agent.Info{ID: h.id, Conns: []agent.ConnInfo{{Backend: b.Name(), Data: ci}}}, h
}

// Thaw lets every Open, blocked or to come, return. Idempotent.
func (h *StuckHost) Thaw() { h.once.Do(func() { close(h.release) }) }

// ID is the host's agent ID, fresh from [StartStuck].
func (h *StuckHost) ID() uuid.UUID { return h.id }

// Logger is [slog.Default].
func (h *StuckHost) Logger() *slog.Logger { return slog.Default() }

// Context is never done.
func (h *StuckHost) Context() context.Context { return context.Background() }

// Open blocks until [StuckHost.Thaw], then refuses with
// [agent.ErrRemoteLost].
func (h *StuckHost) Open(agent.Link, agent.Key, agent.Access) (agent.Lease, error) {
	<-h.release
	return agent.Lease{}, agent.ErrRemoteLost
}

// Deliver drops msg and reports the host open.
func (h *StuckHost) Deliver(agent.Link, agent.Key, []byte) bool { return true }

// LinkLost does nothing.
func (h *StuckHost) LinkLost(agent.Link, error) {}

// Refused does nothing.
func (h *StuckHost) Refused() {}

// Device reports no device-memory driver.
func (h *StuckHost) Device() (devmem.Driver, error) { return nil, devmem.ErrUnavailable }
