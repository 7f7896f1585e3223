package agent

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// Why a backend was passed over reads "tcp: ..." once: backends name
// themselves in their errors, and the agent adds the name only where one
// did not (the loopback refusal read "tcp: tcp: peer ... advertises").
func TestNamedBackendError(t *testing.T) {
	self := errors.New("tcp: peer x advertises the loopback address")
	require.Same(t, self, named("tcp", self))
	bare := errors.New("no route")
	err := named("tcp", bare)
	require.Equal(t, "tcp: no route", err.Error())
	require.ErrorIs(t, err, bare)
	require.Equal(t, "cma: tcp: x", named("cma", errors.New("tcp: x")).Error())
}
