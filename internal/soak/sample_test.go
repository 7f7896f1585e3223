package soak

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"time"
)

// sample is one process's resource use at one moment.
type sample struct {
	RSS        int64  `json:"rss"`        // resident bytes (VmRSS); -1 where unknown
	RSSAnon    int64  `json:"rss_anon"`   // of which anonymous memory (RssAnon): heap, stacks
	RSSFile    int64  `json:"rss_file"`   // of which file pages (RssFile): the binary's code and data
	RSSShmem   int64  `json:"rss_shmem"`  // of which shared memory (RssShmem): segments and lease tables
	Shm        shmUse `json:"shm"`        // goxfer's shared memory this process maps and holds open
	Threads    int    `json:"threads"`    // OS threads; -1 where unknown
	Goroutines int    `json:"goroutines"` // runtime.NumGoroutine
	HeapAlloc  uint64 `json:"heap_alloc"` // live heap bytes, right after a GC
	// What the Go runtime holds from the OS, to tell RSS growth of the heap
	// (HeapInuse, spans with any live object: fragmentation) from that of
	// stacks or the runtime's own structures (Other: span, GC and other
	// metadata).
	HeapInuse  uint64 `json:"heap_inuse"`
	StackInuse uint64 `json:"stack_inuse"`
	Other      uint64 `json:"runtime_other"`
}

// status reads VmRSS and Threads from /proc/<pid>/status ("self" for this
// process). It fails where there is no /proc (not Linux).
func status(pid string) (rss int64, threads int, err error) {
	st, err := readStatus(pid)
	return st["VmRSS"], int(st["Threads"]), err
}

// readStatus returns the numeric fields of /proc/<pid>/status, sizes in
// bytes.
func readStatus(pid string) (map[string]int64, error) {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return map[string]int64{"VmRSS": -1, "Threads": -1, "RssAnon": -1, "RssFile": -1, "RssShmem": -1}, err
	}
	st := make(map[string]int64)
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := bytes.Cut(sc.Bytes(), []byte(":"))
		if !ok {
			continue
		}
		f := bytes.Fields(v)
		if len(f) == 0 {
			continue
		}
		n, err := strconv.ParseInt(string(f[0]), 10, 64)
		if err != nil {
			continue
		}
		if len(f) > 1 && string(f[1]) == "kB" {
			n <<= 10
		}
		st[string(k)] = n
	}
	if _, ok := st["VmRSS"]; !ok {
		return st, fmt.Errorf("/proc/%s/status: no VmRSS", pid)
	}
	return st, nil
}

// settle is how long a quiet process is left before a quiescent sample, so
// that goroutines on their way out (a handler that has just answered) are
// gone.
const settle = 250 * time.Millisecond

// quiescent samples this process at rest: after a GC that returns free
// memory to the OS, so that RSS shows what is live rather than the heap's
// high-water mark, and a brief settle. With profile not "", it also writes
// a heap profile there, to tell what grew between two samples
// (go tool pprof -diff_base).
func quiescent(profile string) (sample, error) {
	runtime.GC()
	debug.FreeOSMemory()
	time.Sleep(settle)
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	s := sample{
		Goroutines: runtime.NumGoroutine(), HeapAlloc: ms.HeapAlloc,
		HeapInuse: ms.HeapInuse, StackInuse: ms.StackInuse,
		Other: ms.MSpanInuse + ms.MCacheInuse + ms.BuckHashSys + ms.GCSys + ms.OtherSys,
	}
	st, _ := readStatus("self")
	s.RSS, s.RSSAnon, s.RSSFile, s.Threads = st["VmRSS"], st["RssAnon"], st["RssFile"], int(st["Threads"])
	s.RSSShmem = st["RssShmem"]
	s.Shm, _, _ = readShmUse()
	if profile == "" {
		return s, nil
	}
	f, err := os.Create(profile)
	if err != nil {
		return s, err
	}
	err = pprof.Lookup("heap").WriteTo(f, 0)
	return s, errors.Join(err, f.Close())
}

// peaks is the most a process used while sampled.
type peaks struct {
	RSS        int64 `json:"rss"`
	Threads    int   `json:"threads"`
	Goroutines int   `json:"goroutines"`
	Samples    int   `json:"samples"`
}

func (p *peaks) add(rss int64, threads, goroutines int) {
	p.RSS = max(p.RSS, rss)
	p.Threads = max(p.Threads, threads)
	p.Goroutines = max(p.Goroutines, goroutines)
	p.Samples++
}

// sampler records the peak RSS, threads and goroutines of this process (and
// the RSS of another, other, when it is not 0) every period until stop.
type sampler struct {
	stopc chan struct{}
	done  chan struct{}

	mu          sync.Mutex
	self, other peaks
}

func startSampler(period time.Duration, other int) *sampler {
	s := &sampler{stopc: make(chan struct{}), done: make(chan struct{})}
	s.take(other)
	go func() {
		defer close(s.done)
		tick := time.NewTicker(period)
		defer tick.Stop()
		for {
			select {
			case <-tick.C:
				s.take(other)
			case <-s.stopc:
				return
			}
		}
	}()
	return s
}

func (s *sampler) take(other int) {
	rss, threads, _ := status("self")
	g := runtime.NumGoroutine()
	var orss int64 = -1
	othreads := -1
	if other != 0 {
		orss, othreads, _ = status(strconv.Itoa(other))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.self.add(rss, threads, g)
	if orss >= 0 {
		s.other.add(orss, othreads, 0)
	}
}

// note counts a sample taken elsewhere (a quiescent one) in the peaks.
func (s *sampler) note(x sample) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.self.add(x.RSS, x.Threads, x.Goroutines)
}

// stop ends the sampling and returns the peaks of this process and of the
// other one.
func (s *sampler) stop() (self, other peaks) {
	close(s.stopc)
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.self, s.other
}

// shmUse is what a process holds of goxfer's shared memory (docs/shm.md):
// mappings of segments (its own, from AllocHost, and the peer's, mapped by
// cma) and of lease tables (one per cma connection that used segments), and
// file descriptors open on either. At rest, with every buffer freed, a
// process maps no segment; once its Connector is closed, nothing at all.
type shmUse struct {
	Segments int `json:"segments"`    // mappings of memfd:goxfer-shm
	Tables   int `json:"tables"`      // mappings of memfd:goxfer-leases
	SegFDs   int `json:"segment_fds"` // descriptors open on segments
	TableFDs int `json:"table_fds"`   // descriptors open on lease tables
}

func (u shmUse) zero() bool { return u == shmUse{} }

// The names shm.Alloc and cma give their memory files; the kernel shows
// them as "/memfd:NAME (deleted)".
const (
	segmentFile = "memfd:goxfer-shm"
	tableFile   = "memfd:goxfer-leases"
)

// readShmUse counts this process's mappings of goxfer's memory files
// (/proc/self/maps) and its descriptors open on them (/proc/self/fd), and
// returns the lines and links it counted, to show what was left. It fails
// where there is no /proc.
func readShmUse() (shmUse, []string, error) {
	var (
		u     shmUse
		found []string
	)
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return u, nil, err
	}
	for line := range bytes.Lines(maps) {
		switch {
		case bytes.Contains(line, []byte(segmentFile)):
			u.Segments++
		case bytes.Contains(line, []byte(tableFile)):
			u.Tables++
		default:
			continue
		}
		found = append(found, "mapped: "+string(bytes.TrimSpace(line)))
	}
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return u, found, err
	}
	for _, fd := range fds {
		// A descriptor may close between ReadDir and Readlink: skip it.
		target, err := os.Readlink("/proc/self/fd/" + fd.Name())
		if err != nil {
			continue
		}
		switch {
		case strings.Contains(target, segmentFile):
			u.SegFDs++
		case strings.Contains(target, tableFile):
			u.TableFDs++
		default:
			continue
		}
		found = append(found, fmt.Sprintf("fd %s: %s", fd.Name(), target))
	}
	return u, found, nil
}

// shmLeft waits up to closedWithin for this process to hold none of
// goxfer's shared memory (a peer's mapping goes when the peer's message,
// or the end of its connection, is handled), and returns what it still
// holds then, or "" if nothing.
func shmLeft() string {
	deadline := time.Now().Add(closedWithin)
	for {
		u, found, err := readShmUse()
		switch {
		case err != nil:
			return "" // no /proc: nothing to check
		case u.zero():
			return ""
		case time.Now().After(deadline):
			return fmt.Sprintf("%+v:\n%s", u, strings.Join(found, "\n"))
		}
		time.Sleep(10 * time.Millisecond)
	}
}
