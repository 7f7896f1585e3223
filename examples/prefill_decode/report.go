package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"text/tabwriter"
	"time"
)

// workerReport is what a worker started by the orchestrator leaves it at
// its end (-x-report), for the run's report: its figures, as JSON.
type workerReport struct {
	Name     string `json:"name"`
	Role     string `json:"role"`
	Agent    string `json:"agent"`    // its Connector's agent ID
	Requests int    `json:"requests"` // prefill: hand-offs served; decode: requests completed
	Failed   int    `json:"failed"`
	Bytes    int64  `json:"bytes"` // the KV cache those moved
	// Start and End bound the work: for a decode worker, its first
	// request sent and its last one done; for a prefill worker, its first
	// request taken and its last hand-off done. Zero if it did none.
	Start time.Time `json:"start"`
	End   time.Time `json:"end"`
}

// write writes r to path, whole or not at all: a worker killed meanwhile
// leaves no file rather than half of one. An empty path writes nothing.
func (r workerReport) write(path string) error {
	if path == "" {
		return nil
	}
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	if err := os.WriteFile(path+".tmp", b, 0o600); err != nil {
		return fmt.Errorf("write the report: %w", err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		return fmt.Errorf("write the report: %w", err)
	}
	return nil
}

// readReport reads the report a worker left in dir, if it left one.
func readReport(dir, name string) (workerReport, error) {
	var r workerReport
	b, err := os.ReadFile(filepath.Join(dir, name+".json"))
	if err != nil {
		return r, err
	}
	return r, json.Unmarshal(b, &r)
}

// printReport prints the run's throughput, per worker and in all, from the
// reports the workers left in dir. Every rate is over the same span, the
// decode workers' first request sent to their last one done, so that the
// prefill workers' rates add up to the total, and so do the decode
// workers'.
func printReport(out io.Writer, workers []*child, dir string) {
	reports := make([]*workerReport, len(workers))
	var first, last time.Time
	var total workerReport
	for i, w := range workers {
		r, err := readReport(dir, w.name)
		if err != nil {
			continue
		}
		reports[i] = &r
		if r.Role != "decode" || r.Start.IsZero() {
			continue
		}
		if first.IsZero() || r.Start.Before(first) {
			first = r.Start
		}
		if r.End.After(last) {
			last = r.End
		}
		total.Requests += r.Requests
		total.Failed += r.Failed
		total.Bytes += r.Bytes
	}
	span := last.Sub(first)
	fmt.Fprintf(out, "report: %d requests, %s of KV cache, in %v (the decode workers' first request sent → last one done): %s, %s\n",
		total.Requests, sizeString(total.Bytes), ms(span), reqRate(total.Requests, span), rate(total.Bytes, span))
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	row := func(name, agent string, r workerReport) {
		fmt.Fprintf(tw, "  %s\t%s\t%d requests\t%s\t%s\t%s", name, agent, r.Requests, reqRate(r.Requests, span), sizeString(r.Bytes), rate(r.Bytes, span))
		if r.Failed > 0 {
			fmt.Fprintf(tw, "\t%d failed", r.Failed)
		}
		fmt.Fprintln(tw)
	}
	for i, w := range workers {
		if reports[i] == nil {
			fmt.Fprintf(tw, "  %s\t\tno report: it ended with %v\n", w.name, exitString(w.err))
			continue
		}
		row(w.name, "agent "+reports[i].Agent, *reports[i])
	}
	row("total", "", total)
	_ = tw.Flush()
}

// reqRate formats a rate of requests a second.
func reqRate(n int, d time.Duration) string {
	if d <= 0 {
		return "- req/s"
	}
	return fmt.Sprintf("%.1f req/s", float64(n)/d.Seconds())
}
