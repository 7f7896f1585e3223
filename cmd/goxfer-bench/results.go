package main

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// Result is one row: a goxfer point, a baseline, a ucx_perftest run, or a
// control-plane measurement. Latencies are in µs; zero means not measured.
type Result struct {
	Kind      string  `json:"kind"` // goxfer, baseline, ucx_perftest, control
	Name      string  `json:"name"` // backend or baseline
	Op        string  `json:"op"`   // READ, WRITE, PINGPONG, REQ, REQ+READ
	Shape     string  `json:"shape,omitempty"`
	Block     int     `json:"block"`
	Descs     int     `json:"descs"`
	Bytes     int64   `json:"bytes"` // per operation
	Inflight  int     `json:"inflight"`
	Iters     int     `json:"iters"`
	GBps      float64 `json:"gbps"` // 10^9 bytes per second
	OpsPerSec float64 `json:"ops_per_sec"`
	P50       float64 `json:"p50_us"` // Begin to the active Wait's return
	P99       float64 `json:"p99_us"`
	DoneP50   float64 `json:"done_p50_us"` // Begin to the passive Wait's return
	DoneP99   float64 `json:"done_p99_us"`
	Baseline  string  `json:"baseline,omitempty"`
	BaseGBps  float64 `json:"baseline_gbps,omitempty"`
	Ratio     float64 `json:"ratio,omitempty"`
	InProcess bool    `json:"in_process"`
	Checked   bool    `json:"checked"`
	Note      string  `json:"note,omitempty"`

	// Where a goxfer row's buffers lived (dram, vram: initiator's local
	// ones, target's exposed ones) and how the bytes moved (the operations'
	// Path: "tcp", "tcp+staging", "cma+ipc").
	InitiatorMem string `json:"initiator_mem,omitempty"`
	TargetMem    string `json:"target_mem,omitempty"`
	Path         string `json:"path,omitempty"`
	// Device is the driver of a row that touched GPU memory: "cuda", or
	// "sim" for the simulator, whose figures say nothing about a GPU.
	Device string `json:"device,omitempty"`

	// Ratios of a row with GPU memory, each of figures from the same run:
	// GB/s over the same backend's dram/dram row of the same shape (DRAM),
	// and the rate of the connectors' device copies (bytes over the time
	// from enqueueing a batch of copies to its Sync, both sides, warm-up
	// included), by direction, over the cuMemcpy baseline of StageChunk
	// bytes: one staging chunk on a "+staging" path, one window of cma's
	// device path on "cma+ipc", whose copies run between the mapped peer
	// memory and local GPU memory (D2D) or host memory (D2H, H2D). A
	// "cma+ipc" row's Baseline is the in-process cuMemcpy of the copy it
	// makes, of the operation's bytes ("cuMemcpy D2D").
	DRAMGBps      float64 `json:"dram_gbps,omitempty"`
	DRAMRatio     float64 `json:"dram_ratio,omitempty"`
	StageChunk    int     `json:"stage_chunk,omitempty"`
	StageD2HGBps  float64 `json:"stage_d2h_gbps,omitempty"`
	CopyD2HGBps   float64 `json:"cumemcpy_d2h_gbps,omitempty"`
	StageD2HRatio float64 `json:"stage_d2h_ratio,omitempty"`
	StageH2DGBps  float64 `json:"stage_h2d_gbps,omitempty"`
	CopyH2DGBps   float64 `json:"cumemcpy_h2d_gbps,omitempty"`
	StageH2DRatio float64 `json:"stage_h2d_ratio,omitempty"`
	StageD2DGBps  float64 `json:"stage_d2d_gbps,omitempty"`
	CopyD2DGBps   float64 `json:"cumemcpy_d2d_gbps,omitempty"`
	StageD2DRatio float64 `json:"stage_d2d_ratio,omitempty"`
	// For a row of several descriptors: GB/s over the row of one
	// descriptor of the same bytes (same backend, operation, depth and
	// memory), as the KV hand-off against one region.
	OneRegionGBps  float64 `json:"one_region_gbps,omitempty"`
	OneRegionRatio float64 `json:"one_region_ratio,omitempty"`

	// A small point (at most 64 KiB, one in flight, -interleave) against
	// the raw 4 KiB TCP ping-pong run in batches alternating with its own:
	// the ping-pong's p50 over the point (µs), the pairs of batches, and
	// the median over the pairs of the batch's p50 over the ping-pong's,
	// to the active Wait (PingRatio) and to the passive one (DonePingRatio).
	PingP50       float64 `json:"pingpong_p50_us,omitempty"`
	PingPairs     int     `json:"pingpong_pairs,omitempty"`
	PingRatio     float64 `json:"pingpong_ratio,omitempty"`
	DonePingRatio float64 `json:"done_pingpong_ratio,omitempty"`
}

// runInfo describes the run in the JSON output and the table's header.
type runInfo struct {
	Time       string   `json:"time"`
	Host       string   `json:"host"`
	TargetHost string   `json:"target_host,omitempty"`
	TargetPID  int      `json:"target_pid,omitempty"`
	SameHost   bool     `json:"same_host"`
	Backends   []string `json:"built_backends"`
	Args       []string `json:"args"`
	Check      bool     `json:"check"`
	Runs       int      `json:"runs"`
	Notes      []string `json:"notes,omitempty"`
	// GPU memory: each side's memory kind, and with vram on either side
	// the device driver ("cuda", "sim"), the GPU and the staging settings.
	InitiatorMem string `json:"initiator_mem,omitempty"`
	TargetMem    string `json:"target_mem,omitempty"`
	Device       string `json:"device,omitempty"`
	GPU          int    `json:"gpu,omitempty"`
	StageChunk   int    `json:"stage_chunk,omitempty"`
	StagePool    int    `json:"stage_pool,omitempty"`
	// DeviceIPC is -device-ipc with GPU memory: "on" (cma may map the
	// peer's GPU memory, path cma+ipc) or "off" (it stages it).
	DeviceIPC string `json:"device_ipc,omitempty"`
	// TCPLatency is -tcp-latency when tcp's latency mode was on: the
	// spin of its readers on both sides, or "initiator X, target Y" when
	// the sides differ ("" when off on both).
	TCPLatency string `json:"tcp_latency,omitempty"`
}

// simNotice heads every output of a run on the simulated device.
const simNotice = "SIMULATED GPU (GOXFER_DEVICE=sim): GPU memory is host memory behind the simulator's copies; its figures and ratios say nothing about a real GPU"

func (r *Result) setThroughput(bytes int64, iters int, elapsed time.Duration) {
	if elapsed <= 0 {
		return
	}
	s := elapsed.Seconds()
	r.GBps = float64(bytes) * float64(iters) / s / 1e9
	r.OpsPerSec = float64(iters) / s
}

// percentiles returns p50 and p99 in µs (nearest rank).
func percentiles(lat []time.Duration) (p50, p99 float64) {
	if len(lat) == 0 {
		return 0, 0
	}
	s := slices.Clone(lat)
	slices.Sort(s)
	at := func(q float64) float64 {
		i := int(q*float64(len(s))+0.999999) - 1
		return float64(s[min(max(i, 0), len(s)-1)].Nanoseconds()) / 1e3
	}
	return at(0.50), at(0.99)
}

// timeCalls runs f warmup times, then iters times on the clock: the
// latency of each measured call, and the time they took together.
func timeCalls(warmup, iters int, f func() error) (lat []time.Duration, elapsed time.Duration, err error) {
	for range warmup {
		if err := f(); err != nil {
			return nil, 0, err
		}
	}
	lat = make([]time.Duration, iters)
	start := time.Now()
	for i := range iters {
		t0 := time.Now()
		if err := f(); err != nil {
			return nil, 0, err
		}
		lat[i] = time.Since(t0)
	}
	return lat, time.Since(start), nil
}

func (r Result) summary() string {
	s := fmt.Sprintf("%.2f GB/s, p50 %.1f µs", r.GBps, r.P50)
	if r.DoneP50 > 0 {
		s += fmt.Sprintf(", done p50 %.1f µs", r.DoneP50)
	}
	return s
}

// ipcPath reports whether every operation of a row took a same-host
// device path ("cma+ipc"): path is the row's sorted, comma-joined paths.
func ipcPath(path string) bool { return allPaths(path, "+ipc") }

// shmPath reports whether every operation of a row copied through the
// peer's shared host memory, mapped ("cma+shm").
func shmPath(path string) bool { return allPaths(path, "+shm") }

// allPaths reports whether every path of a row (sorted, comma-joined) ends
// in suffix.
func allPaths(path, suffix string) bool {
	if path == "" {
		return false
	}
	for p := range strings.SplitSeq(path, ",") {
		if !strings.HasSuffix(p, suffix) {
			return false
		}
	}
	return true
}

// deviceCopy is the copy a same-host device path makes for row r: between
// the exposing side's memory and the copier's (READ: target to initiator;
// WRITE: the other way), "D2D", "D2H" or "H2D".
func deviceCopy(r Result) string {
	src, dst := r.TargetMem, r.InitiatorMem
	if r.Op == dirWrite.String() {
		src, dst = dst, src
	}
	end := func(mem string) string {
		if mem == memVRAM.String() {
			return "D"
		}
		return "H"
	}
	return end(src) + "2" + end(dst)
}

// setRatios sets each goxfer row's ratio to its backend's baseline for the
// same operation and bytes, measured in the same run; a row of the
// same-host device path ("cma+ipc"), to the in-process cuMemcpy of the
// copy it makes, of the same bytes; a row through mapped shared memory
// ("cma+shm"), whose copy is a memmove in the initiator, to Go copy of the
// same bytes.
func setRatios(rs []Result) {
	base := map[string]string{}
	for _, b := range builtBackends() {
		base[b.name] = b.baseline
	}
	for i := range rs {
		r := &rs[i]
		name := strings.TrimSuffix(r.Name, heapSuffix)
		if r.Kind == "goxfer" && ipcPath(r.Path) {
			op := deviceCopy(*r)
			for _, b := range rs {
				if b.Kind == "baseline" && b.Name == baseCopy && b.Op == op && b.Bytes == r.Bytes && b.GBps > 0 {
					r.Baseline, r.BaseGBps, r.Ratio = baseCopy+" "+op, b.GBps, r.GBps/b.GBps
				}
			}
			continue
		}
		if r.Kind != "goxfer" || base[name] == "" {
			continue
		}
		want := []string{base[name]}
		if shmPath(r.Path) {
			want = []string{baseMemcpy}
		}
		if want[0] == baseTCP {
			want = []string{baseTCP1, baseTCP4} // the ceiling: the better of the two
		}
		for _, b := range rs {
			// The same bytes, measured right after this point (presets
			// measure the same bytes once per shape).
			isBase := b.Kind == "baseline" && slices.Contains(want, b.Name) || want[0] == baseUCX && b.Kind == baseUCX
			if isBase && b.Op == r.Op && b.Bytes == r.Bytes && b.Shape == r.Shape && b.GBps > r.BaseGBps {
				r.Baseline, r.BaseGBps, r.Ratio = b.Name, b.GBps, r.GBps/b.GBps
			}
		}
	}
	setGPURatios(rs)
}

// setGPURatios sets the ratios of rows with GPU memory (over the DRAM row
// and over pinned copies) and of rows of several descriptors (over one
// region of the same bytes), from rows of the same run.
func setGPURatios(rs []Result) {
	ratio := func(a, b float64) float64 {
		if a <= 0 || b <= 0 {
			return 0
		}
		return a / b
	}
	for i := range rs {
		r := &rs[i]
		if r.Kind != "goxfer" {
			continue
		}
		vram := r.InitiatorMem == memVRAM.String() || r.TargetMem == memVRAM.String()
		notDRAM := vram || r.InitiatorMem == memSHM.String() || r.TargetMem == memSHM.String()
		for _, b := range rs {
			switch {
			case b.Kind == "goxfer" && notDRAM && b.InitiatorMem == memDRAM.String() && b.TargetMem == memDRAM.String() &&
				strings.TrimSuffix(b.Name, heapSuffix) == r.Name && b.Op == r.Op && b.Block == r.Block && b.Descs == r.Descs && b.Inflight == r.Inflight:
				// The DRAM figure of the same backend: on the Go heap where
				// the backend's allocator was measured too.
				if r.DRAMGBps == 0 || strings.HasSuffix(b.Name, heapSuffix) {
					r.DRAMGBps = b.GBps
				}
			case b.Kind == "goxfer" && r.Descs > 1 && b.Descs == 1 && b.Name == r.Name && b.Op == r.Op && b.Bytes == r.Bytes &&
				b.Inflight == r.Inflight && b.InitiatorMem == r.InitiatorMem && b.TargetMem == r.TargetMem:
				r.OneRegionGBps = b.GBps
			case b.Kind == "baseline" && b.Name == baseCopy && vram && b.Bytes == int64(r.StageChunk):
				// Only the directions the row copied: the others compare
				// nothing.
				switch {
				case b.Op == "D2H" && r.StageD2HGBps > 0:
					r.CopyD2HGBps = b.GBps
				case b.Op == "H2D" && r.StageH2DGBps > 0:
					r.CopyH2DGBps = b.GBps
				case b.Op == "D2D" && r.StageD2DGBps > 0:
					r.CopyD2DGBps = b.GBps
				}
			}
		}
		r.DRAMRatio = ratio(r.GBps, r.DRAMGBps)
		r.OneRegionRatio = ratio(r.GBps, r.OneRegionGBps)
		r.StageD2HRatio = ratio(r.StageD2HGBps, r.CopyD2HGBps)
		r.StageH2DRatio = ratio(r.StageH2DGBps, r.CopyH2DGBps)
		r.StageD2DRatio = ratio(r.StageD2DGBps, r.CopyD2DGBps)
	}
}

func fmtF(v float64, prec int) string {
	if v == 0 {
		return ""
	}
	return strconv.FormatFloat(v, 'f', prec, 64)
}

func fmtOps(v float64) string {
	if v == 0 {
		return ""
	}
	return strconv.FormatFloat(v, 'f', 0, 64)
}

// writeTable prints the transfers, then latency and the control plane.
func writeTable(w io.Writer, rs []Result, ri runInfo) {
	fmt.Fprintf(w, "goxfer-bench  %s  host %s", ri.Time, ri.Host)
	if ri.TargetPID != 0 {
		where := "same host"
		if !ri.SameHost {
			where = "host " + ri.TargetHost
		}
		fmt.Fprintf(w, "  target pid %d (%s)", ri.TargetPID, where)
	}
	fmt.Fprintf(w, "  built backends: %s\n", strings.Join(ri.Backends, ", "))
	if ri.TCPLatency != "" {
		fmt.Fprintf(w, "tcp latency mode (-tcp-latency: readers poll this long after a frame before they block): %s\n", ri.TCPLatency)
	}
	if ri.Device != "" {
		fmt.Fprintf(w, "GPU memory: initiator %s, target %s, GPU %d, %s driver; staging through pinned host memory in %s chunks, %s pool per side",
			ri.InitiatorMem, ri.TargetMem, ri.GPU, ri.Device, fmtSize(float64(ri.StageChunk)), fmtSize(float64(ri.StagePool)))
		if ri.DeviceIPC != "" {
			fmt.Fprintf(w, "; cma's same-host device path (-device-ipc) %s", ri.DeviceIPC)
		}
		fmt.Fprintln(w)
	}
	if ri.Device == "sim" {
		fmt.Fprintln(w, "*** "+simNotice+" ***")
	}
	fmt.Fprintln(w, "GB/s = 10^9 B/s; p50/p99: Begin to the active Wait; done: Begin to the target's passive Wait (same host only); ratio: GB/s over the baseline's, same run")
	if slices.ContainsFunc(rs, func(r Result) bool { return r.Kind == "goxfer" && ipcPath(r.Path) }) {
		fmt.Fprintln(w, "path cma+ipc: cma mapped the peer's GPU memory (same host) and copied on the GPU; its baseline is cuMemcpy of that copy in one process, same bytes")
	}
	if slices.ContainsFunc(rs, func(r Result) bool { return r.Kind == "goxfer" && shmPath(r.Path) }) {
		fmt.Fprintln(w, "path cma+shm: cma mapped the peer's shared host memory (same host) and copied with memmove in the initiator; its baseline is Go copy in one process, same bytes")
	}
	if ri.Runs > 1 {
		fmt.Fprintf(w, "every figure is the median of %d runs; ratios are medians of each run's own ratio\n", ri.Runs)
	}
	if ri.Check {
		fmt.Fprintln(w, "-check: every byte verified; timings include the verification and are not meaningful")
	}
	fmt.Fprintln(w)
	// The memory and path columns, where some row is not Go heap to Go
	// heap.
	gpu := slices.ContainsFunc(rs, func(r Result) bool {
		return r.Device != "" || r.InitiatorMem != "" && (r.InitiatorMem != memDRAM.String() || r.TargetMem != memDRAM.String())
	})
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := "backend\top\t"
	if gpu {
		head += "mem (init/target)\tpath\t"
	}
	fmt.Fprintln(tw, head+"block\tdescs\tin flight\tGB/s\tops/s\tp50 µs\tp99 µs\tdone p50 µs\tdone p99 µs\tbaseline\tbase GB/s\tratio\t  note")
	for _, r := range rs {
		if r.Kind == "control" || r.Op == "PINGPONG" {
			continue
		}
		cells := []string{rowName(r), r.Op}
		if gpu {
			m := ""
			if r.InitiatorMem != "" {
				m = r.InitiatorMem + "/" + r.TargetMem
			}
			cells = append(cells, m, r.Path)
		}
		cells = append(cells, fmtSize(float64(r.Block)), strconv.Itoa(r.Descs), intOrBlank(r.Inflight),
			fmtF(r.GBps, 2), fmtOps(r.OpsPerSec), fmtF(r.P50, 1), fmtF(r.P99, 1), fmtF(r.DoneP50, 1), fmtF(r.DoneP99, 1),
			r.Baseline, fmtF(r.BaseGBps, 2), fmtF(r.Ratio, 2), "  "+r.Note)
		fmt.Fprintln(tw, strings.Join(cells, "\t"))
	}
	_ = tw.Flush()
	writeRatioTable(w, rs)
	writePingTable(w, rs)

	var lat []Result
	for _, r := range rs {
		if r.Kind == "control" || r.Op == "PINGPONG" {
			lat = append(lat, r)
		}
	}
	if len(lat) > 0 {
		fmt.Fprintln(w)
		fmt.Fprintln(w, "latency and control plane (µs)")
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "what\top\tdescs\tp50 µs\tp99 µs\t×ping\t  note")
		for _, r := range lat {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t  %s\n", r.Name, r.Op, r.Descs, fmtF(r.P50, 1), fmtF(r.P99, 1), fmtF(r.PingRatio, 2), r.Note)
		}
		_ = tw.Flush()
	}
	for _, n := range ri.Notes {
		fmt.Fprintln(w, "note:", n)
	}
}

// rowName is a row's name in the table: baselines marked, rows of the
// simulated device labelled.
func rowName(r Result) string {
	name := r.Name
	if r.Kind != "goxfer" {
		name = "· " + name
	}
	if r.Device == "sim" {
		name += " [sim]"
	}
	return name
}

// writeRatioTable prints the ratios of rows with GPU memory and of rows of
// several descriptors, if any: each of two figures from the same run.
func writeRatioTable(w io.Writer, rs []Result) {
	var rows []Result
	for _, r := range rs {
		if r.Kind == "goxfer" && (r.DRAMGBps > 0 || r.OneRegionGBps > 0 || r.StageD2HGBps > 0 || r.StageH2DGBps > 0 || r.StageD2DGBps > 0) {
			rows = append(rows, r)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "ratios from this run: ×DRAM: GB/s over the same backend's dram/dram row; ×1 region: over one descriptor of the same bytes;")
	fmt.Fprintln(w, "stage: rate of the connectors' device copies (enqueue to Sync, both sides) over cuMemcpy of one chunk: a staging chunk (+staging), a device window (+ipc)")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "backend\top\tmem (init/target)\tpath\tblock\tdescs\tin flight\tGB/s\tDRAM GB/s\t×DRAM\t1 region GB/s\t×1 region\tchunk\tstage D2H GB/s\tcuMemcpy D2H\t×\tstage H2D GB/s\tcuMemcpy H2D\t×\tstage D2D GB/s\tcuMemcpy D2D\t×\t")
	for _, r := range rows {
		chunk := ""
		if r.StageChunk > 0 {
			chunk = fmtSize(float64(r.StageChunk))
		}
		fmt.Fprintln(tw, strings.Join([]string{rowName(r), r.Op, r.InitiatorMem + "/" + r.TargetMem, r.Path,
			fmtSize(float64(r.Block)), strconv.Itoa(r.Descs), intOrBlank(r.Inflight), fmtF(r.GBps, 2),
			fmtF(r.DRAMGBps, 2), fmtF(r.DRAMRatio, 2), fmtF(r.OneRegionGBps, 2), fmtF(r.OneRegionRatio, 2), chunk,
			fmtF(r.StageD2HGBps, 2), fmtF(r.CopyD2HGBps, 2), fmtF(r.StageD2HRatio, 2),
			fmtF(r.StageH2DGBps, 2), fmtF(r.CopyH2DGBps, 2), fmtF(r.StageH2DRatio, 2),
			fmtF(r.StageD2DGBps, 2), fmtF(r.CopyD2DGBps, 2), fmtF(r.StageD2DRatio, 2), ""}, "\t"))
	}
	_ = tw.Flush()
}

// writePingTable prints the rows measured interleaved with the 4 KiB TCP
// ping-pong, if any.
func writePingTable(w io.Writer, rs []Result) {
	var rows []Result
	for _, r := range rs {
		if r.Kind == "goxfer" && r.PingPairs > 0 {
			rows = append(rows, r)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "small operations against the raw 4 KiB TCP ping-pong, in alternating batches in the same seconds: ×ping is the median over the")
	fmt.Fprintln(w, "pairs of batches of the batch's p50 over the ping-pong's p50 (active: to the active Wait; done: to the target's passive Wait)")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "backend\top\tmem (init/target)\tpath\tblock\tdescs\tpairs\tp50 µs\tdone p50 µs\tping-pong p50 µs\t×ping active\t×ping done\t")
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join([]string{rowName(r), r.Op, r.InitiatorMem + "/" + r.TargetMem, r.Path,
			fmtSize(float64(r.Block)), strconv.Itoa(r.Descs), strconv.Itoa(r.PingPairs), fmtF(r.P50, 1), fmtF(r.DoneP50, 1),
			fmtF(r.PingP50, 1), fmtF(r.PingRatio, 2), fmtF(r.DonePingRatio, 2), ""}, "\t"))
	}
	_ = tw.Flush()
}

func intOrBlank(n int) string {
	if n == 0 {
		return ""
	}
	return strconv.Itoa(n)
}

// writeFile writes the results as CSV or JSON, by the file's extension.
func writeFile(name string, rs []Result, ri runInfo) error {
	f, err := os.Create(name)
	if err != nil {
		return err
	}
	switch strings.ToLower(fileExt(name)) {
	case ".json":
		enc := json.NewEncoder(f)
		enc.SetIndent("", "  ")
		err = enc.Encode(struct {
			Run     runInfo  `json:"run"`
			Results []Result `json:"results"`
		}{ri, rs})
	default:
		err = writeCSV(f, rs)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	return nil
}

var csvHeader = []string{"kind", "name", "op", "shape", "block", "descs", "bytes", "inflight", "iters", "gbps", "ops_per_sec",
	"p50_us", "p99_us", "done_p50_us", "done_p99_us", "baseline", "baseline_gbps", "ratio", "in_process", "checked", "note",
	"initiator_mem", "target_mem", "path", "device", "dram_gbps", "dram_ratio", "stage_chunk",
	"stage_d2h_gbps", "cumemcpy_d2h_gbps", "stage_d2h_ratio", "stage_h2d_gbps", "cumemcpy_h2d_gbps", "stage_h2d_ratio",
	"one_region_gbps", "one_region_ratio", "stage_d2d_gbps", "cumemcpy_d2d_gbps", "stage_d2d_ratio",
	"pingpong_p50_us", "pingpong_pairs", "pingpong_ratio", "done_pingpong_ratio"}

func writeCSV(w io.Writer, rs []Result) error {
	cw := csv.NewWriter(w)
	_ = cw.Write(csvHeader)
	f := func(v float64) string { return strconv.FormatFloat(v, 'g', 6, 64) }
	for _, r := range rs {
		_ = cw.Write([]string{r.Kind, r.Name, r.Op, r.Shape, strconv.Itoa(r.Block), strconv.Itoa(r.Descs), strconv.FormatInt(r.Bytes, 10),
			strconv.Itoa(r.Inflight), strconv.Itoa(r.Iters), f(r.GBps), f(r.OpsPerSec), f(r.P50), f(r.P99), f(r.DoneP50), f(r.DoneP99),
			r.Baseline, f(r.BaseGBps), f(r.Ratio), strconv.FormatBool(r.InProcess), strconv.FormatBool(r.Checked), r.Note,
			r.InitiatorMem, r.TargetMem, r.Path, r.Device, f(r.DRAMGBps), f(r.DRAMRatio), strconv.Itoa(r.StageChunk),
			f(r.StageD2HGBps), f(r.CopyD2HGBps), f(r.StageD2HRatio), f(r.StageH2DGBps), f(r.CopyH2DGBps), f(r.StageH2DRatio),
			f(r.OneRegionGBps), f(r.OneRegionRatio), f(r.StageD2DGBps), f(r.CopyD2DGBps), f(r.StageD2DRatio),
			f(r.PingP50), strconv.Itoa(r.PingPairs), f(r.PingRatio), f(r.DonePingRatio)})
	}
	cw.Flush()
	return cw.Error()
}

// mergeRuns returns, for rows measured in every run, the median of each
// figure over the runs; ratios are the median of each run's own ratio, so
// every ratio still compares figures measured side by side.
func mergeRuns(runs [][]Result) []Result {
	if len(runs) == 1 {
		return runs[0]
	}
	type key struct {
		kind, name, op, shape, imem, tmem string
		block, descs, inflight            int
	}
	keyOf := func(r Result) key {
		return key{r.Kind, r.Name, r.Op, r.Shape, r.InitiatorMem, r.TargetMem, r.Block, r.Descs, r.Inflight}
	}
	rows := map[key][]Result{}
	for _, run := range runs {
		for _, r := range run {
			rows[keyOf(r)] = append(rows[keyOf(r)], r)
		}
	}
	median := func(rs []Result, f func(Result) float64) float64 {
		vs := make([]float64, 0, len(rs))
		for _, r := range rs {
			vs = append(vs, f(r))
		}
		slices.Sort(vs)
		if len(vs)%2 == 1 {
			return vs[len(vs)/2]
		}
		return (vs[len(vs)/2-1] + vs[len(vs)/2]) / 2
	}
	var out []Result
	for _, r := range runs[0] {
		rs := rows[keyOf(r)]
		if len(rs) == 0 {
			continue // already merged
		}
		delete(rows, keyOf(r))
		m := r
		m.GBps = median(rs, func(r Result) float64 { return r.GBps })
		m.OpsPerSec = median(rs, func(r Result) float64 { return r.OpsPerSec })
		m.P50 = median(rs, func(r Result) float64 { return r.P50 })
		m.P99 = median(rs, func(r Result) float64 { return r.P99 })
		m.DoneP50 = median(rs, func(r Result) float64 { return r.DoneP50 })
		m.DoneP99 = median(rs, func(r Result) float64 { return r.DoneP99 })
		m.BaseGBps = median(rs, func(r Result) float64 { return r.BaseGBps })
		m.Ratio = median(rs, func(r Result) float64 { return r.Ratio })
		for _, f := range gpuFigures {
			*f(&m) = median(rs, func(r Result) float64 { return *f(&r) })
		}
		for _, o := range rs {
			if o.Baseline != m.Baseline {
				m.Baseline = baseTCP // the better of ×1 and ×4 varied between runs
			}
		}
		out = append(out, m)
	}
	return out
}

// gpuFigures are the GPU memory figures and ratios of a row, and those
// against the interleaved ping-pong, for mergeRuns.
var gpuFigures = []func(*Result) *float64{
	func(r *Result) *float64 { return &r.DRAMGBps },
	func(r *Result) *float64 { return &r.DRAMRatio },
	func(r *Result) *float64 { return &r.StageD2HGBps },
	func(r *Result) *float64 { return &r.CopyD2HGBps },
	func(r *Result) *float64 { return &r.StageD2HRatio },
	func(r *Result) *float64 { return &r.StageH2DGBps },
	func(r *Result) *float64 { return &r.CopyH2DGBps },
	func(r *Result) *float64 { return &r.StageH2DRatio },
	func(r *Result) *float64 { return &r.OneRegionGBps },
	func(r *Result) *float64 { return &r.OneRegionRatio },
	func(r *Result) *float64 { return &r.StageD2DGBps },
	func(r *Result) *float64 { return &r.CopyD2DGBps },
	func(r *Result) *float64 { return &r.StageD2DRatio },
	func(r *Result) *float64 { return &r.PingP50 },
	func(r *Result) *float64 { return &r.PingRatio },
	func(r *Result) *float64 { return &r.DonePingRatio },
}

// render prints and writes the results of a previous run's JSON file.
func render(cfg *config, stdout io.Writer) error {
	b, err := os.ReadFile(cfg.from)
	if err != nil {
		return err
	}
	var doc struct {
		Run     runInfo  `json:"run"`
		Results []Result `json:"results"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		return fmt.Errorf("%s: %w", cfg.from, err)
	}
	writeTable(stdout, doc.Results, doc.Run)
	for _, o := range cfg.outputs {
		if err := writeFile(o, doc.Results, doc.Run); err != nil {
			return err
		}
	}
	if cfg.chart != "" {
		if err := drawChart(cfg.chart, doc.Results, doc.Run); err != nil {
			return fmt.Errorf("chart %s: %w", cfg.chart, err)
		}
	}
	return nil
}
