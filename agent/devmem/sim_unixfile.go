//go:build unix && !linux

package devmem

import (
	"os"

	"golang.org/x/sys/unix"
)

// simNamed says that /proc names memory files: not on this system, where
// an importer cannot check what a descriptor is and handle shares cannot
// be opened.
const simNamed = false

// mapNoReserve is not a flag of this system's mmap.
const mapNoReserve = 0

// simMemCreate creates a memory file of size bytes, closed on exec: an
// unlinked temporary file, for want of memfd.
func simMemCreate(name string, size int) (int, error) {
	f, err := os.CreateTemp("", name+"-*")
	if err != nil {
		return -1, err
	}
	defer f.Close()
	_ = os.Remove(f.Name())
	if err := f.Truncate(int64(size)); err != nil {
		return -1, err
	}
	return unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
}

func simLinkName(string) (string, bool) { return "", false }

// simSealed cannot check a file's size is fixed on this system: files
// have no seals here.
func simSealed(int) error { return nil }
