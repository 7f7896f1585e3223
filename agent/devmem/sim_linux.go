package devmem

import (
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// simNamed says that /proc names memory files, so an importer can check
// what a descriptor is.
const simNamed = true

// mapNoReserve keeps a PROT_NONE reservation from counting against
// overcommit.
const mapNoReserve = unix.MAP_NORESERVE

// simSeals are the seals of a memory file: its size is fixed, so that no
// process that shares it can shrink it under another's mapping (whose
// copies would then fault, SIGBUS) nor grow it.
const simSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// simMemCreate creates a memory file of size bytes, closed on exec, its
// size sealed.
func simMemCreate(name string, size int) (int, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, err
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		_ = unix.Close(fd)
		return -1, err
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, simSeals); err != nil {
		_ = unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// simSealed checks that memory file fd, from another process, has its size
// sealed: one that could shrink under the mapping is refused.
func simSealed(fd int) error {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fmt.Errorf("descriptor %d: seals: %w", fd, err)
	}
	if seals&(unix.F_SEAL_SHRINK|unix.F_SEAL_GROW) != unix.F_SEAL_SHRINK|unix.F_SEAL_GROW {
		return fmt.Errorf("descriptor %d: a memory file whose size is not sealed (seals 0x%x), which its owner could shrink under the mapping", fd, seals)
	}
	return nil
}

// simLinkName returns the name of a memfd from its link in /proc/*/fd.
func simLinkName(link string) (string, bool) {
	name, ok := strings.CutPrefix(link, "/memfd:")
	if !ok {
		return "", false
	}
	return strings.CutSuffix(name, " (deleted)")
}
