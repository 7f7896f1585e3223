//go:build linux

package cma_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/internal/testproc"
)

// This package's own child processes, besides the conformance suite's: a
// benchmark target and a fallback peer. Each prints a hello line of JSON,
// then serves requests until its standard input closes.
const (
	benchChildEnv    = "GOXFER_CMA_BENCH_CHILD"
	fallbackChildEnv = "GOXFER_CMA_FALLBACK_CHILD"
)

func childMain() {
	switch {
	case os.Getenv(benchChildEnv) != "":
		benchChild()
	case os.Getenv(fallbackChildEnv) != "":
		fallbackChild()
	default:
		return
	}
	os.Exit(0)
}

func die(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		os.Exit(2)
	}
}

// exposure is one side's exposed buffer, as its peer needs it.
type exposure struct {
	Info agent.Info
	Key  agent.Key
	Addr uint64
	Size int
}

// fallbackResult is what the fallback child reports after its READs.
type fallbackResult struct {
	Backends []string
	Errs     []string
	DataOK   bool
	Log      string
}

// fallbackChild runs an agent on cma and tcp, typically as another user:
// it exposes a readable buffer (hello), then READs the parent's exposure
// twice and reports which backend moved the bytes and what it logged.
func fallbackChild() {
	var logs testproc.Buffer
	a, err := agent.New(agent.WithBackends(cma.New(), tcp.New()), agent.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	die(err)
	defer a.Close()
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i * 3)
	}
	e, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(buf)})
	die(err)
	enc := json.NewEncoder(os.Stdout)
	die(enc.Encode(exposure{Info: a.Info(), Key: e.Key(), Addr: agent.DRAM(buf).Addr, Size: len(buf)}))
	dec := json.NewDecoder(bufio.NewReader(os.Stdin))
	var peer exposure
	die(dec.Decode(&peer))
	var res fallbackResult
	res.DataOK = true
	for range 2 {
		dst := make([]byte, peer.Size)
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: peer.Info, Key: peer.Key, Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: peer.Addr, Len: uint64(peer.Size)}}}})
		if err == nil {
			<-x.Done()
			err = x.Err()
			res.Backends = append(res.Backends, x.Backend())
		}
		if err != nil {
			res.Errs = append(res.Errs, err.Error())
		}
		for i := range dst {
			if dst[i] != byte(i*5) {
				res.DataOK = false
				break
			}
		}
	}
	res.Log = logs.String()
	die(enc.Encode(res))
	_, _ = io.Copy(io.Discard, os.Stdin)
}
