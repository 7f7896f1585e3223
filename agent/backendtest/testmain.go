package backendtest

import (
	"testing"

	"go.uber.org/goleak"
)

// MainAfter is [Main] for a package with fixtures its tests or benchmarks
// share: after runs once they have, before the check for leaked goroutines
// (it stops a shared child process, say). A package with child processes
// of its own turns into them before it calls MainAfter.
func MainAfter(m *testing.M, f Factory, after func(), opts ...goleak.Option) {
	Child(f)
	goleak.VerifyTestMain(runThen{m, after}, opts...)
}

// runThen runs the tests, then after.
type runThen struct {
	m     *testing.M
	after func()
}

func (r runThen) Run() int {
	code := r.m.Run()
	r.after()
	return code
}
