package nats

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/testproc"
)

// childEnv, when set, makes the test binary a child process (see TestMain)
// that joins a registry and reads from the parent: a peer that can be
// frozen with SIGSTOP, its NATS and tcp connections staying open and
// silent.
const childEnv = "GOXFER_NATS_CHILD"

// childRequest tells the child to connect to URL, join the registry in
// Bucket with Heartbeat, and begin reading Size bytes with Token; the
// answer names its agent once the read is posted.
type childRequest struct {
	URL       string
	Bucket    string
	Heartbeat time.Duration
	Token     string
	Size      int
}

func (childRequest) Name() string { return "join-and-read" }

type childResponse struct {
	Agent string
	Err   string
}

func runChild(in io.Reader, out io.Writer) int {
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx := context.Background()
	var closers []func() error
	handle := func(req childRequest) (childResponse, bool) {
		fail := func(err error) (childResponse, bool) { return childResponse{Err: err.Error()}, false }
		nc, err := nats.Connect(req.URL)
		if err != nil {
			return fail(err)
		}
		closers = append(closers, func() error { nc.Close(); return nil })
		reg, err := OpenRegistry(ctx, nc, WithBucket(req.Bucket), WithHeartbeat(req.Heartbeat), WithLogger(log))
		if err != nil {
			return fail(err)
		}
		c, err := connect.NewConnector(connect.WithLogger(log))
		if err != nil {
			return fail(err)
		}
		closers = append(closers, c.Close, reg.Close)
		if _, err := reg.Join(ctx, c); err != nil {
			return fail(err)
		}
		md, err := connect.ParseMetadata(req.Token)
		if err != nil {
			return fail(err)
		}
		rop, err := c.BeginRead(ctx, md, connect.NewDescriptor(make([]byte, req.Size)))
		if err != nil {
			return fail(err)
		}
		closers = append(closers, func() error { rop.Cancel(); return nil })
		return childResponse{Agent: c.AgentInfo().ID().String()}, false
	}
	bad := func(err error) childResponse { return childResponse{Err: err.Error()} }
	code := 0
	if err := testproc.Serve(in, out, handle, bad); err != nil {
		fmt.Fprintln(os.Stderr, "nats child:", err)
		code = 2
	}
	for i := len(closers) - 1; i >= 0; i-- {
		if err := closers[i](); err != nil {
			fmt.Fprintln(os.Stderr, "nats child: close:", err)
		}
	}
	return code
}
