//go:build !unix

package devmem

import (
	"errors"
	"fmt"
	"runtime"
)

func pageSize() int { return 4096 }

var errSimUnix = errors.New("the simulator maps memory on unix systems only, not on " + runtime.GOOS)

func mapMem(int, bool) ([]byte, error) { return nil, errSimUnix }

func unmapMem([]byte) error { return nil }

func simMemCreate(string, int) (int, error) { return -1, errSimUnix }

func simMapShared(int, int) ([]byte, error) { return nil, errSimUnix }

func simCloseFD(int) error { return nil }

func simDupFD(int) (int, error) { return -1, fmt.Errorf("%w: %w", ErrNotShareable, errSimUnix) }

func simFileSize(int) (int64, error) { return 0, errSimUnix }

func simFDName(int) (string, bool, error) { return "", false, errSimUnix }

func simOpenPeer(int, int, string) (int, error) { return -1, errSimUnix }

func simSealed(int) error { return errSimUnix }
