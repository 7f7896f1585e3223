package testproc

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const childEnv = "GOXFER_TESTPROC_CHILD"

type request struct {
	Cmd  string `json:"cmd"`
	Text string `json:"text,omitempty"`
}

func (r request) Name() string { return r.Cmd }

type response struct {
	Text string `json:"text,omitempty"`
	Err  string `json:"err,omitempty"`
}

func bad(err error) response { return response{Err: err.Error()} }

// handle answers echo (Text back), env (the value of the variable named
// Text), stderr (writes Text to stderr) and exit (the last answer).
func handle(req request) (response, bool) {
	switch req.Cmd {
	case "echo":
		return response{Text: req.Text}, false
	case "env":
		return response{Text: os.Getenv(req.Text)}, false
	case "stderr":
		fmt.Fprint(os.Stderr, req.Text)
		return response{}, false
	case "exit":
		return response{}, true
	}
	return bad(fmt.Errorf("unknown command %q", req.Cmd)), false
}

// helloEnv makes the test binary a Spawn child: it says hello (its pid and
// $TESTPROC_EXTRA), then echoes every JSON value it reads, until its stdin closes.
const helloEnv = "GOXFER_TESTPROC_HELLO"

type hello struct {
	Pid   int
	Extra string
}

func helloChild() {
	enc, dec := json.NewEncoder(os.Stdout), json.NewDecoder(os.Stdin)
	if err := enc.Encode(hello{Pid: os.Getpid(), Extra: os.Getenv("TESTPROC_EXTRA")}); err != nil {
		os.Exit(2)
	}
	for {
		var v any
		if dec.Decode(&v) != nil || enc.Encode(v) != nil {
			return
		}
	}
}

var shared = Shared[hello]{Env: helloEnv}

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		if err := Serve(os.Stdin, os.Stdout, handle, bad); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		os.Exit(0)
	}
	if os.Getenv(helloEnv) != "" {
		helloChild()
		os.Exit(0)
	}
	code := m.Run()
	shared.Stop()
	os.Exit(code)
}

func start(t *testing.T) *Child[request, response] {
	return Start[request, response](t, childEnv, Options{Env: []string{"TESTPROC_EXTRA=x"}, AnswerWithin: time.Minute, ExitWithin: time.Minute})
}

func TestChildAnswers(t *testing.T) {
	c := start(t)
	assert.Equal(t, response{Text: "hello"}, c.Do(request{Cmd: "echo", Text: "hello"}))
	big := strings.Repeat("x", 1<<20)
	assert.Equal(t, big, c.Do(request{Cmd: "echo", Text: big}).Text, "a 1 MiB line")
	assert.Equal(t, "1", c.Do(request{Cmd: "env", Text: childEnv}).Text)
	assert.Equal(t, "x", c.Do(request{Cmd: "env", Text: "TESTPROC_EXTRA"}).Text)
	assert.Equal(t, `unknown command "nope"`, c.Do(request{Cmd: "nope"}).Err)
	c.Do(request{Cmd: "stderr", Text: "to stderr"})
	assert.Eventually(t, func() bool { return c.Stderr() == "to stderr" }, time.Minute, time.Millisecond)
}

func TestChildKilled(t *testing.T) {
	c := start(t)
	c.Do(request{Cmd: "echo"})
	c.Kill()
	// The child's exit by SIGKILL does not fail the test.
}

func TestChildSignalled(t *testing.T) {
	c := start(t)
	require.NoError(t, c.Signal(os.Interrupt))
	// Nor does its exit by a signal it was sent.
}

func TestServe(t *testing.T) {
	in := strings.NewReader("{\"cmd\":\"echo\",\"text\":\"a\"}\nnot json\n{\"cmd\":\"exit\"}\n{\"cmd\":\"echo\",\"text\":\"unread\"}\n")
	var out bytes.Buffer
	require.NoError(t, Serve(in, &out, handle, bad))
	dec := json.NewDecoder(&out)
	var got []response
	for dec.More() {
		var r response
		require.NoError(t, dec.Decode(&r))
		got = append(got, r)
	}
	require.Len(t, got, 3, "the answers up to exit's")
	assert.Equal(t, response{Text: "a"}, got[0])
	assert.True(t, strings.HasPrefix(got[1].Err, "bad request: "), "got %q", got[1].Err)
	assert.Equal(t, response{}, got[2])
}

func TestServeStopsAtEndOfInput(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, Serve(strings.NewReader(`{"cmd":"echo","text":"a"}`), &out, handle, bad))
	assert.Equal(t, "{\"text\":\"a\"}\n", out.String())
}

type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("broken pipe") }

func TestServeReportsWriteErrors(t *testing.T) {
	err := Serve(strings.NewReader("{\"cmd\":\"echo\"}\n"), failingWriter{}, handle, bad)
	require.ErrorContains(t, err, "write response: broken pipe")
}

func TestSpawn(t *testing.T) {
	var h hello
	p := Spawn(t, helloEnv, &h, func(cmd *exec.Cmd) { cmd.Env = append(cmd.Env, "TESTPROC_EXTRA=y") })
	assert.NotZero(t, h.Pid)
	assert.NotEqual(t, os.Getpid(), h.Pid)
	assert.Equal(t, "y", h.Extra, "attr adjusts the command")
	require.NoError(t, json.NewEncoder(p.Stdin).Encode(request{Cmd: "echo", Text: "hi"}))
	var got request
	require.NoError(t, p.Stdout.Decode(&got))
	assert.Equal(t, request{Cmd: "echo", Text: "hi"}, got)
	require.NoError(t, p.Stop(), "stderr: %s", p.Stderr())
}

func TestShared(t *testing.T) {
	first := shared.Hello(t)
	assert.NotZero(t, first.Pid)
	assert.Equal(t, first, shared.Hello(t), "one child for every use")
}

func TestBuffer(t *testing.T) {
	var b Buffer
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 100 {
				_, _ = b.Write([]byte("x"))
				_ = b.String()
			}
		})
	}
	wg.Wait()
	assert.Equal(t, strings.Repeat("x", 400), b.String())
}
