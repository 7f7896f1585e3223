package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// progress draws a bar on a terminal, or prints one line per point so that
// CI logs stay readable.
type progress struct {
	w      io.Writer
	mode   string // bar, lines, off
	total  int
	n      int
	label  string
	start  time.Time
	drawn  bool
	width  int
	tstart time.Time
}

func newProgress(setting string, w io.Writer, total int) *progress {
	p := &progress{w: w, total: total, start: time.Now(), width: 30}
	switch setting {
	case "off":
		p.mode = "off"
	case "on":
		p.mode = "bar"
	default:
		p.mode = "lines"
		if lw, ok := w.(*lockedWriter); ok {
			w = lw.w
		}
		if f, ok := w.(*os.File); ok {
			if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
				p.mode = "bar"
			}
		}
	}
	return p
}

func (p *progress) step(label string) {
	p.label, p.tstart = label, time.Now()
	if p.mode == "bar" {
		p.draw()
	}
}

func (p *progress) done(summary string) {
	p.n++
	switch p.mode {
	case "bar":
		p.draw()
	case "lines":
		fmt.Fprintf(p.w, "goxfer-bench: [%d/%d] %s: %s (%.1fs)\n", p.n, p.total, p.label, summary, time.Since(p.tstart).Seconds())
	}
}

func (p *progress) draw() {
	frac := 0.0
	if p.total > 0 {
		frac = float64(p.n) / float64(p.total)
	}
	full := min(int(frac*float64(p.width)), p.width)
	bar := strings.Repeat("=", full) + strings.Repeat(" ", p.width-full)
	label := p.label
	if len(label) > 50 {
		label = label[:50]
	}
	fmt.Fprintf(p.w, "\r[%s] %3d/%d %5.0fs %-50s", bar, p.n, p.total, time.Since(p.start).Seconds(), label)
	p.drawn = true
}

func (p *progress) finish() {
	if p.mode == "bar" && p.drawn {
		fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", p.width+70))
	}
}
