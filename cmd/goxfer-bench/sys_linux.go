package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// monoNow is CLOCK_MONOTONIC in ns: the same clock in every process of a
// boot, so the initiator can subtract the target's completion times. It
// reads the clock as time.Now does (the vDSO, no system call: a
// clock_gettime system call per timestamp cost the timed loop about a
// microsecond per operation that the baselines' loops do not pay), from
// a base taken once against the system call's CLOCK_MONOTONIC.
func monoNow() int64 { return monoBase + time.Since(monoStart).Nanoseconds() }

// monoStart and monoBase are the same instant, on Go's clock and on
// CLOCK_MONOTONIC (calibrate).
var monoStart, monoBase = calibrate()

// calibrate reads CLOCK_MONOTONIC with the system call between two
// readings of Go's monotonic clock, which is CLOCK_MONOTONIC too, and
// keeps the tightest of a few tries: the base is then off by at most half
// that bracket (well under a microsecond), and the two clocks never drift
// apart.
func calibrate() (time.Time, int64) {
	var start time.Time
	var base int64
	best := time.Duration(1<<63 - 1)
	for range 16 {
		t0 := time.Now()
		var ts unix.Timespec
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
			panic(fmt.Sprintf("clock_gettime(CLOCK_MONOTONIC): %v", err))
		}
		t1 := time.Now()
		if d := t1.Sub(t0); d < best {
			best = d
			start, base = t0.Add(d/2), ts.Nano()
		}
	}
	return start, base
}

// bootID names this boot: two processes with the same one share
// CLOCK_MONOTONIC.
func bootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return string(bytes.TrimSpace(b))
}

// memAvailable is MemAvailable from /proc/meminfo in bytes, 0 if unknown.
func memAvailable() uint64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "MemAvailable:"); ok {
			fs := strings.Fields(rest)
			if len(fs) >= 1 {
				kb, err := strconv.ParseUint(fs[0], 10, 64)
				if err == nil {
					return kb << 10
				}
			}
		}
	}
	return 0
}

func sliceAddr(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&b[0])))
}

const havePVM = true

// pvmCopy copies len(local) bytes between local and the target's memory at
// addr with one process_vm_readv (or writev) call per attempt, looping over
// partial copies.
func pvmCopy(pid int, write bool, local []byte, addr uint64) error {
	for len(local) > 0 {
		l := []unix.Iovec{{Base: &local[0]}}
		l[0].SetLen(len(local))
		r := []unix.RemoteIovec{{Base: uintptr(addr), Len: len(local)}}
		var n int
		var err error
		if write {
			n, err = unix.ProcessVMWritev(pid, l, r, 0)
		} else {
			n, err = unix.ProcessVMReadv(pid, l, r, 0)
		}
		if err != nil {
			if errors.Is(err, unix.EPERM) {
				return fmt.Errorf("process_vm_readv: %w (ptrace access to the target is not permitted here)", err)
			}
			return err
		}
		if n <= 0 {
			return fmt.Errorf("process_vm_readv copied %d bytes", n)
		}
		local, addr = local[n:], addr+uint64(n)
	}
	return nil
}
