// Package hostid names this boot of this host, seen through a set of Linux
// namespaces: two processes with the same identity share the kernel and the
// namespaces named, so they can reach each other through them.
package hostid

import (
	"crypto/sha256"
	"os"
)

// ID is a short host identity: the first 8 bytes of a SHA-256.
type ID [8]byte

// Of returns the identity of this boot of this host (its boot ID, or its
// host name where /proc is not available) within the namespaces named, for
// example "net" or "pid" (entries of /proc/self/ns). A namespace that cannot
// be read is left out, so on systems without /proc every process of a host
// shares one identity.
func Of(namespaces ...string) ID {
	h := sha256.New()
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		h.Write(b)
	} else if name, err := os.Hostname(); err == nil {
		h.Write([]byte(name))
	}
	for _, ns := range namespaces {
		if link, err := os.Readlink("/proc/self/ns/" + ns); err == nil {
			h.Write([]byte(link))
		}
	}
	var id ID
	copy(id[:], h.Sum(nil))
	return id
}
