package main

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/connect"
)

// kvDevice is where both workers keep their KV blocks, as -device says:
// host memory, a CUDA GPU, or a GPU of the simulator (devmem.Sim), which
// stands in for one on machines without a GPU. It is a flag.Value.
type kvDevice struct {
	spec   string // as given: "host", "cuda", "cuda:1", "sim", "sim:1"
	driver string // "" (host memory), "cuda" or "sim"
	gpu    int    // the GPU ordinal, for cuda and sim
}

// deviceUsage is what -device accepts.
const deviceUsage = "host, cuda, cuda:N, sim or sim:N"

// Set parses a -device value.
func (d *kvDevice) Set(s string) error {
	kind, ord, hasOrd := strings.Cut(strings.ToLower(s), ":")
	switch {
	case kind == "host" && !hasOrd:
		*d = kvDevice{spec: s}
		return nil
	case kind == "cuda" || kind == "sim":
		// connect.ParseDevice checks the ordinal: "cuda", "cuda:N".
		spec := "cuda"
		if hasOrd {
			spec += ":" + ord
		}
		dev, err := connect.ParseDevice(spec)
		if err != nil {
			return fmt.Errorf("want %s, N a GPU ordinal from 0; %q is not one", deviceUsage, ord)
		}
		*d = kvDevice{spec: s, driver: kind, gpu: dev.ID}
		return nil
	}
	return fmt.Errorf("want %s", deviceUsage)
}

// String returns the value as given, which Set accepts again: the
// orchestrator passes it on to the workers.
func (d *kvDevice) String() string {
	if d.spec == "" {
		return "host"
	}
	return d.spec
}

// gpuMemory reports whether the KV blocks live in GPU memory.
func (d kvDevice) gpuMemory() bool { return d.driver != "" }

// connDevice is the device the blocks' descriptors name. The simulator's
// GPUs are CUDA GPUs to the SDK.
func (d kvDevice) connDevice() connect.Device {
	if !d.gpuMemory() {
		return connect.Host()
	}
	return connect.CUDA(d.gpu)
}

// describe says where the blocks live, for the workers' output.
func (d kvDevice) describe() string {
	switch d.driver {
	case "cuda":
		return fmt.Sprintf("GPU memory on %v (CUDA driver)", d.connDevice())
	case "sim":
		return fmt.Sprintf("GPU memory on %v, simulated (%s=sim)", d.connDevice(), devmem.EnvDevice)
	}
	return "host memory"
}

// env returns the environment variables the workers run with: with -device
// sim, GOXFER_DEVICE=sim, so that everything in them that asks
// devmem.Default for the process's driver gets the simulator. The
// simulator is per process: each worker simulates its own GPUs, and the
// bytes cross between them over the backends, staged, as they would
// between two GPUs.
func (d kvDevice) env() []string {
	if d.driver == "sim" {
		return []string{devmem.EnvDevice + "=sim"}
	}
	return nil
}

// open returns the driver of the blocks' GPU memory, checked to see the
// GPU, or nil for host memory. It fails at once, with an error that says
// what is missing, on a machine without a CUDA driver or GPU; the run then
// ends before it starts NATS or any worker.
func (d kvDevice) open() (devmem.Driver, error) {
	switch d.driver {
	case "cuda":
		// The CUDA driver itself, whatever GOXFER_DEVICE says: -device
		// cuda asks for a real GPU.
		drv := devmem.CUDA()
		n, err := drv.Devices()
		switch {
		case errors.Is(err, devmem.ErrUnavailable):
			return nil, fmt.Errorf("-device %s: no CUDA driver on this machine (%v); try -device sim", d.spec, err)
		case err != nil:
			return nil, fmt.Errorf("-device %s: the CUDA driver failed: %v; try -device sim", d.spec, err)
		case n == 0:
			return nil, fmt.Errorf("-device %s: the CUDA driver sees no GPU on this machine; try -device sim", d.spec)
		case d.gpu >= n:
			return nil, fmt.Errorf("-device %s: the CUDA driver sees %s, cuda:0 to cuda:%d", d.spec, gpus(n), n-1)
		}
		return drv, nil
	case "sim":
		// The simulator, in this process too: a worker started alone with
		// -role gets no GOXFER_DEVICE from an orchestrator.
		if err := os.Setenv(devmem.EnvDevice, "sim"); err != nil {
			return nil, fmt.Errorf("-device %s: set %s=sim: %w", d.spec, devmem.EnvDevice, err)
		}
		drv, err := devmem.Default()
		if err != nil {
			return nil, fmt.Errorf("-device %s: %w", d.spec, err)
		}
		if drv.Name() != "sim" {
			return nil, fmt.Errorf("-device %s: this process already uses the %s driver, not the simulator", d.spec, drv.Name())
		}
		n, err := drv.Devices()
		if err != nil {
			return nil, fmt.Errorf("-device %s: %w", d.spec, err)
		}
		if d.gpu >= n {
			return nil, fmt.Errorf("-device %s: the simulator has %s, sim:0 to sim:%d (set %s for more)", d.spec, gpus(n), n-1, devmem.EnvSimDevices)
		}
		return drv, nil
	}
	return nil, nil
}

// gpus says "1 GPU" or "2 GPUs".
func gpus(n int) string {
	if n == 1 {
		return "1 GPU"
	}
	return strconv.Itoa(n) + " GPUs"
}
