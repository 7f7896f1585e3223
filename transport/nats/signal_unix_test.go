//go:build unix

package nats

import (
	"os"
	"syscall"
	"testing"
)

// stopSignal and contSignal freeze and thaw a child process: a peer whose
// connections stay open and silent.
var stopSignal, contSignal os.Signal = syscall.SIGSTOP, syscall.SIGCONT

// needStop skips a test that freezes a process where that cannot be done.
func needStop(testing.TB) {}
