package nats

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		// A cross-process test's child: serve the parent, then exit.
		os.Exit(runChild(os.Stdin, os.Stdout))
	}
	goleak.VerifyTestMain(m)
}
