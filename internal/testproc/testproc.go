// Package testproc runs a test binary's own re-execution as a child process
// that serves requests: the parent writes one JSON request a line to the
// child's stdin and reads one JSON answer a line from its stdout.
//
// The parent side is [Start], which returns a [Child]; the child side is
// [Serve], called from TestMain when the environment variable named in
// Start is set. [Spawn] starts a child that speaks a protocol of its own
// after a JSON hello, and [Shared] one such child for a whole test binary.
package testproc

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Lines in either direction may be up to 64 MiB long.
const maxLine = 64 << 20

// Request is what a parent sends a child; Name names the request in
// failure messages.
type Request interface{ Name() string }

// Options says how to run a child process.
type Options struct {
	// Env is added to the child's environment, after os.Environ() and the
	// variable that makes it a child.
	Env []string
	// AnswerWithin bounds how long Do waits for an answer: a child that
	// takes longer is killed and fails the test. Default: 1 minute.
	AnswerWithin time.Duration
	// ExitWithin bounds how long the child may take to exit once its stdin
	// closes at the end of the test: one that takes longer is killed and
	// fails the test. Default: 1 minute.
	ExitWithin time.Duration
}

// Child is the parent's handle on a child process that answers requests of
// type Req with answers of type Resp. A Child belongs to the goroutine of
// the test that started it.
type Child[Req Request, Resp any] struct {
	t      *testing.T
	opts   Options
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan []byte
	quit   chan struct{}
	eof    chan struct{}
	stderr Buffer
	killed bool // the child may exit with an error
}

// Start re-executes the test binary, running no tests, with env=1 added to
// its environment, so that its TestMain calls Serve. The child ends when
// the test does: its stdin closes, and a child that does not then exit
// within opts.ExitWithin, or exits with an error it was not sent a signal
// for, fails the test. Its stderr is logged if the test failed.
func Start[Req Request, Resp any](t *testing.T, env string, opts Options) *Child[Req, Resp] {
	t.Helper()
	if opts.AnswerWithin <= 0 {
		opts.AnswerWithin = time.Minute
	}
	if opts.ExitWithin <= 0 {
		opts.ExitWithin = time.Minute
	}
	c := &Child[Req, Resp]{t: t, opts: opts, lines: make(chan []byte), quit: make(chan struct{}), eof: make(chan struct{})}
	c.cmd = command(env, "-test.run=^$")
	c.cmd.Env = append(c.cmd.Env, opts.Env...)
	c.cmd.Stderr = &c.stderr
	var stdout io.Reader
	c.stdin, stdout = startPiped(t, c.cmd)
	go c.read(stdout)
	t.Cleanup(c.stop)
	return c
}

// command re-executes the test binary with args and env=1 added to its
// environment.
func command(env string, args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), env+"=1")
	return cmd
}

// startPiped starts cmd and returns pipes to its stdin and from its stdout.
func startPiped(t testing.TB, cmd *exec.Cmd) (io.WriteCloser, io.Reader) {
	t.Helper()
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start(), "start child process")
	return stdin, stdout
}

func (c *Child[Req, Resp]) read(stdout io.Reader) {
	defer close(c.eof)
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 64<<10), maxLine)
	for sc.Scan() {
		select {
		case c.lines <- slices.Clone(sc.Bytes()):
		case <-c.quit:
		}
	}
}

// stop ends the child: it closes stdin so the child exits, or kills it if
// it does not.
func (c *Child[Req, Resp]) stop() {
	close(c.quit)
	_ = c.stdin.Close()
	select {
	case <-c.eof:
	case <-time.After(c.opts.ExitWithin):
		c.t.Errorf("child process did not exit within %v of its stdin closing; killing it", c.opts.ExitWithin)
		c.Kill()
		<-c.eof
	}
	if err := c.cmd.Wait(); err != nil && !c.killed {
		c.t.Errorf("child process: %v", err)
	}
	if c.t.Failed() {
		c.t.Logf("child process stderr:\n%s", c.stderr.String())
	}
}

// Kill kills the child with SIGKILL: no goodbye, no cleanup.
func (c *Child[Req, Resp]) Kill() {
	c.killed = true
	_ = c.cmd.Process.Kill()
}

// Signal sends sig to the child. From then on the child may exit with an
// error without failing the test.
func (c *Child[Req, Resp]) Signal(sig os.Signal) error {
	c.killed = true
	return c.cmd.Process.Signal(sig)
}

// Stderr returns what the child has written to its stderr so far.
func (c *Child[Req, Resp]) Stderr() string { return c.stderr.String() }

// Do sends req to the child and returns its answer. It fails the test if
// the child exits first or does not answer within Options.AnswerWithin (and
// then kills it).
func (c *Child[Req, Resp]) Do(req Req) Resp {
	c.t.Helper()
	line, err := json.Marshal(req)
	require.NoError(c.t, err)
	if _, err := c.stdin.Write(append(line, '\n')); err != nil {
		c.t.Fatalf("child %s: %v\nstderr:\n%s", req.Name(), err, c.stderr.String())
	}
	var resp Resp
	select {
	case l := <-c.lines:
		require.NoError(c.t, json.Unmarshal(l, &resp), "child answered %q", l)
	case <-c.eof:
		c.t.Fatalf("child %s: child exited\nstderr:\n%s", req.Name(), c.stderr.String())
	case <-time.After(c.opts.AnswerWithin):
		c.Kill()
		c.t.Fatalf("child %s: no answer within %v", req.Name(), c.opts.AnswerWithin)
	}
	return resp
}

// Serve is the child side: it decodes each line of in as a Req and writes
// handle's answer to it as one JSON line to out, until in ends or handle
// says the answer is the last. A line that is no Req is answered with
// bad(err). Serve returns the error that stopped it reading in or writing
// out, if any.
func Serve[Req, Resp any](in io.Reader, out io.Writer, handle func(Req) (resp Resp, last bool), bad func(error) Resp) error {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 64<<10), maxLine)
	enc := json.NewEncoder(out)
	for sc.Scan() {
		var (
			req  Req
			resp Resp
			last bool
		)
		if err := json.Unmarshal(sc.Bytes(), &req); err != nil {
			resp = bad(fmt.Errorf("bad request: %w", err))
		} else {
			resp, last = handle(req)
		}
		if err := enc.Encode(resp); err != nil {
			return fmt.Errorf("write response: %w", err)
		}
		if last {
			return nil
		}
	}
	return sc.Err()
}

// Buffer collects what is written to it, a child's stderr or a logger's
// output, for reading while writes go on. The zero value is empty and
// ready. Safe for concurrent use.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (l *Buffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything written so far.
func (l *Buffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
