// Package shm allocates host memory that same-host peers can map: each
// allocation is its own shared-memory segment (a Linux memfd), and the
// agent's same-host backend (cma) hands a peer the segment's file
// descriptor once, after which the peer's copies are plain loads and stores
// in its own address space instead of system calls.
//
// Memory from [Alloc] behaves like any other []byte for the caller: expose
// it, register it, read and write it. What differs is who else may reach
// it: a peer that was granted an exposure lying in a segment maps the whole
// segment (see docs/shm.md for the trust model). Allocate pools (a KV
// cache's blocks, a batch of embeddings), not single small blocks: each
// allocation costs a file descriptor, and a peer maps each segment once
// per connection.
//
// On systems other than Linux, Alloc fails with [ErrUnsupported].
package shm

import "errors"

var (
	// ErrUnsupported is returned by [Alloc] where the system has no
	// shared-memory segments goxfer can pass to a peer (not Linux).
	ErrUnsupported = errors.New("shm: shared host memory is not supported on this system")
	// ErrBusy is returned by [Buffer.Free] while memory of the buffer is
	// still exposed to peers: revoke (close) the exposures first.
	ErrBusy = errors.New("shm: buffer still exposed")
	// ErrInvalid is returned for an invalid size.
	ErrInvalid = errors.New("shm: invalid argument")
)

// MaxSize is the largest allocation: 1 TiB.
const MaxSize = 1 << 40

// Seg describes the segment holding some memory, as [Find] reports it.
type Seg struct {
	// ID names the segment in this process; it is never reused.
	ID uint64
	// Base is the segment's address in this process, Size its length in
	// bytes (the allocation rounded up to whole pages).
	Base uint64
	Size uint64
}
