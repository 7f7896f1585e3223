package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/connect"
)

// The initiator runs the measurements: it reaches the targets
// (session.go), sweeps the goxfer points (sweep.go, runops.go) and the
// baselines (baselines.go, ucx.go), measures latency and the control plane
// (control.go), and reports.

type initiator struct {
	cfg            *config
	nc             *nats.Conn
	natsURL        string
	stderr         io.Writer
	proc, local    *remote
	conns          map[string]*connect.Connector
	insts          map[string]agent.Backend // each connector's instance of the backend it measures
	raw1, raw4     []net.Conn
	ping           net.Conn // the ping-pong interleaved with small operations; nil: none
	prog           *progress
	round          atomic.Uint64
	results        []Result
	createNs       map[int]float64 // CreateReadable+Metadata per operation, by descriptors
	tokenBytes     map[int]int
	childExited    chan error
	baselineNotice map[string]string // why a baseline is missing
	// GPU memory (-initiator-mem or -target-mem vram): the bare driver,
	// the meter on the connectors' staging copies, and the sizes whose
	// pinned copy baselines this run has measured.
	drv       devmem.Driver
	meter     meter
	copySizes map[int]bool
	noVRAM    map[string]string // backends that cannot move GPU memory, and why
}

func runInitiator(ctx context.Context, cfg *config, stdout, stderr io.Writer) error {
	stderr = &lockedWriter{w: stderr} // the target child writes to it too
	in := &initiator{cfg: cfg, stderr: stderr, conns: map[string]*connect.Connector{}, insts: map[string]agent.Backend{}, createNs: map[int]float64{}, tokenBytes: map[int]int{}, baselineNotice: map[string]string{}}
	if cfg.mem.vram() {
		// No driver, no GPU: fail before anything starts.
		var err error
		if in.drv, err = gpuDriver(cfg.gpu); err != nil {
			return fmt.Errorf("-initiator-mem %s -target-mem %s: %w", cfg.mem.init, cfg.mem.target, err)
		}
	}
	var cleanup undo // NATS, then the targets, then the connections: undone in reverse
	defer cleanup.run()
	if err := in.connectNATS(ctx, &cleanup); err != nil {
		return err
	}
	if err := in.startTargets(ctx, &cleanup); err != nil {
		return err
	}
	if err := in.openConnections(ctx, &cleanup); err != nil {
		return err
	}

	ucxRuns := in.ucxPlan()
	in.prog = newProgress(cfg.progress, stderr, cfg.runs*in.countSteps(len(ucxRuns)))
	var runs [][]Result
	for range cfg.runs {
		in.results, in.copySizes, in.noVRAM = nil, map[int]bool{}, map[string]string{}
		if err := in.sweep(ctx); err != nil {
			in.prog.finish()
			return err
		}
		if err := in.latency(ctx); err != nil {
			in.prog.finish()
			return err
		}
		in.runUCX(ctx, ucxRuns)
		setRatios(in.results)
		runs = append(runs, in.results)
	}
	in.prog.finish()
	in.results = mergeRuns(runs)
	return in.report(stdout)
}

// report writes the table to stdout, then the -o files and the -chart.
func (in *initiator) report(stdout io.Writer) error {
	meta := in.runInfo()
	writeTable(stdout, in.results, meta)
	for _, o := range in.cfg.outputs {
		if err := writeFile(o, in.results, meta); err != nil {
			return err
		}
	}
	if in.cfg.chart != "" {
		if err := drawChart(in.cfg.chart, in.results, meta); err != nil {
			return fmt.Errorf("chart %s: %w", in.cfg.chart, err)
		}
	}
	return nil
}

func (in *initiator) runInfo() runInfo {
	host, _ := os.Hostname()
	ri := runInfo{Host: host, Runs: in.cfg.runs, Backends: builtNames(), Args: os.Args[1:], Check: in.cfg.check, Time: time.Now().UTC().Format(time.RFC3339)}
	if in.proc != nil {
		ri.TargetHost, ri.TargetPID, ri.SameHost = in.proc.hello.Host, in.proc.hello.PID, in.proc.sameClock
	}
	ri.InitiatorMem, ri.TargetMem = in.cfg.mem.init.String(), in.cfg.mem.target.String()
	if in.cfg.mem.vram() {
		ri.Device, ri.GPU, ri.StageChunk, ri.StagePool = in.drv.Name(), in.cfg.gpu, in.cfg.stageChunk, in.cfg.stagePool
		ri.DeviceIPC = "off"
		if in.cfg.deviceIPC {
			ri.DeviceIPC = "on"
		}
		if ri.Device == "sim" {
			ri.Notes = append(ri.Notes, simNotice)
		}
	}
	var targetSpin time.Duration
	if in.proc != nil {
		targetSpin = in.proc.hello.TCPSpin
	}
	switch {
	case in.cfg.tcpSpin == targetSpin && targetSpin > 0:
		ri.TCPLatency = in.cfg.tcpSpin.String()
	case in.cfg.tcpSpin != targetSpin: // a target started by hand with another -tcp-latency
		ri.TCPLatency = fmt.Sprintf("initiator %v, target %v", in.cfg.tcpSpin, targetSpin)
	}
	for k, v := range in.baselineNotice {
		ri.Notes = append(ri.Notes, k+": "+v)
	}
	slices.Sort(ri.Notes)
	return ri
}

// lockedWriter serializes writes from this process and its child's output.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
