//go:build unix

package devmem

import "golang.org/x/sys/unix"

func pageSize() int { return unix.Getpagesize() }

// mapMem maps n bytes of anonymous memory outside the Go heap: readable and
// writable, or reserved with no access at all.
func mapMem(n int, rw bool) ([]byte, error) {
	if !rw {
		return unix.Mmap(-1, 0, n, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANON|unix.MAP_NORESERVE)
	}
	return unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANON)
}

func unmapMem(b []byte) error { return unix.Munmap(b) }
