//go:build linux

package cma_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backendtest"
)

func factory() ([]agent.Backend, error) { return []agent.Backend{cma.New()}, nil }

func TestMain(m *testing.M) {
	backendtest.Child(factory) // becomes the conformance suite's child process when asked to
	childMain()                // or one of this package's own children
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
