// Package retry reruns a fault test's attempt to interrupt a transfer in
// flight until one catches it: a transfer may finish before the fault hits.
package retry

import (
	"fmt"
	"testing"
)

// Until runs f, each time in a subtest of its own (attempt1, attempt2, …),
// so that the processes and memory of an attempt are gone before the next,
// until f reports that it interrupted a transfer in flight or a subtest
// fails. After attempts misses it fails t.
func Until(t *testing.T, attempts int, f func(t *testing.T) bool) {
	t.Helper()
	for i := 1; i <= attempts; i++ {
		var hit bool
		if !t.Run(fmt.Sprintf("attempt%d", i), func(t *testing.T) { hit = f(t) }) {
			return
		}
		if hit {
			return
		}
	}
	t.Fatalf("no transfer was still in flight when interrupted, in %d attempts", attempts)
}
