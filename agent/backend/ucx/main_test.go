//go:build ucx

package ucx_test

import (
	"os"
	"testing"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/ucx"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// The transports come from UCX_TLS in the environment, which the suite's
// child processes inherit: .ci/ucx runs the package once with
// UCX_TLS=tcp,self and once with UCX_TLS=posix,self.
func factory() ([]agent.Backend, error) { return []agent.Backend{ucx.New()}, nil }

func TestMain(m *testing.M) { backendtest.Main(m, factory) }

func TestConformance(t *testing.T) {
	t.Logf("UCX_TLS=%q", os.Getenv("UCX_TLS"))
	backendtest.Run(t, backendtest.Config{New: factory, CrossProcess: true})
}
