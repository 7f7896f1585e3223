package tcp_test

import (
	"testing"

	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backendtest"
)

func TestSmokeReadWrite(t *testing.T) {
	a, b := backendtest.Pair(t, tcp.New)
	backendtest.Smoke(t, a, b, false)
}
