//go:build !linux

package main

import (
	"errors"
	"time"
	"unsafe"
)

var start = time.Now()

// monoNow is only comparable within a process here (bootID is empty).
func monoNow() int64 { return time.Since(start).Nanoseconds() }

func bootID() string { return "" }

func memAvailable() uint64 { return 0 }

func sliceAddr(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&b[0])))
}

const havePVM = false

func pvmCopy(int, bool, []byte, uint64) error {
	return errors.New("process_vm_readv needs Linux")
}
