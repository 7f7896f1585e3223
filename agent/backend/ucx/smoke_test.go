//go:build ucx

package ucx_test

import (
	"testing"

	"github.com/goxfer/goxfer/agent/backend/ucx"
	"github.com/goxfer/goxfer/agent/backendtest"
)

func TestSmokeReadWrite(t *testing.T) {
	a, b := backendtest.Pair(t, ucx.New, ucx.WithLeaseSize(256<<10))
	backendtest.Smoke(t, a, b, true)
}
