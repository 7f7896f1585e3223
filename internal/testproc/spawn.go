package testproc

import (
	"bufio"
	"encoding/json"
	"io"
	"os/exec"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// Proc is a re-execution of the test binary that runs one of the
// package's own servers (a benchmark target, a peer running as another
// user). Unlike a [Child] it speaks whatever protocol the package likes:
// it begins with a hello, one JSON value on its stdout, and runs until
// [Proc.Stop] closes its stdin. It does not end with the test that started
// it.
type Proc struct {
	// Stdin is the child's standard input.
	Stdin io.WriteCloser
	// Stdout decodes the JSON values the child writes after its hello.
	Stdout *json.Decoder
	cmd    *exec.Cmd
	stderr Buffer
}

// Spawn re-executes the test binary, running no tests or benchmarks, with
// env=1 added to its environment, and decodes the child's hello into
// hello. attr, if not nil, adjusts the command first (another path to the
// binary, other credentials). Spawn fails t, killing the child, if it does
// not start or print its hello.
func Spawn(t testing.TB, env string, hello any, attr func(*exec.Cmd)) *Proc {
	t.Helper()
	p := &Proc{cmd: command(env, "-test.run=^$", "-test.bench=^$")}
	p.cmd.Stderr = &p.stderr
	if attr != nil {
		attr(p.cmd)
	}
	var stdout io.Reader
	p.Stdin, stdout = startPiped(t, p.cmd)
	p.Stdout = json.NewDecoder(bufio.NewReader(stdout))
	if err := p.Stdout.Decode(hello); err != nil {
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
		t.Fatalf("child hello: %v; stderr:\n%s", err, p.stderr.String())
	}
	return p
}

// Stop closes the child's stdin and waits for it to exit; it returns the
// error of its exit, if any.
func (p *Proc) Stop() error {
	_ = p.Stdin.Close()
	return p.cmd.Wait()
}

// Stderr returns what the child has written to its stderr so far.
func (p *Proc) Stderr() string { return p.stderr.String() }

// Shared is a [Proc] spawned on first use for all the tests or benchmarks
// of a test binary that use it, and stopped by TestMain once they ran. Set
// Env, the variable that makes the test binary that child. Safe for
// concurrent use.
type Shared[Hello any] struct {
	Env   string
	once  sync.Once
	p     *Proc
	hello Hello
}

// Hello spawns the child on first use and returns its hello. It fails t if
// the child did not start, then or on first use.
func (s *Shared[Hello]) Hello(t testing.TB) Hello {
	t.Helper()
	s.once.Do(func() { s.p = Spawn(t, s.Env, &s.hello, nil) })
	require.NotNil(t, s.p, "the shared child process failed to start")
	return s.hello
}

// Stop stops the child, if it was started, however it exits.
func (s *Shared[Hello]) Stop() {
	if s.p != nil {
		_ = s.p.Stop()
	}
}
