package agent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"math"
	"math/bits"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// stubBackend lets an agent start without moving any byte; tests drive the
// agent through the methods behind its Host as a backend would.
type stubBackend struct {
	name string

	mu          sync.Mutex
	registered  []Local
	deregisters int
}

func (b *stubBackend) Name() string                                    { return b.name }
func (b *stubBackend) Start(Host) ([]byte, error)                      { return []byte(b.name), nil }
func (b *stubBackend) Supports(k MemKind) bool                         { return k == KindDRAM }
func (b *stubBackend) Reachable(context.Context, Info) error           { return nil }
func (b *stubBackend) Post(w *Work) error                              { w.Finish(nil); return nil }
func (b *stubBackend) Notify(context.Context, Info, Key, []byte) error { return nil }
func (b *stubBackend) Close() error                                    { return nil }

// registrarBackend is a stubBackend that needs memory registered.
type registrarBackend struct{ stubBackend }

func (b *registrarBackend) RegisterMem(l Local) (any, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.registered = append(b.registered, l)
	return len(b.registered), nil
}

func (b *registrarBackend) DeregisterMem(any) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.deregisters++
	return nil
}

func newTestAgent(t *testing.T, bs ...Backend) *Agent {
	t.Helper()
	if len(bs) == 0 {
		bs = []Backend{&stubBackend{name: "stub"}}
	}
	a, err := New(WithBackends(bs...))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, a.Close()) })
	return a
}

func region(addr, n uint64) Local {
	return Device(uintptr(addr), int(n), KindVRAM, 0)
}

func TestRegionSetFind(t *testing.T) {
	set := newRegionSet([]Local{
		region(1000, 100),  // [1000, 1100)
		region(1100, 100),  // [1100, 1200), adjacent to the first
		region(2000, 1000), // [2000, 3000)
		region(2100, 50),   // [2100, 2150), inside the previous one
		region(2500, 1000), // [2500, 3500), overlapping [2000, 3000)
		region(math.MaxUint64-100, 100),
	})
	for _, c := range []struct {
		name    string
		addr, n uint64
		want    uint64 // the containing region's address; 0: none; 1: any containing one
	}{
		{"first byte", 1000, 1, 1000},
		{"whole region", 1000, 100, 1000},
		{"last byte", 1099, 1, 1000},
		{"adjacent region's first byte", 1100, 1, 1100},
		{"across adjacent regions", 1050, 100, 0},
		{"one byte past the adjacent regions", 1100, 101, 0},
		{"before everything", 0, 10, 0},
		{"just before the first", 999, 1, 0},
		{"straddling the start", 999, 2, 0},
		{"in a gap", 1500, 10, 0},
		{"straddling a gap", 1150, 900, 0},
		{"nested: inside both", 2100, 50, 2100},
		{"nested: only the outer", 2140, 20, 2000},
		{"overlapping: only the first", 2000, 600, 2000},
		{"overlapping: both", 2500, 500, 1},
		{"overlapping: only the second, found past the nested one", 2990, 20, 2500},
		{"overlapping: in neither alone", 1999, 1600, 0},
		{"past the overlapping", 3400, 100, 2500},
		{"past the end", 3500, 1, 0},
		{"top of the address space", math.MaxUint64 - 100, 100, math.MaxUint64 - 100},
		{"zero length", 1000, 0, 0},
		{"addr+n overflows", math.MaxUint64 - 50, 100, 0},
		{"addr+n wraps to a mapped address", math.MaxUint64 - 50, 1050, 0},
		{"huge n", 1000, math.MaxUint64, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, ok := set.find(c.addr, c.n)
			if c.want == 0 {
				assert.False(t, ok, "found region %+v", r.Region)
				return
			}
			require.True(t, ok)
			if c.want != 1 {
				assert.Equal(t, c.want, r.Addr)
			}
			assert.True(t, r.Addr <= c.addr && c.addr+c.n <= r.End(), "[%d, +%d) not in %+v", c.addr, c.n, r.Region)
		})
	}
}

func TestRegionSetFindMatchesLinearScan(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 200 {
		var ls []Local
		for range 1 + rng.IntN(40) {
			ls = append(ls, region(uint64(rng.IntN(10000)), uint64(1+rng.IntN(800))))
		}
		set := newRegionSet(ls)
		for range 200 {
			addr, n := uint64(rng.IntN(11000)), uint64(rng.IntN(900))
			want := false
			for _, l := range ls {
				if n > 0 && l.Addr <= addr && addr+n <= l.End() {
					want = true
				}
			}
			r, ok := set.find(addr, n)
			require.Equal(t, want, ok, "round %d: [%d, +%d) in %v", round, addr, n, ls)
			if ok {
				require.True(t, r.Addr <= addr && addr+n <= r.End())
			}
		}
	}
}

func TestKeysAreRandomAndUnique(t *testing.T) {
	const n = 20000
	seen := make(map[Key]bool, n)
	var ones [128]int
	for range n {
		k := NewKey()
		require.False(t, seen[k], "key %v issued twice", k)
		require.NotEqual(t, Key{}, k)
		seen[k] = true
		for i, b := range k {
			for j := range 8 {
				ones[i*8+j] += int(b >> j & 1)
			}
		}
	}
	// Each bit is set in about half the keys: 10 standard deviations.
	for i, c := range ones {
		assert.InDelta(t, n/2, c, 10*math.Sqrt(n)/2, "bit %d set in %d of %d keys", i, c, n)
	}
	// Keys of exposures differ too, and hamming distances look random.
	a := newTestAgent(t)
	buf := make([]byte, 16)
	e1, err := a.Expose(AccessRead, []Local{DRAM(buf)})
	require.NoError(t, err)
	e2, err := a.Expose(AccessRead, []Local{DRAM(buf)})
	require.NoError(t, err)
	require.NotEqual(t, e1.Key(), e2.Key())
	d := 0
	for i := range e1.Key() {
		d += bits.OnesCount8(e1.Key()[i] ^ e2.Key()[i])
	}
	assert.Greater(t, d, 20, "hamming distance between two keys")
}

func TestKeyStringIsAFingerprint(t *testing.T) {
	k := Key{0xde, 0xad, 0xbe, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0xfe, 0xdc, 0xba, 0x98}
	s := k.String()
	sum := sha256.Sum256(k[:])
	assert.Equal(t, "sha256:"+hex.EncodeToString(sum[:4]), s, "the first 4 bytes of the key's SHA-256")
	for i := 0; i+2 <= len(k); i++ {
		assert.NotContains(t, s, hex.EncodeToString(k[i:i+2]), "no 2 bytes of the key appear")
	}

	// ErrAccessDenied names the exposure by the same fingerprint.
	a := newTestAgent(t)
	_, err := a.open(NewLink(uuid.New()), k, AccessRead, false)
	require.ErrorIs(t, err, ErrAccessDenied)
	assert.Contains(t, err.Error(), s)
	assert.NotContains(t, err.Error(), "deadbeef")
}

func TestRevokeWaitsForLeases(t *testing.T) {
	a := newTestAgent(t)
	peer := uuid.New()
	buf := make([]byte, 4096)
	e, err := a.Expose(AccessWrite, []Local{DRAM(buf)})
	require.NoError(t, err)

	var leases []Lease
	for range 3 {
		l, err := a.open(NewLink(peer), e.Key(), AccessWrite, false)
		require.NoError(t, err)
		leases = append(leases, l)
	}
	assert.Equal(t, peer, e.Peer(), "the first lease binds the exposure to its peer")

	revoked := make(chan struct{})
	go func() {
		e.Revoke()
		close(revoked)
	}()
	// Revoke refuses new leases at once...
	require.Eventually(t, func() bool {
		l, err := a.open(NewLink(peer), e.Key(), AccessWrite, false)
		if err == nil {
			l.Release() // Revoke has not begun yet
		}
		return errors.Is(err, ErrAccessDenied)
	}, 10*time.Second, time.Millisecond)

	// ...but returns only once every outstanding lease is released, which
	// may still touch the memory meanwhile.
	for i, l := range leases {
		mem, err := l.Slice(e.set.regs[0].Addr, 16)
		require.NoError(t, err)
		mem[0] = byte(i)
		select {
		case <-revoked:
			t.Fatalf("Revoke returned with %d leases outstanding", len(leases)-i)
		case <-time.After(20 * time.Millisecond):
		}
		l.Release()
		l.Release() // idempotent: must not release another lease's count
	}
	select {
	case <-revoked:
	case <-time.After(10 * time.Second):
		t.Fatal("Revoke did not return after every lease was released")
	}
	assert.Equal(t, byte(len(leases)-1), buf[0])
	e.mu.Lock()
	assert.Equal(t, 0, e.leases)
	e.mu.Unlock()
	e.Revoke() // idempotent, and returns at once
}

func TestRevokeWithoutLeasesReturnsAtOnce(t *testing.T) {
	a := newTestAgent(t)
	e, err := a.Expose(AccessRead, []Local{DRAM(make([]byte, 8))})
	require.NoError(t, err)
	done := make(chan struct{})
	go func() { e.Revoke(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Revoke of an unused exposure blocked")
	}
}

func TestOpenRefusalsAreCounted(t *testing.T) {
	a := newTestAgent(t)
	peer := uuid.New()
	buf := make([]byte, 4096)
	reg := DRAM(buf)
	e, err := a.Expose(AccessRead, []Local{reg})
	require.NoError(t, err)
	gone, err := a.Expose(AccessRead, []Local{reg})
	require.NoError(t, err)
	gone.Revoke()

	for _, c := range []struct {
		name string
		key  Key
		acc  Access
	}{
		{"unknown key", NewKey(), AccessRead},
		{"zero key", Key{}, AccessRead},
		{"wrong access", e.Key(), AccessWrite},
		{"revoked", gone.Key(), AccessRead},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := a.Stats().Refused
			l, err := a.open(NewLink(peer), c.key, c.acc, false)
			require.ErrorIs(t, err, ErrAccessDenied)
			require.Zero(t, l, "a refused Open grants no lease")
			assert.Equal(t, before+1, a.Stats().Refused)
		})
	}
	assert.Equal(t, uuid.Nil, e.Peer(), "a refused lease binds nothing")

	l, err := a.open(NewLink(peer), e.Key(), AccessRead, false)
	require.NoError(t, err)
	defer l.Release()
	assert.Equal(t, AccessRead, l.Access())
	for _, c := range []struct {
		name    string
		addr, n uint64
	}{
		{"before", reg.Addr - 1, 2},
		{"after", reg.End() - 1, 2},
		{"far away", reg.End() + 1<<20, 1},
		{"empty", reg.Addr, 0},
		{"overflow", reg.Addr, math.MaxUint64},
	} {
		t.Run("slice "+c.name, func(t *testing.T) {
			before := a.Stats().Refused
			mem, err := l.Slice(c.addr, c.n)
			require.ErrorIs(t, err, ErrAccessDenied)
			require.Nil(t, mem)
			assert.Equal(t, before+1, a.Stats().Refused)
		})
	}
	mem, err := l.Slice(reg.Addr+10, 20)
	require.NoError(t, err)
	assert.Len(t, mem, 20)
	assert.Equal(t, 20, cap(mem), "a slice must not reach past what was asked")

	before := a.Stats().Refused
	a.refused.Add(1)
	assert.Equal(t, before+1, a.Stats().Refused, "Host.Refused counts")
}

func TestOpenOnClosingAgentReportsLoss(t *testing.T) {
	a, err := New(WithBackends(&stubBackend{name: "stub"}))
	require.NoError(t, err)
	e, err := a.Expose(AccessRead, []Local{DRAM(make([]byte, 8))})
	require.NoError(t, err)
	require.NoError(t, a.Close())
	before := a.Stats().Refused
	_, err = a.open(NewLink(uuid.New()), e.Key(), AccessRead, false)
	require.ErrorIs(t, err, ErrRemoteLost, "a closed agent is lost to its peers, not refusing them")
	assert.Equal(t, before, a.Stats().Refused, "a closing agent's refusals are no abuse")
}

func TestDispatch(t *testing.T) {
	a := newTestAgent(t)
	peer := uuid.New()
	e, err := a.Expose(AccessWrite, []Local{DRAM(make([]byte, 8))})
	require.NoError(t, err)

	t.Run("unknown key is dropped", func(t *testing.T) {
		before := a.Stats().DroppedNotifications
		require.True(t, a.deliver(NewLink(peer), NewKey(), []byte("nobody")))
		assert.Equal(t, before+1, a.Stats().DroppedNotifications)
	})
	t.Run("known key", func(t *testing.T) {
		msg := []byte("done")
		require.True(t, a.deliver(NewLink(peer), e.Key(), msg))
		select {
		case ev := <-e.Events():
			assert.Equal(t, Event{Kind: EventNotify, From: peer, Msg: msg}, ev)
		case <-time.After(10 * time.Second):
			t.Fatal("no event")
		}
		assert.Equal(t, peer, e.Peer(), "a notification binds the exposure to its sender")
	})
	t.Run("full queue drops", func(t *testing.T) {
		before := a.Stats().DroppedNotifications
		for range eventBuffer + 3 {
			require.True(t, a.deliver(NewLink(peer), e.Key(), []byte("x")))
		}
		assert.Equal(t, before+3, a.Stats().DroppedNotifications)
		assert.Len(t, e.Events(), eventBuffer)
		for range eventBuffer {
			<-e.Events()
		}
	})
	t.Run("revoked key is dropped", func(t *testing.T) {
		r, err := a.Expose(AccessRead, []Local{DRAM(make([]byte, 8))})
		require.NoError(t, err)
		r.Revoke()
		before := a.Stats().DroppedNotifications
		require.True(t, a.deliver(NewLink(peer), r.Key(), []byte("late")))
		assert.Equal(t, before+1, a.Stats().DroppedNotifications)
		assert.Empty(t, r.Events())
	})
}

func TestLinkLostReachesOnlyTheExposuresItUsed(t *testing.T) {
	a := newTestAgent(t)
	lost, other := uuid.New(), uuid.New()
	mk := func() *Exposure {
		e, err := a.Expose(AccessRead, []Local{DRAM(make([]byte, 8))})
		require.NoError(t, err)
		return e
	}
	byLease, byNotify, others, unbound := mk(), mk(), mk(), mk()
	link, otherLink := NewLink(lost), NewLink(other)
	l, err := a.open(link, byLease.Key(), AccessRead, false)
	require.NoError(t, err)
	l.Release()
	require.True(t, a.deliver(link, byNotify.Key(), nil))
	l, err = a.open(otherLink, others.Key(), AccessRead, false)
	require.NoError(t, err)
	l.Release()
	<-byNotify.Events()

	cause := errors.New("connection reset")
	a.linkLost(link, cause)
	a.linkLost(otherLink, nil)
	for _, e := range []*Exposure{byLease, byNotify} {
		require.Len(t, e.Events(), 1)
		ev := <-e.Events()
		assert.Equal(t, EventPeerLost, ev.Kind)
		assert.Equal(t, lost, ev.From)
		assert.Equal(t, cause, ev.Err)
	}
	require.Len(t, others.Events(), 1)
	ev := <-others.Events()
	assert.ErrorIs(t, ev.Err, ErrRemoteLost, "LinkLost with a nil cause reports ErrRemoteLost")
	assert.Empty(t, unbound.Events())

	a.linkLost(link, cause)
	assert.Empty(t, byLease.Events(), "a link is lost once")
}

// Agent IDs are public (tokens, the registry), so a channel that claims a
// peer's ID but never presented a key must not fail that peer's exposures
// when it ends: only the channels the peer used with the key report its
// loss. (A stranger claiming the reader's ID over tcp and hanging up used
// to fail a READ that succeeded over cma.)
func TestStrangerClaimingAPeersIDCannotFailItsExposures(t *testing.T) {
	a := newTestAgent(t)
	peer := uuid.New()
	e, err := a.Expose(AccessRead, []Local{DRAM(make([]byte, 8))})
	require.NoError(t, err)
	used := NewLink(peer)
	l, err := a.open(used, e.Key(), AccessRead, false)
	require.NoError(t, err)
	l.Release()

	stranger := NewLink(peer) // same claimed ID, another channel
	_, err = a.open(stranger, NewKey(), AccessRead, false)
	require.ErrorIs(t, err, ErrAccessDenied)
	require.True(t, a.deliver(stranger, NewKey(), []byte("forged")))
	a.linkLost(stranger, errors.New("stranger hung up"))
	assert.Empty(t, e.Events(), "a link that never presented the key reported the peer lost")

	a.linkLost(used, nil)
	require.Len(t, e.Events(), 1, "the link the peer used reports its loss")
}

// A link with no peer, or the zero Link, binds nothing and is lost to
// nobody (backends that never learned a peer's identity report such links).
func TestLinkLostOfNilPeerReachesNoUnboundExposure(t *testing.T) {
	a := newTestAgent(t)
	e, err := a.Expose(AccessRead, []Local{DRAM(make([]byte, 8))})
	require.NoError(t, err)
	a.linkLost(NewLink(uuid.Nil), nil)
	a.linkLost(Link{}, nil)
	assert.Empty(t, e.Events())
}

func TestDeliverAfterClose(t *testing.T) {
	a, err := New(WithBackends(&stubBackend{name: "stub"}))
	require.NoError(t, err)
	e, err := a.Expose(AccessRead, []Local{DRAM(make([]byte, 8))})
	require.NoError(t, err)
	require.NoError(t, a.Close())
	for range 100 {
		require.False(t, a.deliver(NewLink(uuid.New()), e.Key(), []byte("late")), "Deliver on a closed agent")
	}
	a.linkLost(NewLink(uuid.New()), nil) // must not block
}

func TestCloseWaitsForLeasesAndRefusesUse(t *testing.T) {
	a, err := New(WithBackends(&stubBackend{name: "stub"}))
	require.NoError(t, err)
	buf := make([]byte, 64)
	e, err := a.Expose(AccessRead, []Local{DRAM(buf)})
	require.NoError(t, err)
	l, err := a.open(NewLink(uuid.New()), e.Key(), AccessRead, false)
	require.NoError(t, err)

	closed := make(chan error, 1)
	go func() { closed <- a.Close() }()
	select {
	case <-closed:
		t.Fatal("Close returned while a lease on one of its exposures was held")
	case <-time.After(20 * time.Millisecond):
	}
	l.Release()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the lease was released")
	}
	require.NoError(t, a.Close(), "Close is idempotent")

	_, err = a.Expose(AccessRead, []Local{DRAM(buf)})
	assert.ErrorIs(t, err, ErrClosed)
	_, err = a.Register(DRAM(buf))
	assert.ErrorIs(t, err, ErrClosed)
	assert.ErrorIs(t, a.Notify(context.Background(), Info{ID: uuid.New()}, e.Key(), nil), ErrClosed)
}

func TestPostValidates(t *testing.T) {
	a := newTestAgent(t)
	peer := Info{ID: uuid.New(), Conns: []ConnInfo{{Backend: "stub"}}}
	buf := make([]byte, 64)
	seg := Segment{Local: DRAM(buf), Remote: Region{Addr: 0x1000, Len: 64}}
	for _, c := range []struct {
		name string
		req  Request
	}{
		{"bad op", Request{Op: 0, Peer: peer, Segments: []Segment{seg}}},
		{"no peer", Request{Op: OpRead, Segments: []Segment{seg}}},
		{"no segments", Request{Op: OpRead, Peer: peer}},
		{"length mismatch", Request{Op: OpRead, Peer: peer, Segments: []Segment{seg, {Local: DRAM(buf), Remote: Region{Addr: 0x2000, Len: 63}}}}},
		{"empty local", Request{Op: OpWrite, Peer: peer, Segments: []Segment{{Local: Local{Region: Region{Addr: 0x1000}}}}}},
		{"DRAM bytes do not match the region", Request{Op: OpWrite, Peer: peer, Segments: []Segment{{Local: Local{Region: Region{Addr: 0x1000, Len: 64}, Mem: buf}, Remote: Region{Addr: 0x1000, Len: 64}}}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			x, err := a.Post(context.Background(), c.req)
			require.ErrorIs(t, err, ErrInvalid)
			require.Nil(t, x)
		})
	}
	t.Run("forced backend not configured", func(t *testing.T) {
		_, err := a.Post(context.Background(), Request{Op: OpRead, Peer: peer, Segments: []Segment{seg}, Backend: "nope"})
		require.ErrorIs(t, err, ErrNoBackend)
	})
	t.Run("valid", func(t *testing.T) {
		x, err := a.Post(context.Background(), Request{Op: OpRead, Peer: peer, Segments: []Segment{seg, seg}})
		require.NoError(t, err)
		<-x.Done()
		require.NoError(t, x.Err())
		assert.Equal(t, uint64(128), x.Bytes())
		assert.Equal(t, "stub", x.Backend())
	})
}

func TestRegistrationIsReferenceCounted(t *testing.T) {
	b := &registrarBackend{stubBackend{name: "reg"}}
	a := newTestAgent(t, b)
	buf := make([]byte, 4096)
	l := DRAM(buf)
	other := DRAM(buf[:100]) // overlapping, but another region

	r1, err := a.Register(l)
	require.NoError(t, err)
	r2, err := a.Register(l)
	require.NoError(t, err)
	r3, err := a.Register(other)
	require.NoError(t, err)
	regions, refs := a.Registered()
	assert.Equal(t, 2, regions)
	assert.Equal(t, 3, refs)
	assert.Len(t, b.registered, 2, "the backend registers each region once")

	require.NoError(t, r1.Release())
	require.NoError(t, r1.Release()) // idempotent
	regions, refs = a.Registered()
	assert.Equal(t, 2, regions, "the other reference keeps the region registered")
	assert.Equal(t, 2, refs)
	assert.Equal(t, 0, b.deregisters)

	require.NoError(t, r2.Release())
	require.NoError(t, r3.Release())
	regions, refs = a.Registered()
	assert.Equal(t, 0, regions)
	assert.Equal(t, 0, refs)
	assert.Equal(t, 2, b.deregisters)

	_, err = a.Register(Local{Region: Region{Addr: 1, Len: 0}})
	assert.ErrorIs(t, err, ErrInvalid)
}

func TestNewRejects(t *testing.T) {
	_, err := New()
	assert.ErrorIs(t, err, ErrInvalid, "no backend")
	_, err = New(WithBackends(&stubBackend{name: "x"}, &stubBackend{name: "x"}))
	assert.ErrorIs(t, err, ErrInvalid, "duplicate backend")
	_, err = New(WithID(uuid.Nil), WithBackends(&stubBackend{name: "x"}))
	assert.ErrorIs(t, err, ErrInvalid, "nil ID")
}

func TestRegionSetIsSorted(t *testing.T) {
	set := newRegionSet([]Local{region(300, 1), region(100, 1), region(200, 1)})
	assert.True(t, sort.SliceIsSorted(set.regs, func(i, j int) bool { return set.regs[i].Addr < set.regs[j].Addr }))
}

// heldBackend keeps every transfer until it is cancelled, then finishes it
// with the cancel error, as a real backend would.
type heldBackend struct{ stubBackend }

func (b *heldBackend) Post(w *Work) error {
	go func() {
		<-w.Cancelled()
		w.Finish(w.CancelErr())
	}()
	return nil
}

func TestPeerDepartedAbortsItsTransfers(t *testing.T) {
	a := newTestAgent(t, &heldBackend{stubBackend{name: "held"}})
	gone := Info{ID: uuid.New(), Conns: []ConnInfo{{Backend: "held"}}}
	stays := Info{ID: uuid.New(), Conns: []ConnInfo{{Backend: "held"}}}
	buf := make([]byte, 64)
	post := func(peer Info) *Xfer {
		x, err := a.Post(context.Background(), Request{Op: OpRead, Peer: peer, Segments: []Segment{{Local: DRAM(buf), Remote: Region{Addr: 0x1000, Len: 64}}}})
		require.NoError(t, err)
		return x
	}
	x1, x2, other := post(gone), post(gone), post(stays)
	e, err := a.Expose(AccessRead, []Local{DRAM(buf)})
	require.NoError(t, err)
	defer e.Revoke()
	a.deliver(NewLink(gone.ID), e.Key(), []byte("bind")) // e is now bound to gone
	<-e.Events()

	a.PeerDeparted(gone.ID, errors.New("registry: no heartbeat for 2s"))
	for _, x := range []*Xfer{x1, x2} {
		<-x.Done()
		require.ErrorIs(t, x.Err(), ErrRemoteLost)
		assert.NotErrorIs(t, x.Err(), ErrCancelled, "a departure is not a cancellation")
		assert.ErrorContains(t, x.Err(), "no heartbeat for 2s")
	}
	select {
	case <-other.Done():
		t.Fatal("a transfer with another peer was aborted")
	default:
	}
	ev := <-e.Events()
	assert.Equal(t, EventPeerLost, ev.Kind)
	require.ErrorIs(t, ev.Err, ErrRemoteLost)

	other.Cancel(nil)
	<-other.Done()
	require.ErrorIs(t, other.Err(), ErrCancelled)
}

// A burst of registrations does not pin its peak map size: once most are
// released the map is rebuilt, keeping every live entry and its references.
// Bursts of up to 16384 regions (a KV hand-off of 4096 blocks per
// operation) keep their map: rebuilt after each, it would regrow each time.
func TestRegistrationMapShrinks(t *testing.T) {
	// The per-region map is kept only when a backend registers memory.
	a := newTestAgent(t, &registrarBackend{stubBackend{name: "reg"}})
	mem := make([]byte, 40000) // past the floor (16384) below which the map is kept
	ls := make([]Local, len(mem))
	for i := range mem {
		ls[i] = DRAM(mem[i : i+1])
	}
	keep, err := a.Register(ls[:100]...)
	require.NoError(t, err)
	twice, err := a.Register(ls[:10]...)
	require.NoError(t, err)
	burst, err := a.Register(ls[100:]...)
	require.NoError(t, err)
	regions, refs := a.Registered()
	require.Equal(t, len(ls), regions)
	require.Equal(t, len(ls)+10, refs)

	require.NoError(t, burst.Release())
	regions, refs = a.Registered()
	assert.Equal(t, 100, regions)
	assert.Equal(t, 110, refs)
	a.regMu.Lock()
	peak := a.regsPeak
	a.regMu.Unlock()
	assert.Equal(t, 100, peak, "the map was rebuilt at its live size")

	require.NoError(t, twice.Release())
	require.NoError(t, keep.Release())
	regions, refs = a.Registered()
	assert.Zero(t, regions)
	assert.Zero(t, refs)
}
