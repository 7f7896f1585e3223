//go:build unix

package devmem

import (
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

func pageSize() int { return unix.Getpagesize() }

// mapMem maps n bytes of anonymous memory outside the Go heap: readable and
// writable, or reserved with no access at all.
func mapMem(n int, rw bool) ([]byte, error) {
	if !rw {
		return unix.Mmap(-1, 0, n, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANON|mapNoReserve)
	}
	return unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANON)
}

func unmapMem(b []byte) error { return unix.Munmap(b) }

// simMapShared maps the first n bytes of memory file fd, shared with every
// other mapping of it.
func simMapShared(fd, n int) ([]byte, error) {
	return unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
}

func simCloseFD(fd int) error { return unix.Close(fd) }

func simDupFD(fd int) (int, error) { return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0) }

// simFileSize returns the size of fd, which must be a regular file, as a
// memory file is.
func simFileSize(fd int) (int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, fmt.Errorf("descriptor %d: %w", fd, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0, fmt.Errorf("descriptor %d is not a memory file (mode 0%o)", fd, st.Mode)
	}
	return st.Size, nil
}

// simFDName returns the name of memory file fd from /proc/self/fd, with
// ok false where there is no /proc to tell (not Linux).
func simFDName(fd int) (name string, ok bool, err error) {
	if !simNamed {
		if _, err := simFileSize(fd); err != nil {
			return "", false, err
		}
		return "", false, nil
	}
	link, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return "", false, err
	}
	if name, ok := simLinkName(link); ok {
		return name, true, nil
	}
	return link, true, nil
}

// simOpenPeer opens memory file fd of process pid through /proc, which
// must be named want before and after opening: a descriptor the process
// closed and reused for something else (a socket, a device, another
// allocation) is neither opened nor mapped.
func simOpenPeer(pid, fd int, want string) (int, error) {
	if !simNamed {
		return -1, fmt.Errorf("handle shares open the exporter's memory file through /proc/<pid>/fd, which this system has not")
	}
	path := fmt.Sprintf("/proc/%d/fd/%d", pid, fd)
	link, err := os.Readlink(path)
	if err != nil {
		return -1, fmt.Errorf("the exporter's memory file is gone (freed, or the process exited): %w", err)
	}
	if name, ok := simLinkName(link); !ok || name != want {
		return -1, fmt.Errorf("%s is %q, not the memory file %q (the allocation was freed)", path, link, want)
	}
	nfd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open %s: %w", path, err)
	}
	if name, _, err := simFDName(nfd); err != nil || name != want {
		_ = unix.Close(nfd)
		return -1, fmt.Errorf("%s changed to %q while it was opened, not the memory file %q (the allocation was freed): %v", path, name, want, err)
	}
	return nfd, nil
}
