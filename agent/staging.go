package agent

import (
	"fmt"
	"math/bits"
	"sync"
	"time"
	"unsafe"

	"github.com/google/uuid"

	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/internal/oneline"
)

// Staging defaults: see [WithStaging].
const (
	defaultStageChunk = 4 << 20
	defaultStagePool  = 64 << 20
	stageDepth        = 4 // chunks of one transfer in flight at once
	stageMinClass     = 64 << 10
	stageMaxPieces    = 1024 // pieces per staged chunk
)

// stageWait bounds how long a lease waits for a free staging buffer: the
// leases that hold them are released within a frame or chunk, so a wait
// this long means the pool is too small for the load, not slow.
var stageWait = 10 * time.Second

// WithDevice sets the device-memory driver the agent checks GPU pointers
// with and stages device memory through ([devmem.Driver]). Default:
// [devmem.Default], the CUDA driver unless GOXFER_DEVICE=sim selects the
// simulator; it is loaded at the first use of device memory, so an agent
// that never sees VRAM never loads it.
func WithDevice(d devmem.Driver) Option {
	return optionFunc(func(o *options) error {
		if d == nil {
			return fmt.Errorf("%w: nil device driver", ErrInvalidOption)
		}
		o.device = d
		return nil
	})
}

// WithStaging sets how device memory is staged through pinned host memory
// for backends that cannot reach it directly: chunk is the most one staged
// piece of a transfer moves at a time (each transfer keeps up to four in
// flight, so that copying one overlaps sending another), pool the most
// pinned host memory the agent holds for staging: half for its own
// transfers, half for its peers' accesses to its device memory, so that
// neither can starve the other; one peer may hold at most half of the
// peers' half beyond its first buffer. Defaults: 4 MiB chunks, a 64 MiB
// pool. chunk must be a power of two in [64 KiB, 256 MiB], pool at least
// two chunks.
func WithStaging(chunk, pool int) Option {
	return optionFunc(func(o *options) error {
		if chunk < stageMinClass || chunk > 256<<20 || chunk&(chunk-1) != 0 {
			return fmt.Errorf("%w: staging chunk of %d bytes: want a power of two in [%d, %d]", ErrInvalidOption, chunk, stageMinClass, 256<<20)
		}
		if pool < 2*chunk {
			return fmt.Errorf("%w: staging pool of %d bytes: want at least two chunks (%d), so that each half holds a chunk", ErrInvalidOption, pool, 2*chunk)
		}
		o.stageChunk, o.stagePool = chunk, pool
		return nil
	})
}

// devState is the agent's device driver, loaded at first use, and its
// staging resources.
type devState struct {
	once  sync.Once
	given devmem.Driver
	drv   devmem.Driver
	err   error

	// Transfers and peers' leases stage from separate halves of the pool,
	// so that two agents staging toward each other never wait for buffers
	// their own waits hold.
	pool, leasePool *stagePool
	chunk           uint64
	streams         streamPool
}

// Device returns the agent's device-memory driver ([WithDevice]), loading
// it on first call. The error wraps [devmem.ErrUnavailable] where there is
// none. Safe for concurrent use.
func (a *Agent) Device() (devmem.Driver, error) {
	d := &a.dev
	d.once.Do(func() {
		if d.given != nil {
			d.drv = d.given
			return
		}
		d.drv, d.err = devmem.Default()
		if d.err == nil && d.drv == nil {
			d.err = devmem.ErrUnavailable
		}
	})
	return d.drv, d.err
}

// CheckDevice checks every VRAM region of ls through the device driver
// ([Agent.Device]): it must be device memory of its GPU and lie inside one
// allocation. Errors wrap [ErrInvalid] and name the region's index; with
// no driver they also wrap [devmem.ErrUnavailable]. Post and Expose check
// this themselves; layers above call it to fail early. Regions of host
// memory are not looked at. Safe for concurrent use.
func (a *Agent) CheckDevice(ls []Local) error { return a.checkDevice(ls) }

func (a *Agent) checkDevice(ls []Local) error {
	var drv devmem.Driver
	for i, l := range ls {
		if l.Kind != KindVRAM {
			continue
		}
		if drv == nil {
			var err error
			if drv, err = a.Device(); err != nil {
				return fmt.Errorf("%w: region %d is GPU memory: %w", ErrInvalid, i, err)
			}
		}
		if err := drv.Check(uintptr(l.Addr), l.Len, int(l.Device)); err != nil {
			return fmt.Errorf("%w: region %d: [0x%x, +%d) on GPU %d: %w", ErrInvalid, i, l.Addr, l.Len, l.Device, err)
		}
	}
	return nil
}

// stagePool is the agent's pinned host memory for staging: buffers in
// power-of-two classes from 64 KiB, kept for reuse, at most limit bytes
// in all. A buffer of a class none is cached in is made room for by
// freeing cached buffers of other classes.
type stagePool struct {
	drv   devmem.Driver
	limit int64
	// peerLimit bounds what the buffers in use for one peer may add up to
	// (leases), beyond its first, so that a slow peer cannot hold the
	// whole pool.
	peerLimit int64

	mu     sync.Mutex
	free   map[int][][]byte    // by class
	held   int64               // bytes allocated, cached or in use
	inUse  int                 // buffers handed out
	peers  map[uuid.UUID]int64 // bytes in use per peer
	owner  map[*byte]uuid.UUID // who holds each buffer handed out for a peer
	closed bool
	wake   chan struct{} // closed and replaced when a buffer comes back
}

func newStagePool(drv devmem.Driver, limit, peerLimit int) *stagePool {
	return &stagePool{
		drv: drv, limit: int64(limit), peerLimit: int64(peerLimit),
		free: make(map[int][][]byte), peers: make(map[uuid.UUID]int64), owner: make(map[*byte]uuid.UUID),
		wake: make(chan struct{}),
	}
}

func stageClass(n uint64) int {
	if n <= stageMinClass {
		return stageMinClass
	}
	return 1 << bits.Len64(n-1)
}

// errStagingClosed ends waits for a buffer once the agent closes.
var errStagingClosed = fmt.Errorf("%w: staging stopped", ErrClosed)

// get returns a buffer of at least n bytes, waiting for one to come back
// until stop is closed or wait passes (wait 0: until stop; wait < 0: not
// at all).
func (p *stagePool) get(n uint64, stop <-chan struct{}, wait time.Duration) ([]byte, error) {
	return p.getFor(uuid.Nil, n, stop, wait, false)
}

// getFor is get for a buffer held on behalf of peer (uuid.Nil: none). A
// peer's first buffer for an access (first) waits while the peer holds
// its share (peerLimit) in other accesses; later ones are not held back.
func (p *stagePool) getFor(peer uuid.UUID, n uint64, stop <-chan struct{}, wait time.Duration, first bool) ([]byte, error) {
	class := stageClass(n)
	if int64(class) > p.limit {
		return nil, fmt.Errorf("%w: %d bytes to stage at once (a %d-byte buffer), more than the staging pool's %d", ErrStaging, n, class, p.limit)
	}
	var timer <-chan time.Time
	for {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, errStagingClosed
		}
		if held := p.peers[peer]; first && peer != uuid.Nil && held > 0 && held+int64(class) > p.peerLimit {
			// Over the peer's share: only the peer's own buffers coming
			// back make room. A peer holding nothing may take any buffer
			// the pool can give, so a frame larger than a share still
			// goes through, one at a time.
		} else if bs := p.free[class]; len(bs) > 0 {
			b := bs[len(bs)-1]
			p.free[class] = bs[:len(bs)-1]
			p.handOutLocked(peer, b)
			p.mu.Unlock()
			return b[:n], nil
		} else {
			if p.held+int64(class) > p.limit {
				p.evictLocked(p.held + int64(class) - p.limit)
			}
			if p.held+int64(class) <= p.limit {
				p.held += int64(class)
				p.inUse++ // counted while allocating, so that Stats and a peer's share see it
				p.peers[peer] += int64(class)
				p.mu.Unlock()
				b, err := p.drv.HostAlloc(class)
				p.mu.Lock()
				p.inUse--
				if p.peers[peer] -= int64(class); p.peers[peer] <= 0 {
					delete(p.peers, peer)
				}
				if err != nil {
					p.held -= int64(class)
					p.mu.Unlock()
					return nil, fmt.Errorf("%w: pinned host buffer of %d bytes: %w", ErrStaging, class, err)
				}
				p.handOutLocked(peer, b)
				p.mu.Unlock()
				return b[:n], nil
			}
		}
		wake := p.wake
		p.mu.Unlock()
		if wait < 0 {
			return nil, fmt.Errorf("%w: no staging buffer of %d bytes free now (pool of %d bytes in use; a peer's share is %d)", ErrStaging, class, p.limit, p.peerLimit)
		}
		if timer == nil && wait > 0 {
			t := time.NewTimer(wait)
			defer t.Stop()
			timer = t.C
		}
		select {
		case <-wake:
		case <-stop:
			return nil, errStagingClosed
		case <-timer:
			return nil, fmt.Errorf("%w: no staging buffer of %d bytes came free within %v (pool of %d bytes in use; a peer's share is %d)", ErrStaging, class, wait, p.limit, p.peerLimit)
		}
	}
}

// evictLocked frees cached buffers until need bytes are freed or none is
// cached. The caller holds p.mu.
func (p *stagePool) evictLocked(need int64) {
	for class, bs := range p.free {
		for len(bs) > 0 && need > 0 {
			b := bs[len(bs)-1]
			bs = bs[:len(bs)-1]
			_ = p.drv.HostFree(b[:cap(b)])
			p.held -= int64(class)
			need -= int64(class)
		}
		p.free[class] = bs
		if need <= 0 {
			return
		}
	}
}

// handOutLocked counts b in use, for peer (uuid.Nil: none). The caller
// holds p.mu.
func (p *stagePool) handOutLocked(peer uuid.UUID, b []byte) {
	p.inUse++
	if peer != uuid.Nil {
		p.peers[peer] += int64(cap(b))
		p.owner[unsafe.SliceData(b[:cap(b)])] = peer
	}
}

// put returns a buffer from get.
func (p *stagePool) put(b []byte) {
	b = b[:cap(b)]
	p.mu.Lock()
	p.inUse--
	if peer, ok := p.owner[unsafe.SliceData(b)]; ok {
		delete(p.owner, unsafe.SliceData(b))
		if p.peers[peer] -= int64(len(b)); p.peers[peer] <= 0 {
			delete(p.peers, peer)
		}
	}
	if p.closed {
		p.held -= int64(len(b))
		p.mu.Unlock()
		_ = p.drv.HostFree(b)
		return
	}
	p.free[len(b)] = append(p.free[len(b)], b)
	close(p.wake)
	p.wake = make(chan struct{})
	p.mu.Unlock()
}

// close frees the cached buffers and makes waits and later gets fail;
// buffers still in use are freed as they come back.
func (p *stagePool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	p.closed = true
	p.evictLocked(p.held)
	close(p.wake)
}

// stats returns the bytes of pinned memory held and the buffers in use.
func (p *stagePool) stats() (held int64, inUse int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held, p.inUse
}

// streamPool keeps copy streams per GPU for reuse.
type streamPool struct {
	mu   sync.Mutex
	free map[int][]devmem.Stream
	done bool
}

func (sp *streamPool) get(drv devmem.Driver, dev int) (devmem.Stream, error) {
	sp.mu.Lock()
	if ss := sp.free[dev]; len(ss) > 0 {
		s := ss[len(ss)-1]
		sp.free[dev] = ss[:len(ss)-1]
		sp.mu.Unlock()
		return s, nil
	}
	sp.mu.Unlock()
	s, err := drv.NewStream(dev)
	if err != nil {
		return nil, fmt.Errorf("%w: copy stream on GPU %d: %w", ErrStaging, dev, err)
	}
	return s, nil
}

func (sp *streamPool) put(dev int, s devmem.Stream) {
	sp.mu.Lock()
	if sp.done {
		sp.mu.Unlock()
		_ = s.Close()
		return
	}
	if sp.free == nil {
		sp.free = make(map[int][]devmem.Stream)
	}
	sp.free[dev] = append(sp.free[dev], s)
	sp.mu.Unlock()
}

func (sp *streamPool) close() error {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	sp.done = true
	var errs []error
	for _, ss := range sp.free {
		for _, s := range ss {
			errs = append(errs, s.Close())
		}
	}
	sp.free = nil
	return oneline.Join(errs...)
}

// staging returns the agent's staging resources, made at first use.
func (a *Agent) staging() (*devState, error) {
	drv, err := a.Device()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrStaging, err)
	}
	a.stageMu.Lock()
	defer a.stageMu.Unlock()
	if a.isClosed() {
		return nil, fmt.Errorf("%w: agent %s is closing", ErrRemoteLost, a.id)
	}
	if a.dev.pool == nil {
		a.dev.pool = newStagePool(drv, a.stagePool/2, a.stagePool/2)
		// A peer may hold half the lease pool: two slow peers cannot starve
		// the rest, and one peer's tcp streams still fit.
		a.dev.leasePool = newStagePool(drv, a.stagePool/2, a.stagePool/4)
		a.dev.chunk = uint64(a.stageChunk)
	}
	return &a.dev, nil
}

// stopStaging makes waits for a staging buffer fail: the agent is closing.
func (a *Agent) stopStaging() {
	a.stageMu.Lock()
	defer a.stageMu.Unlock()
	if a.dev.pool != nil {
		a.dev.pool.close()
		a.dev.leasePool.close()
	}
}

// closeStaging frees the staging pool and streams; the agent calls it
// once no transfer or lease can use them.
func (a *Agent) closeStaging() error {
	a.stopStaging()
	return a.dev.streams.close()
}

// streams is a set of copy streams, one per GPU, taken from the agent's
// pool for one goroutine's use.
type streams struct {
	a  *Agent
	by map[int]devmem.Stream
}

func (ss *streams) get(dev int) (devmem.Stream, error) {
	if s, ok := ss.by[dev]; ok {
		return s, nil
	}
	s, err := ss.a.dev.streams.get(ss.a.dev.drv, dev)
	if err != nil {
		return nil, err
	}
	if ss.by == nil {
		ss.by = make(map[int]devmem.Stream, 1)
	}
	ss.by[dev] = s
	return s, nil
}

// sync waits for every stream's copies.
func (ss *streams) sync() error {
	var errs []error
	for dev, s := range ss.by {
		if err := s.Sync(); err != nil {
			errs = append(errs, fmt.Errorf("%w: GPU %d: %w", ErrStaging, dev, err))
		}
	}
	return oneline.Join(errs...)
}

// release syncs the streams and gives them back to the pool.
func (ss *streams) release() error {
	err := ss.sync()
	for dev, s := range ss.by {
		ss.a.dev.streams.put(dev, s)
	}
	ss.by = nil
	return err
}
