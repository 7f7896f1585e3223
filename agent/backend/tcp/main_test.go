package tcp_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backendtest"
)

func factory() ([]agent.Backend, error) { return []agent.Backend{tcp.New()}, nil }

func TestMain(m *testing.M) {
	backendtest.Child(factory) // becomes the conformance suite's child process when asked to
	if os.Getenv(benchChildEnv) != "" {
		benchChild()
		return
	}
	code := m.Run()
	stopSharedChild()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			os.Stderr.WriteString("goleak: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}

func TestConformance(t *testing.T) {
	backendtest.Run(t, backendtest.Config{New: factory, CrossProcess: true})
}
