package soak

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"
)

// tally adds up the outcomes of a run's operations; safe for concurrent
// use.
type tally struct {
	mu sync.Mutex
	tallied
}

type tallied struct {
	ops, failed, corrupt  int
	corruptDescs, guards  int
	byKind, byBackend     map[string]int
	byPath                map[string]int
	descs, minDescs, maxD int
	bytes                 int64
	largestDesc           int
	descBuckets           [5]int // 1, 2-15, 16-255, 256-4095, 4096
	peakInFlight          int
	first                 []string
}

func newTally() *tally {
	t := &tally{}
	t.tallied = freshTally()
	return t
}

func freshTally() tallied {
	return tallied{byKind: map[string]int{}, byBackend: map[string]int{}, byPath: map[string]int{}, minDescs: maxDescs + 1}
}

// add counts o and reports whether anything went wrong with it.
func (t *tally) add(o outcome) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := o.spec
	t.ops++
	t.byKind[s.label()]++
	t.byBackend[o.backend]++
	t.byPath[o.path]++
	n := len(s.Sizes)
	t.descs += n
	t.minDescs, t.maxD = min(t.minDescs, n), max(t.maxD, n)
	switch {
	case n == 1:
		t.descBuckets[0]++
	case n < 16:
		t.descBuckets[1]++
	case n < 256:
		t.descBuckets[2]++
	case n < maxDescs:
		t.descBuckets[3]++
	default:
		t.descBuckets[4]++
	}
	t.bytes += s.bytes()
	t.largestDesc = max(t.largestDesc, slices.Max(s.Sizes))
	bad := false
	for _, sd := range []side{o.parent, o.child} {
		t.corruptDescs += sd.Damage.Descs
		t.guards += sd.Damage.Guards
		if sd.Damage.count() > 0 {
			bad = true
		}
	}
	if bad {
		t.corrupt++
	}
	if len(o.parent.Errs)+len(o.child.Errs) > 0 {
		t.failed++
		bad = true
	}
	for _, p := range o.problems() {
		if len(t.first) < 2*keepFirst {
			t.first = append(t.first, p)
		}
	}
	return bad
}

func (t *tally) inFlight(n int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.peakInFlight = max(t.peakInFlight, n)
}

// problems is how many operations went wrong.
func (t *tally) problems() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.failed + t.corrupt
}

// done is how many operations were counted.
func (t *tally) done() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ops
}

// reset returns the counts so far and starts again.
func (t *tally) reset() tallied {
	t.mu.Lock()
	defer t.mu.Unlock()
	old := t.tallied
	t.tallied = freshTally()
	return old
}

// report is one backend's soak, as the test logs it and writes it as JSON.
type report struct {
	Backend   string `json:"backend"`
	Mode      string `json:"mode"`
	Race      bool   `json:"race"` // RSS is then reported, not checked (see raceEnabled)
	Seed      uint64 `json:"seed"`
	WarmupOps int    `json:"warmup_ops"`
	InFlight  int    `json:"in_flight"`

	Ops          int            `json:"ops"`
	PeakInFlight int            `json:"peak_in_flight"`
	ByKind       map[string]int `json:"by_kind"`
	ByBackend    map[string]int `json:"by_backend"`
	ByPath       map[string]int `json:"by_path"`
	Descriptors  int            `json:"descriptors"`
	MinDescs     int            `json:"min_descriptors"`
	MaxDescs     int            `json:"max_descriptors"`
	// DescBuckets counts operations by descriptor count: 1, 2-15, 16-255,
	// 256-4095, 4096.
	DescBuckets [5]int `json:"ops_by_descriptors"`
	Bytes       int64  `json:"bytes"`
	LargestDesc int    `json:"largest_descriptor"`

	Corruptions  int      `json:"corruptions"` // descriptors and guards damaged
	CorruptDescs int      `json:"corrupt_descriptors"`
	CorruptGuard int      `json:"corrupt_guards"`
	CorruptOps   int      `json:"corrupt_ops"`
	Failures     int      `json:"failed_ops"`
	Problems     []string `json:"problems,omitempty"`

	WallSeconds float64 `json:"wall_seconds"`
	OpsPerSec   float64 `json:"ops_per_second"`
	MBPerSec    float64 `json:"mb_per_second"` // 10^6 bytes moved per second

	Parent flatness `json:"parent"`
	Child  flatness `json:"child"`
}

// flatness is one process's resources over the soak. Start, Q1, Mid, Q3
// and End are quiescent samples: after the warm-up, after each quarter of
// the operations. Peak is the most seen at any sample, quiescent or in
// flight.
type flatness struct {
	Start  sample `json:"start"`
	Q1     sample `json:"q1"`
	Mid    sample `json:"mid"`
	Q3     sample `json:"q3"`
	End    sample `json:"end"`
	Peak   peaks  `json:"peak"`
	Counts counts `json:"counts"`
	// The parent's goroutines before the soak started anything and once it
	// closed everything (the NATS server, the Connector, the child).
	GoroutinesBefore int `json:"goroutines_before,omitempty"`
	GoroutinesClosed int `json:"goroutines_closed,omitempty"`
}

func (r *report) fill(t *tally, wall time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r.Ops, r.PeakInFlight = t.ops, t.peakInFlight
	r.ByKind, r.ByBackend, r.ByPath = maps.Clone(t.byKind), maps.Clone(t.byBackend), maps.Clone(t.byPath)
	r.Descriptors, r.MinDescs, r.MaxDescs, r.DescBuckets = t.descs, t.minDescs, t.maxD, t.descBuckets
	r.Bytes, r.LargestDesc = t.bytes, t.largestDesc
	r.CorruptDescs, r.CorruptGuard, r.CorruptOps = t.corruptDescs, t.guards, t.corrupt
	r.Corruptions = t.corruptDescs + t.guards
	r.Failures = t.failed
	r.Problems = slices.Clone(t.first)
	r.WallSeconds = wall.Seconds()
	r.OpsPerSec = float64(t.ops) / wall.Seconds()
	r.MBPerSec = float64(t.bytes) / 1e6 / wall.Seconds()
}

func mib(n int64) string {
	if n < 0 {
		return "?"
	}
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}

// String renders the report for the test log.
func (r *report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "soak over %s (%s): %d operations (+%d warm-up), %d in flight (peak %d), seed %d\n",
		r.Backend, r.Mode, r.Ops, r.WarmupOps, r.InFlight, r.PeakInFlight, r.Seed)
	fmt.Fprintf(&b, "  by kind:      %s\n", counted(r.ByKind))
	fmt.Fprintf(&b, "  by backend:   %s\n", counted(r.ByBackend))
	fmt.Fprintf(&b, "  by path:      %s\n", counted(r.ByPath))
	fmt.Fprintf(&b, "  descriptors:  %d (%d to %d per operation; operations with 1: %d, 2-15: %d, 16-255: %d, 256-4095: %d, 4096: %d)\n",
		r.Descriptors, r.MinDescs, r.MaxDescs, r.DescBuckets[0], r.DescBuckets[1], r.DescBuckets[2], r.DescBuckets[3], r.DescBuckets[4])
	fmt.Fprintf(&b, "  bytes moved:  %d (%.2f GB), largest descriptor %d B\n", r.Bytes, float64(r.Bytes)/1e9, r.LargestDesc)
	fmt.Fprintf(&b, "  corruptions:  %d (%d descriptors, %d guards, in %d operations); failed operations: %d\n",
		r.Corruptions, r.CorruptDescs, r.CorruptGuard, r.CorruptOps, r.Failures)
	for _, p := range r.Problems {
		fmt.Fprintf(&b, "    %s\n", p)
	}
	fmt.Fprintf(&b, "  wall:         %.1f s, %.0f ops/s, %.0f MB/s\n", r.WallSeconds, r.OpsPerSec, r.MBPerSec)
	for _, p := range []struct {
		name string
		f    flatness
	}{{"parent", r.Parent}, {"child", r.Child}} {
		f := p.f
		fmt.Fprintf(&b, "  %-6s RSS         start %s, q1 %s, mid %s, q3 %s, end %s; peak %s\n", p.name, mib(f.Start.RSS), mib(f.Q1.RSS), mib(f.Mid.RSS), mib(f.Q3.RSS), mib(f.End.RSS), mib(f.Peak.RSS))
		fmt.Fprintf(&b, "  %-6s RSS anon    start %s, mid %s, end %s; file %s, %s, %s\n", p.name, mib(f.Start.RSSAnon), mib(f.Mid.RSSAnon), mib(f.End.RSSAnon), mib(f.Start.RSSFile), mib(f.Mid.RSSFile), mib(f.End.RSSFile))
		fmt.Fprintf(&b, "  %-6s RSS shmem   start %s, mid %s, end %s; at rest segments mapped %d, %d, %d, lease tables mapped %d, %d, %d\n", p.name,
			mib(f.Start.RSSShmem), mib(f.Mid.RSSShmem), mib(f.End.RSSShmem),
			f.Start.Shm.Segments, f.Mid.Shm.Segments, f.End.Shm.Segments, f.Start.Shm.Tables, f.Mid.Shm.Tables, f.End.Shm.Tables)
		fmt.Fprintf(&b, "  %-6s goroutines  start %d, mid %d, peak %d, end %d\n", p.name, f.Start.Goroutines, f.Mid.Goroutines, f.Peak.Goroutines, f.End.Goroutines)
		fmt.Fprintf(&b, "  %-6s threads     start %d, mid %d, peak %d, end %d\n", p.name, f.Start.Threads, f.Mid.Threads, f.Peak.Threads, f.End.Threads)
		fmt.Fprintf(&b, "  %-6s live heap   start %s, q1 %s, mid %s, q3 %s, end %s\n", p.name, mib(int64(f.Start.HeapAlloc)), mib(int64(f.Q1.HeapAlloc)), mib(int64(f.Mid.HeapAlloc)), mib(int64(f.Q3.HeapAlloc)), mib(int64(f.End.HeapAlloc)))
		fmt.Fprintf(&b, "  %-6s heap in use start %s, mid %s, end %s; stacks %s, %s, %s; runtime other %s, %s, %s\n", p.name,
			mib(int64(f.Start.HeapInuse)), mib(int64(f.Mid.HeapInuse)), mib(int64(f.End.HeapInuse)),
			mib(int64(f.Start.StackInuse)), mib(int64(f.Mid.StackInuse)), mib(int64(f.End.StackInuse)),
			mib(int64(f.Start.Other)), mib(int64(f.Mid.Other)), mib(int64(f.End.Other)))
		fmt.Fprintf(&b, "  %-6s operations  passive %d created, %d closed; active %d begun, %d awaited\n", p.name, f.Counts.Created, f.Counts.Closed, f.Counts.Begun, f.Counts.Waited)
	}
	fmt.Fprintf(&b, "  parent goroutines before the soak %d, once all closed %d", r.Parent.GoroutinesBefore, r.Parent.GoroutinesClosed)
	if r.Race {
		b.WriteString("\n  (race detector on: RSS includes its shadow memory and is not checked)")
	}
	return b.String()
}

func counted(m map[string]int) string {
	keys := slices.Sorted(maps.Keys(m))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return strings.Join(parts, ", ")
}
