package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"sync"

	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/connect"
)

// Pool is a worker's KV-cache memory, as an inference engine keeps it: one
// large slab allocated up front and carved into equal blocks, lent out by
// Alloc and returned by Blocks.Release through a free list. A request's
// blocks need not be contiguous: a hand-off names each with a descriptor.
//
// The slab is host memory (NewPool) or one allocation of GPU memory
// (NewDevicePool). The CPU cannot address GPU memory: Blocks.Fill and
// Blocks.Inspect move the bytes through host memory with the driver's
// copies. Safe for concurrent use.
type Pool struct {
	slab      []byte // host memory; nil for GPU memory
	blockSize int
	blocks    int

	// GPU memory: the driver, the GPU and the slab's device address.
	drv  devmem.Driver
	gpu  int
	base uintptr

	mu     sync.Mutex
	free   []int         // indices of the free blocks
	freed  chan struct{} // closed (and replaced) whenever blocks come back
	closed bool
}

// NewPool allocates a pool of n blocks of blockSize bytes in host memory.
func NewPool(n, blockSize int) *Pool {
	p := newPool(n, blockSize)
	p.slab = make([]byte, n*blockSize)
	return p
}

// NewDevicePool allocates a pool of n blocks of blockSize bytes in the
// memory of GPU gpu, through drv. Close frees it.
func NewDevicePool(drv devmem.Driver, gpu, n, blockSize int) (*Pool, error) {
	base, err := drv.Alloc(gpu, n*blockSize)
	if err != nil {
		return nil, fmt.Errorf("allocate a KV pool of %d blocks (%s) in the memory of GPU %d (%s driver): %w",
			n, sizeString(int64(n)*int64(blockSize)), gpu, drv.Name(), err)
	}
	p := newPool(n, blockSize)
	p.drv, p.gpu, p.base = drv, gpu, base
	return p, nil
}

func newPool(n, blockSize int) *Pool {
	p := &Pool{blockSize: blockSize, blocks: n, free: make([]int, n), freed: make(chan struct{})}
	for i := range p.free {
		p.free[i] = n - 1 - i // hand out low blocks first
	}
	return p
}

// Cap returns how many blocks the pool holds.
func (p *Pool) Cap() int { return p.blocks }

// OnDevice reports whether the pool's blocks are GPU memory.
func (p *Pool) OnDevice() bool { return p.drv != nil }

// Close frees the pool's GPU memory. Only call it once no operation can
// touch any of its blocks: after the worker's Connector is closed. Host
// memory is left to the garbage collector. Idempotent.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || p.drv == nil {
		p.closed = true
		return nil
	}
	p.closed = true
	if err := p.drv.Free(p.base); err != nil {
		return fmt.Errorf("free the KV pool's GPU memory: %w", err)
	}
	return nil
}

// Alloc takes n blocks, waiting until that many are free or ctx ends. It
// takes all n at once, so two requests that each hold half of what they
// need can never deadlock.
func (p *Pool) Alloc(ctx context.Context, n int) (*Blocks, error) {
	if n > p.Cap() {
		return nil, fmt.Errorf("want %d blocks, the pool holds only %d", n, p.Cap())
	}
	for {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, errors.New("the KV pool is closed")
		}
		if len(p.free) >= n {
			ids := make([]int, n)
			copy(ids, p.free[len(p.free)-n:])
			p.free = p.free[:len(p.free)-n]
			p.mu.Unlock()
			return &Blocks{pool: p, ids: ids}, nil
		}
		freed := p.freed
		p.mu.Unlock()
		select {
		case <-freed:
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for %d free blocks of the KV pool: %w", n, context.Cause(ctx))
		}
	}
}

// Blocks are blocks lent by a Pool, in the order of a request's layout.
type Blocks struct {
	pool *Pool
	ids  []int
	once sync.Once
}

// Len returns the number of blocks.
func (b *Blocks) Len() int { return len(b.ids) }

// Buf returns block i's memory. Host pools only: the CPU cannot address
// GPU memory, which Fill and Inspect reach instead.
func (b *Blocks) Buf(i int) []byte {
	if b.pool.slab == nil {
		panic("prefill_decode: Blocks.Buf on a pool in GPU memory")
	}
	off := b.ids[i] * b.pool.blockSize
	return b.pool.slab[off : off+b.pool.blockSize : off+b.pool.blockSize]
}

// ptr returns block i's device address, in a pool in GPU memory.
func (b *Blocks) ptr(i int) uintptr {
	return b.pool.base + uintptr(b.ids[i])*uintptr(b.pool.blockSize)
}

// Descriptors describes the blocks for an operation, in order: host
// descriptors, or device descriptors naming the pool's GPU.
func (b *Blocks) Descriptors() []connect.Descriptor {
	ds := make([]connect.Descriptor, len(b.ids))
	for i := range b.ids {
		if b.pool.OnDevice() {
			ds[i] = connect.NewDeviceDescriptor(b.ptr(i), b.pool.blockSize, connect.CUDA(b.pool.gpu))
		} else {
			ds[i] = connect.NewDescriptor(b.Buf(i))
		}
	}
	return ds
}

// Fill sets every block's content: fn writes block i's bytes into buf. In
// host memory buf is the block itself; in GPU memory it is host memory,
// which Fill then copies into the blocks (one stream, one wait).
func (b *Blocks) Fill(fn func(i int, buf []byte)) error {
	if !b.pool.OnDevice() {
		for i := range b.ids {
			fn(i, b.Buf(i))
		}
		return nil
	}
	host := b.hostCopy()
	for i := range b.ids {
		fn(i, host(i))
	}
	st, err := b.pool.drv.NewStream(b.pool.gpu)
	if err != nil {
		return fmt.Errorf("copy the KV blocks into GPU %d: %w", b.pool.gpu, err)
	}
	for i := range b.ids {
		if err = st.ToDevice(b.ptr(i), host(i)); err != nil {
			break
		}
	}
	if err = errors.Join(err, st.Close()); err != nil {
		return fmt.Errorf("copy the KV blocks into GPU %d: %w", b.pool.gpu, err)
	}
	return nil
}

// Inspect shows fn every block's content, in buf. In host memory buf is the
// block itself; in GPU memory it is a copy in host memory, made first (one
// stream, one wait): the CPU cannot read GPU memory.
func (b *Blocks) Inspect(fn func(i int, buf []byte)) error {
	if !b.pool.OnDevice() {
		for i := range b.ids {
			fn(i, b.Buf(i))
		}
		return nil
	}
	host := b.hostCopy()
	st, err := b.pool.drv.NewStream(b.pool.gpu)
	if err != nil {
		return fmt.Errorf("copy the KV blocks back from GPU %d: %w", b.pool.gpu, err)
	}
	for i := range b.ids {
		if err = st.ToHost(host(i), b.ptr(i)); err != nil {
			break
		}
	}
	if err = errors.Join(err, st.Close()); err != nil {
		return fmt.Errorf("copy the KV blocks back from GPU %d: %w", b.pool.gpu, err)
	}
	for i := range b.ids {
		fn(i, host(i))
	}
	return nil
}

// hostCopy returns host memory for a copy of the blocks, block i at
// host(i).
func (b *Blocks) hostCopy() (host func(i int) []byte) {
	bs := b.pool.blockSize
	buf := make([]byte, len(b.ids)*bs)
	return func(i int) []byte { return buf[i*bs : (i+1)*bs : (i+1)*bs] }
}

// Release returns the blocks to the pool. Only call it once no operation
// can touch them any more: after a passive operation's Close or an active
// operation's Wait. Idempotent.
func (b *Blocks) Release() {
	b.once.Do(func() {
		p := b.pool
		p.mu.Lock()
		p.free = append(p.free, b.ids...)
		close(p.freed)
		p.freed = make(chan struct{})
		p.mu.Unlock()
	})
}

// The content of the KV cache is synthetic but deterministic: every block's
// bytes come from a cheap generator (splitmix64) seeded by the request ID
// and the block's place in the layout. The prefill worker fills its blocks
// this way, the decode worker checks every byte it received against the
// same bytes, recomputed. Since each block of each request has its own
// seed, a block that lands in the wrong place, a stale block from an
// earlier request and a torn or partial copy are all caught.

// requestSeed hashes a request ID into the seed of its blocks.
func requestSeed(id string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(id))
	return h.Sum64()
}

func blockSeed(reqSeed uint64, b BlockID) uint64 {
	kv := uint64(0)
	if b.V {
		kv = 1
	}
	return mix(reqSeed ^ mix(uint64(b.Layer)<<33|kv<<32|uint64(b.Block)))
}

// mix is splitmix64's finalizer: a cheap, well-spread 64-bit hash.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

const golden = 0x9e3779b97f4a7c15 // splitmix64's increment

// fillBlock writes the generator's stream for seed into buf.
func fillBlock(buf []byte, seed uint64) {
	i := 0
	for ; i+8 <= len(buf); i += 8 {
		seed += golden
		binary.LittleEndian.PutUint64(buf[i:], mix(seed))
	}
	if i < len(buf) {
		var tail [8]byte
		binary.LittleEndian.PutUint64(tail[:], mix(seed+golden))
		copy(buf[i:], tail[:])
	}
}

// checkBlock returns the offset of the first byte of buf that differs from
// the stream fillBlock writes for seed, and the byte expected there; -1 if
// none does.
func checkBlock(buf []byte, seed uint64) (off int, want byte) {
	var w [8]byte
	for i := 0; i < len(buf); i += 8 {
		seed += golden
		binary.LittleEndian.PutUint64(w[:], mix(seed))
		chunk := buf[i:min(i+8, len(buf))]
		if i+8 <= len(buf) && binary.LittleEndian.Uint64(chunk) == binary.LittleEndian.Uint64(w[:]) {
			continue
		}
		for k := range chunk {
			if chunk[k] != w[k] {
				return i + k, w[k]
			}
		}
	}
	return -1, 0
}

// FillKV plays the prefill's part: it writes request id's KV cache into
// blocks, laid out as l says. tamper, if not nil, may change each block's
// bytes after they are computed and before they reach the blocks (a test
// hook).
func FillKV(l Layout, id string, blocks *Blocks, tamper func(i int, buf []byte)) error {
	s := requestSeed(id)
	return blocks.Fill(func(i int, buf []byte) {
		fillBlock(buf, blockSeed(s, l.Locate(i)))
		if tamper != nil {
			tamper(i, buf)
		}
	})
}

// VerifyKV checks every byte of request id's KV cache in blocks (copied
// back to host memory first when they are GPU memory). It returns nil if
// all are as FillKV wrote them, a *MismatchError naming the first block
// that differs, or the error of the copy.
func VerifyKV(l Layout, id string, blocks *Blocks) error {
	s := requestSeed(id)
	var first *MismatchError
	bad := 0
	err := blocks.Inspect(func(i int, buf []byte) {
		off, want := checkBlock(buf, blockSeed(s, l.Locate(i)))
		if off < 0 {
			return
		}
		bad++
		if first == nil {
			first = &MismatchError{Request: id, Descriptor: i, Block: l.Locate(i), Offset: off, Size: len(buf), Got: buf[off], Want: want}
		}
	})
	if err != nil {
		return err
	}
	if first == nil {
		return nil
	}
	first.Blocks, first.Total = bad, blocks.Len()
	return first
}

// MismatchError reports KV-cache bytes that differ from what the prefill
// worker computed: the first differing block and byte, and how many blocks
// differ.
type MismatchError struct {
	Request    string
	Descriptor int     // the block's index in the hand-off
	Block      BlockID // which block that is
	Offset     int     // the first differing byte, within the block
	Size       int     // the block's size
	Got, Want  byte
	Blocks     int // blocks that differ
	Total      int // blocks in the hand-off
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("request %s: %d of %d blocks differ; first: %s (descriptor %d), byte %d of %d: got 0x%02x, want 0x%02x",
		e.Request, e.Blocks, e.Total, e.Block, e.Descriptor, e.Offset, e.Size, e.Got, e.Want)
}
