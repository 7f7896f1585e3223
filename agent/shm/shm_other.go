//go:build !linux

package shm

// Buffer is one allocation; on this system there are none ([Alloc] fails).
type Buffer struct{}

// Alloc fails with [ErrUnsupported] on this system.
func Alloc(size int) (*Buffer, error) { return nil, ErrUnsupported }

// Bytes returns nil.
func (b *Buffer) Bytes() []byte { return nil }

// Free does nothing.
func (b *Buffer) Free() error { return nil }

// Find reports no segment.
func Find(addr, n uint64) (Seg, bool) { return Seg{}, false }

// Pin pins nothing.
func Pin(addr, n uint64) (unpin func()) { return nil }
