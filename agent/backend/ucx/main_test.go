//go:build ucx

package ucx_test

import (
	"os"
	"strings"
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
	tls := os.Getenv("UCX_TLS")
	t.Logf("UCX_TLS=%q", tls)
	// Over shared memory (posix, sysv, sm, or UCX's own choice) copies run
	// at memory speed: the interrupted transfers must be larger.
	fast := tls == "" || strings.Contains(tls, "posix") || strings.Contains(tls, "sysv") || strings.Contains(tls, "sm") || strings.Contains(tls, "all")
	backendtest.Run(t, backendtest.Config{New: factory, CrossProcess: true, Fast: fast})
}
