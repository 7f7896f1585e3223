//go:build !unix

package devmem

import (
	"errors"
	"runtime"
)

func pageSize() int { return 4096 }

func mapMem(int, bool) ([]byte, error) {
	return nil, errors.New("the simulator maps memory on unix systems only, not on " + runtime.GOOS)
}

func unmapMem([]byte) error { return nil }
