package devmem

import (
	"strings"

	"golang.org/x/sys/unix"
)

// simNamed says that /proc names memory files, so an importer can check
// what a descriptor is.
const simNamed = true

// mapNoReserve keeps a PROT_NONE reservation from counting against
// overcommit.
const mapNoReserve = unix.MAP_NORESERVE

// simMemCreate creates a memory file of size bytes, closed on exec.
func simMemCreate(name string, size int) (int, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return -1, err
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		_ = unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// simLinkName returns the name of a memfd from its link in /proc/*/fd.
func simLinkName(link string) (string, bool) {
	name, ok := strings.CutPrefix(link, "/memfd:")
	if !ok {
		return "", false
	}
	return strings.CutSuffix(name, " (deleted)")
}
