//go:build linux && (amd64 || arm64)

package devmem

// Attack test on the CUDA binding (issue 14): the out-parameters the
// driver writes through pointers that call passes as uintptr.

import (
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
)

// attack14Depth recurses d frames of about 200 bytes, then runs f: each
// depth puts f's frame at another distance from the end of the goroutine's
// stack.
//
//go:noinline
func attack14Depth(d int, f func()) byte {
	var pad [200]byte
	pad[d%len(pad)] = byte(d)
	if d > 0 {
		pad[0] += attack14Depth(d-1, f)
	} else {
		f()
	}
	return pad[(d+1)%len(pad)]
}

// TestAttack14CallOutParamSurvivesStackGrowth: every driver call with an
// out-parameter (cuDriverGetVersion, cuDeviceGetCount, cuCtxGetCurrent,
// cuMemAlloc, cuMemHostAlloc, cuStreamCreate, cuPointerGetAttributes)
// passes the address of a Go variable through call as a uintptr. Unless
// call is marked //go:uintptrescapes (purego.SyscallN's mark does not
// reach through a wrapper), the variable stays on the goroutine's stack;
// when the stack grows on the way into the C function, the runtime moves
// it and the driver writes into the old, freed stack: the variable keeps
// its zero value and another goroutine's stack may be overwritten. libc's
// time(&v) stands in for the driver: it writes v and returns the same
// value. Before f788b4a (which marked call) it failed at about 30 of the
// 600 depths.
func TestAttack14CallOutParamSurvivesStackGrowth(t *testing.T) {
	lib, err := purego.Dlopen("libc.so.6", purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		t.Skipf("no libc.so.6 to stand in for the driver: %v", err)
	}
	fn, err := purego.Dlsym(lib, "time")
	if err != nil {
		t.Skipf("libc has no time: %v", err)
	}
	var stale []int
	for d := range 600 {
		ok := make(chan bool)
		go func() {
			var good bool
			attack14Depth(d, func() {
				var v int64
				r := call(fn, uintptr(unsafe.Pointer(&v)))
				good = v != 0 && int32(v) == r
			})
			ok <- good
		}()
		if !<-ok {
			stale = append(stale, d)
		}
	}
	if len(stale) > 0 {
		t.Fatalf("the C function's write through a uintptr argument of call missed the Go variable at %d of 600 stack depths (first %d): the stack moved under the call", len(stale), stale[0])
	}
}
