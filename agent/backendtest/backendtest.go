// Package backendtest is the conformance suite every goxfer backend passes:
// it checks the contract of [agent.Backend] through real agents.
//
// A backend package wires it with two functions in a _test.go file:
//
//	func factory() ([]agent.Backend, error) { return []agent.Backend{tcp.New()}, nil }
//
//	func TestMain(m *testing.M) { backendtest.Main(m, factory) }
//
//	func TestConformance(t *testing.T) {
//		backendtest.Run(t, backendtest.Config{New: factory, CrossProcess: true})
//	}
//
// [Run] drives real agents built on the factory's backends: in this
// process, and in child processes that re-execute the test binary ([Main],
// or [Child] for a TestMain of its own, turns the binary into such a child
// when the environment says so). Every transferred byte is checked against
// a deterministic pattern, and the guard bytes around every descriptor must
// stay untouched.
//
// The suite covers READ and WRITE of single descriptors from 1 B to 64 MiB
// and of 4096 small ones, bound and standalone notifications, concurrent
// transfers to one exposure, transfers across processes in both directions,
// refused accesses (forged key, out-of-range address, wrong access kind,
// revoked exposure), lost peers (a killed or closed agent on either side),
// cancellation, revocation during a WRITE, [agent.Agent.Close] with
// transfers in flight, and registration reference counting.
//
// Device memory runs on simulated GPUs (devmem.Sim; GOXFER_DEVICE=sim in
// child processes), one set per agent: READ and WRITE with device memory on
// the active side, the passive side, both, and interleaved with host
// memory, in this process and across processes, with guard bytes around
// every descriptor in host and device memory; device memory the agent
// cannot use (a pointer its driver does not know, no driver) refused at
// Post and Expose; a peer's device memory refused with
// [agent.ErrNoBackend] by backends that can neither stage it
// ([agent.DeviceStager]) nor move it; small descriptors staged in batches;
// the staging pipeline's overlap, read from the simulator's record; and
// cancellation, Close and killed peers in the middle of staging, with every
// staging buffer back in its pool. Backends that move device memory
// themselves skip the device cases: the simulator's memory is not theirs
// to reach.
//
// Timeouts in the suite only guard against hangs; the one bound it asserts
// is Config.LostWithin.
package backendtest

import (
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent"
)

// Factory builds a fresh set of backends for one agent, in preference
// order. The suite calls it once per agent it starts, in this process and in
// child processes, so it must not share backends between calls.
type Factory func() ([]agent.Backend, error)

// Config says how to run the suite for a backend.
type Config struct {
	// New builds each agent's backends. Required. It must build the same
	// backends as the factory given to Main.
	New Factory
	// CrossProcess says the backends move bytes between processes. When
	// false (an in-process backend such as mem), the cross-process cases
	// instead check that a transfer to an agent in a child process fails
	// with [agent.ErrNoBackend], and lost peers are simulated by closing an
	// agent in this process. Default: false.
	CrossProcess bool
	// LostWithin bounds how long a lost peer (a killed process or a closed
	// agent) may take to surface as [agent.ErrRemoteLost] on the active side
	// or [agent.EventPeerLost] on the passive side. Default: 5 s.
	LostWithin time.Duration
	// DirectDevice is the path the backend names ([agent.DeviceDirect])
	// for the transfers with GPU memory it moves itself, or "" if it moves
	// none: the device cases then expect the agent's path rule, the
	// backend's name and "+"+DirectDevice where no local GPU memory faces
	// the peer's host memory, "+staging" otherwise (cma: "ipc", both sides
	// simulated). Cases about staging itself (Overlap) are skipped: run
	// [RunDevice] with a factory that turns the backend's own path off for
	// them. Default: "".
	DirectDevice string
	// SharedHost allocates the suite's host buffers, on both sides and in
	// child processes, in shared memory (package shm), so that a backend
	// with a shared-memory path (cma) is tested on it. Run sets an
	// environment variable for its duration: such a Run must not be
	// parallel to others.
	SharedHost bool
	// Fast says the backend copies at memory speed within a host (UCX
	// over shared memory): the cases that interrupt a transfer in flight
	// move 512 MiB instead of 64, or the transfer ends before they can.
	// SharedHost implies it.
	Fast bool
}

// hangGuard bounds every wait the suite does, so that a broken backend
// fails the test instead of hanging it. It is no performance bound.
const hangGuard = 2 * time.Minute

// childEnv, when set, turns the test binary into a suite child process.
const childEnv = "GOXFER_BACKENDTEST_CHILD"

// childReady records that TestMain went through Child (or Main), so the
// test binary can be re-executed as a child.
var childReady bool

// Main is the TestMain of a backend package that runs the suite: [Child],
// then the tests, then a check that no goroutine leaked
// ([goleak.VerifyTestMain] with opts).
func Main(m *testing.M, f Factory, opts ...goleak.Option) {
	Child(f)
	goleak.VerifyTestMain(m, opts...)
}

// Child makes the test binary a suite child process when it was started as
// one: it runs an agent on f's backends, serves the parent's commands and
// exits. Otherwise it returns at once. Call it at the start of TestMain when
// [Main] does not fit, for example when TestMain has children of its own.
func Child(f Factory) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild(f, os.Stdin, os.Stdout))
	}
	childReady = true
}

// Run runs the conformance suite as subtests of t. cfg.New is required.
func Run(t *testing.T, cfg Config) {
	if cfg.New == nil {
		t.Fatal("backendtest: Config.New is nil")
	}
	if cfg.LostWithin <= 0 {
		cfg.LostWithin = 5 * time.Second
	}
	if cfg.SharedHost {
		t.Setenv(sharedEnv, "1")
	}
	t.Run("Transfer", func(t *testing.T) { testTransfer(t, cfg) })
	t.Run("Notify", func(t *testing.T) { testNotify(t, cfg) })
	t.Run("Concurrent", func(t *testing.T) { testConcurrent(t, cfg) })
	t.Run("Device", func(t *testing.T) { testDevice(t, cfg) })
	t.Run("Abuse", func(t *testing.T) { testAbuse(t, cfg) })
	t.Run("Fault", func(t *testing.T) { testFault(t, cfg) })
	t.Run("Registration", func(t *testing.T) { testRegistration(t, cfg) })
	t.Run("CrossProcess", func(t *testing.T) { testCrossProcess(t, cfg) })
}

// RunDevice runs only the suite's device-memory cases, in this process and
// across processes (when cfg.CrossProcess): for a second configuration of
// a backend whose other cases [Run] covers, such as cma with its device
// path off. The child processes are built by the factory given to [Main],
// whatever cfg.New builds.
func RunDevice(t *testing.T, cfg Config) {
	if cfg.New == nil {
		t.Fatal("backendtest: Config.New is nil")
	}
	if cfg.LostWithin <= 0 {
		cfg.LostWithin = 5 * time.Second
	}
	t.Run("Device", func(t *testing.T) { testDevice(t, cfg) })
	if cfg.CrossProcess {
		t.Run("CrossProcess/Device", func(t *testing.T) { crossDevice(t, cfg) })
	}
}

// devicePath is the path a transfer of segs over backend takes under cfg:
// the backend's own where it moves GPU memory itself (see
// Config.DirectDevice), "+staging" where GPU memory is staged, the
// backend's name alone for host memory.
func devicePath(cfg Config, backend string, segs []agent.Segment) string {
	local, remote, facing := false, false, false
	for _, s := range segs {
		local = local || s.Local.Kind == agent.KindVRAM
		remote = remote || s.Remote.Kind == agent.KindVRAM
		facing = facing || (s.Local.Kind == agent.KindVRAM && s.Remote.Kind == agent.KindDRAM)
	}
	switch {
	case !local && !remote:
		return backend
	case cfg.DirectDevice != "" && !facing:
		return backend + "+" + cfg.DirectDevice
	}
	return backend + "+staging"
}
