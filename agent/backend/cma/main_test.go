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

// The suite with the same-host device path on (the default): GPU memory on
// the peer is mapped and copied on this side's GPU ("cma+ipc"). Its
// windows are 1 MiB here, not 256: the fault cases cancel, close and kill
// in the middle of transfers of a few MiB copied at simulated rates of
// tens of MiB/s, and need several windows to land between (TestIPC* run
// the default).
func TestConformance(t *testing.T) {
	small := func() ([]agent.Backend, error) { return []agent.Backend{cma.New(cma.WithDeviceWindow(1 << 20))}, nil }
	backendtest.Run(t, backendtest.Config{New: small, CrossProcess: true, DirectDevice: "ipc"})
}

// The suite again with the lease-free path for host memory off on this
// side, which turns it off for every pair it is in: small transfers of the
// Go heap take leases, as they did before cma+table, and stay covered.
func TestConformanceLeases(t *testing.T) {
	leases := func() ([]agent.Backend, error) {
		return []agent.Backend{cma.New(cma.WithDeviceWindow(1<<20), cma.WithLeaseFree(false))}, nil
	}
	backendtest.Run(t, backendtest.Config{New: leases, CrossProcess: true, DirectDevice: "ipc"})
}

// The suite again with every host buffer in shared memory, on both sides
// and in the child processes: transfers go through the peer's segments
// mapped ("cma+shm") wherever the remote memory lies in one.
func TestConformanceShared(t *testing.T) {
	small := func() ([]agent.Backend, error) { return []agent.Backend{cma.New(cma.WithDeviceWindow(1 << 20))}, nil }
	backendtest.Run(t, backendtest.Config{New: small, CrossProcess: true, DirectDevice: "ipc", SharedHost: true})
}

// The device cases again with the device path off on this side, which
// turns it off for the pair: GPU memory is staged by the agent that holds
// it, also against a child whose path is on.
func TestConformanceStaged(t *testing.T) {
	staged := func() ([]agent.Backend, error) { return []agent.Backend{cma.New(cma.WithDeviceIPC(false))}, nil }
	backendtest.RunDevice(t, backendtest.Config{New: staged, CrossProcess: true})
}
