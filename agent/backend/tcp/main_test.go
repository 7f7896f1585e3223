package tcp_test

import (
	"os"
	"testing"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backendtest"
)

func factory() ([]agent.Backend, error) { return []agent.Backend{tcp.New()}, nil }

func TestMain(m *testing.M) {
	if os.Getenv(benchChildEnv) != "" { // the benchmarks' target
		benchChild()
		return
	}
	// or the conformance suite's child; the benchmarks share one target
	backendtest.MainAfter(m, factory, benchTarget.Stop)
}

func TestConformance(t *testing.T) {
	backendtest.Run(t, backendtest.Config{New: factory, CrossProcess: true})
}

// Latency mode changes how connections wait for bytes, not what they
// carry: the suite again, with this process's readers polling.
func TestConformanceLatencyMode(t *testing.T) {
	backendtest.Run(t, backendtest.Config{New: func() ([]agent.Backend, error) {
		return []agent.Backend{tcp.New(tcp.WithLatencyMode(0))}, nil
	}, CrossProcess: true}) // the child's agent does not poll

}
