//go:build linux

package cma

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// exposeRead exposes n bytes of a pattern on p for READ until the test
// ends.
func exposeRead(t testing.TB, p *agent.Agent, n int) ([]byte, *agent.Exposure) {
	t.Helper()
	src := make([]byte, n)
	for i := range src {
		src[i] = byte(i * 13)
	}
	e, err := p.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	t.Cleanup(e.Revoke)
	return src, e
}

// readSlices posts n READs at once, each on a goroutine of its own: READ
// i copies the size bytes of remote at offset i*size into the same bytes
// of dst. It returns them, nil where Post failed (the test then fails).
func readSlices(t *testing.T, a *agent.Agent, peer agent.Info, key agent.Key, dst []byte, remote agent.Region, n, size int) []*agent.Xfer {
	t.Helper()
	xs := make([]*agent.Xfer, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: peer, Key: key,
				Segments: []agent.Segment{{Local: agent.DRAM(dst[i*size : (i+1)*size]), Remote: agent.Region{Addr: remote.Addr + uint64(i*size), Len: uint64(size)}}}})
			if assert.NoError(t, err) {
				xs[i] = x
			}
		}()
	}
	close(start)
	wg.Wait()
	return xs
}

// waitAll waits for every transfer of xs that is not nil, for at most d
// each, and returns how many failed and the first failure.
func waitAll(t testing.TB, xs []*agent.Xfer, d time.Duration, what string) (failed int, first error) {
	t.Helper()
	for _, x := range xs {
		if x == nil {
			continue
		}
		backendtest.DoneWithin(t, x, d, what)
		if err := x.Err(); err != nil {
			if failed++; first == nil {
				first = err
			}
		}
	}
	return failed, first
}

// When the copying side drops its control connection itself (a registry
// departure) while its workers copy, the exposing side's Revoke may return
// only once no copy can touch the memory any more: no byte of a WRITE lands
// after Revoke returned, and no byte a READ copies was written after it.
func TestNoCopyAfterRevokeOnDeparture(t *testing.T) {
	const size = 64 << 20
	for _, op := range []agent.Op{agent.OpWrite, agent.OpRead} {
		t.Run(op.String(), func(t *testing.T) {
			opts := []Option{WithChunkSize(size), WithLeaseSize(size), WithWorkers(2)}
			a, _ := newAgent(t, opts...)
			p, _ := newAgent(t, opts...)
			local, exposed := make([]byte, size), make([]byte, size)
			for i := range local {
				local[i] = 0xAA
			}
			for range 3 {
				clear(exposed)
				if op == agent.OpRead {
					for i := range exposed {
						exposed[i] = 0x11
					}
					clear(local)
				}
				e, err := p.Expose(op.Access(), []agent.Local{agent.DRAM(exposed)})
				require.NoError(t, err)
				x, err := a.Post(context.Background(), agent.Request{Op: op, Peer: p.Info(), Key: e.Key(),
					Segments: []agent.Segment{{Local: agent.DRAM(local), Remote: agent.DRAM(exposed).Region}}})
				require.NoError(t, err)
				started := func() bool { // the copy's first bytes are in
					if op == agent.OpWrite {
						return atomicLoad(&exposed[0]) == 0xAA
					}
					return atomicLoad(&local[0]) == 0x11
				}
				for !started() && !backendtest.Finished(x) {
					runtime.Gosched()
				}
				a.PeerDeparted(p.ID(), errors.New("registry: entry deleted"))
				e.Revoke()
				snap := bytes.Clone(exposed)
				if op == agent.OpRead {
					for i := len(exposed) - 1; i >= 0; i-- {
						exposed[i] = 0x22 // reused at once, from the end: ahead of a copy in flight
					}
				}
				backendtest.DoneWithin(t, x, 20*time.Second, "departure")
				if op == agent.OpWrite {
					require.True(t, bytes.Equal(snap, exposed), "bytes landed in exposed memory after Revoke returned (transfer: %v)", x.Err())
				} else {
					require.Equal(t, -1, bytes.IndexByte(local, 0x22), "a READ copied memory reused after Revoke returned (transfer: %v)", x.Err())
				}
			}
		})
	}
}

// atomicLoad reads a byte another process may be writing.
func atomicLoad(b *byte) byte {
	return byte(atomic.LoadUint32((*uint32)(unsafe.Pointer(uintptr(unsafe.Pointer(b))&^3))) >> (8 * (uintptr(unsafe.Pointer(b)) & 3)))
}

func uintptrOf[T any](p *T) uintptr { return uintptr(unsafe.Pointer(p)) }

// One-chunk transfers posted while the peer departs, again and again: every
// transfer finishes, and Close returns.
func TestDepartureWhilePostingSmall(t *testing.T) {
	a, _ := newAgent(t)
	p, _ := newAgent(t)
	src := make([]byte, 4096)
	e, err := p.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	defer e.Revoke()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var xs []*agent.Xfer
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dst := make([]byte, 4096)
			for {
				select {
				case <-stop:
					return
				default:
				}
				x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: p.Info(), Key: e.Key(),
					Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src).Region}}})
				if err != nil {
					continue
				}
				mu.Lock()
				xs = append(xs, x)
				mu.Unlock()
				<-x.Done()
			}
		}()
	}
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		a.PeerDeparted(p.ID(), errors.New("registry: late heartbeat"))
		time.Sleep(time.Duration(time.Now().UnixNano()%7) * 50 * time.Microsecond)
	}
	close(stop)
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-time.After(20 * time.Second):
		t.Fatal("transfers posted during departures never finished")
	}
	require.NoError(t, backendtest.CloseWithin(t, a, 20*time.Second, "after the departures"))
	t.Logf("%d transfers posted during departures", len(xs))
}

// Many small READs at once from one agent to one peer all succeed, and
// the exposing side counts nothing against the honest peer.
func TestManyConcurrentSmallReads(t *testing.T) {
	a, _ := newAgent(t)
	p, pb := newAgent(t)
	const n = 1024
	src, e := exposeRead(t, p, n*4096)
	before := pb.Stats()
	for round := range 3 {
		dst := make([]byte, len(src))
		xs := readSlices(t, a, p.Info(), e.Key(), dst, agent.DRAM(src).Region, n, 4096)
		failed, first := waitAll(t, xs, 30*time.Second, "concurrent small reads")
		require.Zero(t, failed, "round %d: %d of %d concurrent 4 KiB READs failed, first: %v", round, failed, n, first)
		require.Equal(t, src, dst)
	}
	assert.Equal(t, Stats{}, delta(pb.Stats(), before), "the exposing side counted an honest peer's fault")
}

// An exposing side that never answers our lease request but sends answers
// to requests nobody made breaks the protocol: the transfer fails at once,
// instead of living as long as the stray answers keep coming.
func TestStrayGrantsFailTheTransfer(t *testing.T) {
	f := newFakeExposer(t, func(c *net.UnixConn, br *bufio.Reader) {
		// The strays start once the transfer asked for its lease: strays
		// before any request drop the connection before Post can use it.
		asked, ended := make(chan struct{}), make(chan struct{})
		var once sync.Once
		go func() {
			defer close(ended)
			readFrames(c, br, func(*frame) { once.Do(func() { close(asked) }) })
		}()
		select {
		case <-asked:
		case <-ended:
			return
		}
		b := make([]byte, hdrSize)
		for id := uint64(1 << 60); ; id++ {
			(&header{typ: tGrant, status: stOK, id: id}).put(b)
			if _, err := c.Write(b); err != nil {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	a, b := newAgent(t, WithTimeout(time.Second))
	before := b.Stats()
	for _, size := range []int{4096, 8 << 20} { // one chunk; several leases
		dst := make([]byte, size)
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: f.info, Key: agent.NewKey(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.Region{Addr: 4096, Len: uint64(size)}}}})
		require.NoError(t, err)
		backendtest.DoneWithin(t, x, 10*time.Second, "stray grants")
		require.ErrorIs(t, x.Err(), agent.ErrRemoteLost)
		require.ErrorContains(t, x.Err(), "awaits none")
	}
	d := delta(b.Stats(), before)
	assert.Equal(t, uint64(2), d.ProtocolErrors) // one per connection
	assert.Equal(t, d.ProtocolErrors, d.Disconnected)
}

// Cancel ends a transfer whose lease request is unanswered at once, not at
// the timeout, and a grant that arrives later touches nothing.
func TestCancelUnansweredLease(t *testing.T) {
	type held struct {
		c  *net.UnixConn
		id uint64
	}
	begun := make(chan held, 16)
	f := newFakeExposer(t, func(c *net.UnixConn, br *bufio.Reader) {
		readFrames(c, br, func(f *frame) {
			if f.typ == tBegin {
				begun <- held{c, f.id}
			}
		})
	})
	a, _ := newAgent(t, WithTimeout(time.Minute), WithChunkSize(16<<10))
	src := bytes.Repeat([]byte{0x5A}, 64<<10)    // the fake exposer's memory: this process's
	for _, size := range []int{4096, 64 << 10} { // one chunk; several
		dst := make([]byte, size)
		x, err := a.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: f.info, Key: agent.NewKey(),
			Segments: []agent.Segment{{Local: agent.DRAM(dst), Remote: agent.DRAM(src[:size]).Region}}})
		require.NoError(t, err)
		h := <-begun
		x.Cancel(nil)
		backendtest.DoneWithin(t, x, 5*time.Second, "cancel")
		require.ErrorIs(t, x.Err(), agent.ErrCancelled)
		b := make([]byte, hdrSize) // grant it now: nothing may be copied any more
		(&header{typ: tGrant, status: stOK, id: h.id}).put(b)
		_, err = h.c.Write(b)
		require.NoError(t, err)
		time.Sleep(50 * time.Millisecond)
		require.Equal(t, -1, bytes.IndexByte(dst, 0x5A), "bytes copied after the transfer finished")
		for len(begun) > 0 {
			<-begun
		}
	}
}

// When the exposing side drops a connection that holds a lease (here for a
// malformed frame), Revoke waits until the copying side has closed its end,
// which it does once no copy runs, or until the timeout: the drop alone is
// no proof that the copier stopped.
func TestDropWithLeaseWaitsForPeer(t *testing.T) {
	for _, how := range []string{"PeerCloses", "PeerStays"} {
		t.Run(how, func(t *testing.T) {
			const timeout = 500 * time.Millisecond
			_, exp, p, _ := holdLease(t, WithTimeout(timeout))
			p.send(header{typ: 42}, nil, nil) // dropped for this
			_, err := p.br.ReadByte()
			require.ErrorIs(t, err, io.EOF, "the exposing side shuts its end")
			start := time.Now()
			revoked := make(chan struct{})
			go func() { exp.Revoke(); close(revoked) }()
			select {
			case <-revoked:
				t.Fatal("Revoke returned while the dropped peer could still copy")
			case <-time.After(timeout / 5):
			}
			if how == "PeerCloses" {
				_ = p.c.Close()
				select {
				case <-revoked:
				case <-time.After(timeout / 2):
					t.Fatal("Revoke did not return when the peer closed its end")
				}
				return
			}
			select {
			case <-revoked:
				require.GreaterOrEqual(t, time.Since(start), timeout/2)
			case <-time.After(10 * timeout):
				t.Fatal("Revoke waited past the timeout for a peer that keeps its end open")
			}
		})
	}
}
