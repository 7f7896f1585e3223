package agent

import (
	"fmt"

	"github.com/google/uuid"
)

// leaseStage is what a lease staged for a peer's access to device memory:
// the pinned host buffers standing in for the device bytes, and the
// streams that copy them.
type leaseStage struct {
	ds   *devState
	peer uuid.UUID       // the peer the lease serves: its share of the pool
	stop <-chan struct{} // the exposure's revocation ends waits for a buffer
	acc  Access

	bufs    [][]byte // taken from the lease pool
	cur     []byte   // what is left of the last buffer
	items   []stageItem
	ss      streams
	batched bool // Prepare was called: READ copies wait for Ready
	pending bool // READ copies queued and not yet waited for
}

// leaseStageMin is the least a lease takes from the staging pool at a
// time, unless Prepare says it needs less: a frame of many small pieces
// shares a buffer.
const leaseStageMin = 256 << 10

type stageItem struct {
	buf     []byte
	addr    uint64
	dev     int
	flushed bool
}

// Prepare tells a lease that the backend is about to Slice at most total
// bytes and, for a READ lease, to call [Lease.Ready] before touching them.
// On an exposure of device memory the lease then takes one staging buffer
// for all of them, waiting for one if need be while it holds none, and
// copies every piece out of the device with one wait, in Ready, instead of
// one per Slice. Backends that know a frame's size before its pieces
// (tcp's piece table, cma's ranges) call it; without it each Slice waits
// for its own copy. Its error wraps [ErrStaging]: no buffer came free in
// time. A total larger than the pool can hold at once is staged piece by
// piece instead. For host memory it does nothing.
func (l *Lease) Prepare(total uint64) error {
	st := l.st
	if st == nil || total == 0 {
		return nil
	}
	if int64(stageClass(total)) > st.ds.leasePool.limit {
		return nil // too big to stage at once: piece by piece, each Slice on its own
	}
	if len(st.bufs) == 0 {
		b, err := st.take(total, true)
		if err != nil {
			return err
		}
		st.bufs = append(st.bufs, b)
		st.cur = b
	}
	st.batched = true
	return nil
}

// Ready waits for the copies out of device memory that the Slices of a
// prepared READ lease queued: their bytes are valid once it returns nil.
// For other leases it does nothing.
func (l *Lease) Ready() error {
	st := l.st
	if st == nil || !st.pending {
		return nil
	}
	st.pending = false
	if err := st.ss.sync(); err != nil {
		return fmt.Errorf("%w: GPU to host: %w", ErrStaging, err)
	}
	return nil
}

// take gets a buffer of at least n bytes from the lease pool for the
// lease's peer. It waits for one only if the lease holds none: a lease
// that waited while holding buffers could wait for another that waits for
// its own.
func (st *leaseStage) take(n uint64, mayWait bool) ([]byte, error) {
	pool := st.ds.leasePool
	first := len(st.bufs) == 0
	wait := stageWait
	if !mayWait || !first {
		wait = -1
	}
	return pool.getFor(st.peer, max(n, min(leaseStageMin, uint64(pool.peerLimit))), st.stop, wait, first)
}

// stage takes a staging buffer for n device bytes at addr, filled from the
// device for a READ lease.
func (l *Lease) stage(addr, n uint64, dev int) ([]byte, error) {
	st := l.st
	if uint64(len(st.cur)) < n {
		b, err := st.take(n, true)
		if err != nil {
			return nil, err
		}
		st.bufs = append(st.bufs, b)
		st.cur = b
	}
	buf := st.cur[:n:n]
	st.cur = st.cur[n:]
	st.items = append(st.items, stageItem{buf: buf, addr: addr, dev: dev})
	if st.acc != AccessRead {
		return buf, nil
	}
	s, err := st.ss.get(dev)
	if err == nil {
		err = s.ToHost(buf, uintptr(addr))
	}
	st.pending = true
	if err == nil && st.batched {
		return buf, nil // Ready waits for it
	}
	st.pending = false
	if serr := st.ss.sync(); err == nil {
		err = serr
	}
	if err != nil {
		return nil, fmt.Errorf("%w: GPU %d [0x%x, +%d) to host: %w", ErrStaging, dev, addr, n, err)
	}
	return buf, nil
}

// Flush copies what a WRITE lease staged into device memory and waits for
// the copies: a backend calls it once every byte of the access has arrived
// and before it acknowledges it, so that a failure reaches the peer. Only
// flushed bytes reach the device: a lease released without Flush (a frame
// cut short, refused or revoked) leaves the device memory as it was, its
// staging buffers discarded. A failure is also recorded on the exposure,
// whose next notification carries it ([Event].Err). For leases that
// staged nothing it does nothing.
func (l *Lease) Flush() error {
	st := l.st
	if st == nil || st.acc != AccessWrite {
		return nil
	}
	var err error
	for i, it := range st.items {
		if it.flushed {
			continue
		}
		st.items[i].flushed = true
		s, gerr := st.ss.get(it.dev)
		if gerr == nil {
			gerr = s.ToDevice(uintptr(it.addr), it.buf)
		}
		if gerr != nil {
			err = fmt.Errorf("%w: host to GPU %d [0x%x, +%d): %w", ErrStaging, it.dev, it.addr, len(it.buf), gerr)
			break
		}
	}
	if serr := st.ss.sync(); err == nil && serr != nil {
		err = fmt.Errorf("%w: host to GPU: %w", ErrStaging, serr)
	}
	if err != nil {
		e := l.e
		e.mu.Lock()
		if e.stageErr == nil {
			e.stageErr = err
		}
		e.mu.Unlock()
	}
	return err
}

// unstage waits for the lease's copies and gives its buffers back; what a
// WRITE lease staged and did not flush is discarded.
func (st *leaseStage) unstage(log func(error)) {
	if err := st.ss.release(); err != nil {
		log(err)
	}
	for _, b := range st.bufs {
		st.ds.leasePool.put(b)
	}
	st.items, st.bufs, st.cur = nil, nil, nil
}
