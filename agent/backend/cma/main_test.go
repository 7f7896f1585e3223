//go:build linux

package cma_test

import (
	"testing"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backendtest"
)

func factory() ([]agent.Backend, error) { return []agent.Backend{cma.New()}, nil }

func TestMain(m *testing.M) {
	childMain() // becomes one of this package's own children when asked to
	// or the conformance suite's child; the benchmarks share one target
	backendtest.MainAfter(m, factory, benchTarget.Stop)
}

func TestConformance(t *testing.T) {
	backendtest.Run(t, backendtest.Config{New: factory, CrossProcess: true})
}
