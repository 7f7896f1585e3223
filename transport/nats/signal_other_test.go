//go:build !unix

package nats

import (
	"os"
	"testing"
)

// stopSignal and contSignal: no such signals here (see needStop).
var stopSignal, contSignal os.Signal

// needStop skips a test that freezes a process: this OS has no SIGSTOP.
func needStop(t testing.TB) {
	t.Helper()
	t.Skip("freezing a process needs SIGSTOP, which this OS lacks")
}
