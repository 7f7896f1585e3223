//go:build linux

package cma_test

import (
	"testing"

	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backendtest"
)

func TestSmokeReadWrite(t *testing.T) {
	a, b := backendtest.Pair(t, cma.New, cma.WithChunkSize(64<<10), cma.WithLeaseSize(256<<10))
	backendtest.Smoke(t, a, b, false)
}
