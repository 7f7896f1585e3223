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
}

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

// setRatios sets each goxfer row's ratio to its backend's baseline for the
// same operation and bytes, measured in the same run.
func setRatios(rs []Result) {
	base := map[string]string{}
	for _, b := range builtBackends() {
		base[b.name] = b.baseline
	}
	for i := range rs {
		r := &rs[i]
		name := strings.TrimSuffix(r.Name, heapSuffix)
		if r.Kind != "goxfer" || base[name] == "" {
			continue
		}
		want := []string{base[name]}
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
	fmt.Fprintln(w, "GB/s = 10^9 B/s; p50/p99: Begin to the active Wait; done: Begin to the target's passive Wait (same host only); ratio: GB/s over the baseline's, same run")
	if ri.Runs > 1 {
		fmt.Fprintf(w, "every figure is the median of %d runs; ratios are medians of each run's own ratio\n", ri.Runs)
	}
	if ri.Check {
		fmt.Fprintln(w, "-check: every byte verified; timings include the verification and are not meaningful")
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "backend\top\tblock\tdescs\tin flight\tGB/s\tops/s\tp50 µs\tp99 µs\tdone p50 µs\tdone p99 µs\tbaseline\tbase GB/s\tratio\t  note")
	for _, r := range rs {
		if r.Kind == "control" || r.Op == "PINGPONG" {
			continue
		}
		name := r.Name
		if r.Kind != "goxfer" {
			name = "· " + name
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t  %s\n",
			name, r.Op, fmtSize(float64(r.Block)), r.Descs, intOrBlank(r.Inflight),
			fmtF(r.GBps, 2), fmtOps(r.OpsPerSec), fmtF(r.P50, 1), fmtF(r.P99, 1), fmtF(r.DoneP50, 1), fmtF(r.DoneP99, 1),
			r.Baseline, fmtF(r.BaseGBps, 2), fmtF(r.Ratio, 2), r.Note)
	}
	_ = tw.Flush()

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
		fmt.Fprintln(tw, "what\top\tdescs\tp50 µs\tp99 µs\t  note")
		for _, r := range lat {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t  %s\n", r.Name, r.Op, r.Descs, fmtF(r.P50, 1), fmtF(r.P99, 1), r.Note)
		}
		_ = tw.Flush()
	}
	for _, n := range ri.Notes {
		fmt.Fprintln(w, "note:", n)
	}
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
	"p50_us", "p99_us", "done_p50_us", "done_p99_us", "baseline", "baseline_gbps", "ratio", "in_process", "checked", "note"}

func writeCSV(w io.Writer, rs []Result) error {
	cw := csv.NewWriter(w)
	_ = cw.Write(csvHeader)
	f := func(v float64) string { return strconv.FormatFloat(v, 'g', 6, 64) }
	for _, r := range rs {
		_ = cw.Write([]string{r.Kind, r.Name, r.Op, r.Shape, strconv.Itoa(r.Block), strconv.Itoa(r.Descs), strconv.FormatInt(r.Bytes, 10),
			strconv.Itoa(r.Inflight), strconv.Itoa(r.Iters), f(r.GBps), f(r.OpsPerSec), f(r.P50), f(r.P99), f(r.DoneP50), f(r.DoneP99),
			r.Baseline, f(r.BaseGBps), f(r.Ratio), strconv.FormatBool(r.InProcess), strconv.FormatBool(r.Checked), r.Note})
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
		kind, name, op, shape  string
		block, descs, inflight int
	}
	keyOf := func(r Result) key { return key{r.Kind, r.Name, r.Op, r.Shape, r.Block, r.Descs, r.Inflight} }
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
		for _, o := range rs {
			if o.Baseline != m.Baseline {
				m.Baseline = baseTCP // the better of ×1 and ×4 varied between runs
			}
		}
		out = append(out, m)
	}
	return out
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
