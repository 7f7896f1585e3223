package connect

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backend/tcp"
)

func TestTransfer(t *testing.T) {
	mixed := make([]int, 4096)
	for i := range mixed {
		mixed[i] = (i%8 + 1) * 512
	}
	layouts := []struct {
		name  string
		sizes []int
	}{
		{"1 region", []int{3<<20 + 5}},
		{"4096 regions", mixed},
	}
	for _, backend := range transferBackends {
		for _, kind := range []OperationKind{KindRead, KindWrite} {
			for _, l := range layouts {
				t.Run(backend+"/"+kind.String()+"/"+l.name, func(t *testing.T) {
					ctx := guarded(t)
					passive, activeConn := pair(t, backend)
					src, dst := buffers(l.sizes, 1), buffers(l.sizes, 0)
					exposed, local := src, dst
					if kind == KindWrite {
						exposed, local = dst, src
					}
					pop := expose(t, passive, kind, exposed)
					assert.Equal(t, StatusInitialized, pop.Status())

					// The token crosses a process boundary as text.
					md, err := ParseMetadata(pop.Metadata().Text())
					require.NoError(t, err)
					require.Equal(t, l.sizes, md.Sizes())

					aop := moved(t, ctx, activeConn, md, local)
					assert.Equal(t, StatusComplete, aop.Status())
					assert.Equal(t, backend, aop.Backend())
					requireUnregistered(t, activeConn)

					require.NoError(t, pop.Wait(ctx), "passive Wait after the active side completed")
					assert.Equal(t, StatusComplete, pop.Status())
					requireSame(t, src, dst)

					require.NoError(t, pop.Close())
					require.NoError(t, pop.Wait(ctx), "a completed operation keeps its outcome after Close")
					requireUnregistered(t, passive)
				})
			}
		}
	}
}

func TestPassiveWaitsFirst(t *testing.T) {
	for _, backend := range transferBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive, activeConn := pair(t, backend)
			src, dst := buffers([]int{1 << 20, 100}, 3), buffers([]int{1 << 20, 100}, 0)
			pop := expose(t, passive, KindRead, src)
			waited := make(chan error, 1)
			go func() { waited <- pop.Wait(ctx) }()

			moved(t, ctx, activeConn, pop.Metadata(), dst)
			require.NoError(t, <-waited)
			requireSame(t, src, dst)
		})
	}
}

func TestKindMismatch(t *testing.T) {
	ctx := guarded(t)
	passive, activeConn := pair(t, "mem")
	src := buffers([]int{64}, 1)
	readable := expose(t, passive, KindRead, src)
	writable := expose(t, passive, KindWrite, src)

	_, err := activeConn.BeginWrite(ctx, readable.Metadata(), descriptors(buffers([]int{64}, 2))...)
	require.ErrorIs(t, err, ErrKindMismatch)
	assert.EqualError(t, err, "connect: operation kind mismatch: BeginWrite needs a WRITE token, got a READ token")

	dst := buffers([]int{64}, 0)
	_, err = activeConn.BeginRead(ctx, writable.Metadata(), descriptors(dst)...)
	require.ErrorIs(t, err, ErrKindMismatch)
	assert.EqualError(t, err, "connect: operation kind mismatch: BeginRead needs a READ token, got a WRITE token")

	requireSame(t, buffers([]int{64}, 1), src)
	requireSame(t, buffers([]int{64}, 0), dst)
	requireUnregistered(t, activeConn)
	assert.Equal(t, StatusInitialized, readable.Status())
}

func TestSizeMismatch(t *testing.T) {
	remote := []int{4096, 4096, 4096, 32768}
	tests := []struct {
		name  string
		local []int
		want  string
	}{
		{"fewer", []int{4096, 4096, 4096}, "connect: size mismatch: 3 local descriptors != 4 remote descriptors"},
		{"more", []int{4096, 4096, 4096, 32768, 1}, "connect: size mismatch: 5 local descriptors != 4 remote descriptors"},
		{"size", []int{4096, 4096, 4096, 65536}, "connect: size mismatch: descriptor 3: local size 65536 != remote size 32768"},
		{"first size", []int{4095, 4096, 4096, 32768}, "connect: size mismatch: descriptor 0: local size 4095 != remote size 4096"},
	}
	ctx := guarded(t)
	passive, activeConn := pair(t, "mem")
	for _, kind := range []OperationKind{KindRead, KindWrite} {
		src := buffers(remote, 1)
		pop := expose(t, passive, kind, src)
		for _, tt := range tests {
			t.Run(kind.String()+"/"+tt.name, func(t *testing.T) {
				local := buffers(tt.local, 9)
				_, err := begin(ctx, activeConn, pop.Metadata(), local)
				require.ErrorIs(t, err, ErrSizeMismatch)
				assert.EqualError(t, err, tt.want)
				requireSame(t, buffers(remote, 1), src)
				requireSame(t, buffers(tt.local, 9), local)
				requireUnregistered(t, activeConn)
			})
		}
	}
}

func TestInvalidDescriptors(t *testing.T) {
	ctx := guarded(t)
	passive, activeConn := pair(t, "mem")
	buf := make([]byte, 8)
	tests := []struct {
		name  string
		descs []Descriptor
		want  string
	}{
		{"none", nil, "connect: invalid descriptor: no descriptors"},
		{"empty buffer", []Descriptor{NewDescriptor(buf), NewDescriptor(buf), NewDescriptor(nil)}, "connect: invalid descriptor: descriptor 2: empty buffer"},
		{"zero Descriptor", []Descriptor{{}}, "connect: invalid descriptor: descriptor 0: empty buffer"},
		{"null pointer", []Descriptor{NewDeviceDescriptor(0, 8, CUDA(0))}, "connect: invalid descriptor: descriptor 0: null pointer"},
		{"negative size", []Descriptor{NewDeviceDescriptor(0x1000, -1, CUDA(0))}, "connect: invalid descriptor: descriptor 0: size -1 at 0x1000"},
		{"bad device", []Descriptor{NewDeviceDescriptor(0x1000, 8, CUDA(-1))}, "connect: invalid descriptor: descriptor 0: device cuda:-1 does not exist"},
	}
	good := expose(t, passive, KindRead, buffers([]int{8}, 1))
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := passive.CreateReadable(ctx, tt.descs...)
			require.ErrorIs(t, err, ErrInvalidDescriptor)
			assert.EqualError(t, err, tt.want)
			_, err = passive.CreateWritable(ctx, tt.descs...)
			require.ErrorIs(t, err, ErrInvalidDescriptor)
			if len(tt.descs) == 1 {
				_, err = activeConn.BeginRead(ctx, good.Metadata(), tt.descs...)
				require.ErrorIs(t, err, ErrInvalidDescriptor)
				assert.EqualError(t, err, tt.want)
			}
		})
	}
	_, err := activeConn.BeginRead(ctx, Metadata{}, NewDescriptor(buf))
	require.ErrorIs(t, err, ErrInvalidMetadata)
}

func TestActiveContextCancelled(t *testing.T) {
	cancels := []struct {
		name string
		run  func(t *testing.T, aop active) error
		want error
	}{
		{"Wait context", func(t *testing.T, aop active) error {
			ctx, cancel := context.WithCancel(t.Context())
			cancel()
			return aop.Wait(ctx)
		}, context.Canceled},
		{"Wait deadline", func(t *testing.T, aop active) error {
			ctx, cancel := context.WithTimeout(t.Context(), time.Millisecond)
			defer cancel()
			return aop.Wait(ctx)
		}, context.DeadlineExceeded},
		{"Cancel", func(t *testing.T, aop active) error {
			aop.Cancel()
			return aop.Wait(guarded(t))
		}, ErrCancelled},
	}
	for _, kind := range []OperationKind{KindRead, KindWrite} {
		for _, tc := range cancels {
			t.Run(kind.String()+"/"+tc.name, func(t *testing.T) {
				ctx := guarded(t)
				passive, activeConn, stalled := stallPair(t)
				pop := expose(t, passive, kind, buffers([]int{1024}, 1))
				aop, err := begin(ctx, activeConn, pop.Metadata(), buffers([]int{1024}, 2))
				require.NoError(t, err)
				<-stalled
				assert.Equal(t, StatusInProgress, aop.Status())

				err = tc.run(t, aop)
				require.ErrorIs(t, err, ErrCancelled)
				require.ErrorIs(t, err, tc.want)
				var te *TransferError
				require.ErrorAs(t, err, &te)
				assert.Equal(t, "stall", te.Backend)
				assert.Equal(t, StatusCancelled, aop.Status())
				requireUnregistered(t, activeConn)

				// The passive side hears of it instead of waiting forever.
				err = pop.Wait(ctx)
				require.ErrorIs(t, err, ErrCancelled)
				require.ErrorAs(t, err, &te)
				assert.Equal(t, activeConn.a.ID(), te.Peer)
				assert.Equal(t, StatusCancelled, pop.Status())
			})
		}
	}
}

func TestBeginContextBoundsTransfer(t *testing.T) {
	passive, activeConn, stalled := stallPair(t)
	pop := expose(t, passive, KindRead, buffers([]int{1024}, 1))
	ctx, cancel := context.WithCancel(t.Context())
	aop, err := begin(ctx, activeConn, pop.Metadata(), buffers([]int{1024}, 0))
	require.NoError(t, err)
	<-stalled
	cancel()
	err = aop.Wait(guarded(t))
	require.ErrorIs(t, err, ErrCancelled)
	require.ErrorIs(t, err, context.Canceled)

	_, err = begin(ctx, activeConn, pop.Metadata(), buffers([]int{1024}, 0))
	require.ErrorIs(t, err, context.Canceled, "a done context starts nothing")
	requireUnregistered(t, activeConn)
}

func TestPassiveWaitTimeoutKeepsOperation(t *testing.T) {
	for _, backend := range transferBackends {
		t.Run(backend, func(t *testing.T) {
			passive, activeConn := pair(t, backend)
			src := buffers([]int{70000}, 5)
			pop := expose(t, passive, KindRead, src)

			short, cancel := context.WithTimeout(t.Context(), time.Millisecond)
			defer cancel()
			require.ErrorIs(t, pop.Wait(short), context.DeadlineExceeded)
			assert.Equal(t, StatusInitialized, pop.Status())

			ctx := guarded(t)
			dst := buffers([]int{70000}, 0)
			moved(t, ctx, activeConn, pop.Metadata(), dst)
			require.NoError(t, pop.Wait(ctx))
			requireSame(t, src, dst)
		})
	}
}

func TestClosedPassiveRefusesAccess(t *testing.T) {
	for _, backend := range transferBackends {
		for _, kind := range []OperationKind{KindRead, KindWrite} {
			t.Run(backend+"/"+kind.String(), func(t *testing.T) {
				ctx := guarded(t)
				passive, activeConn := pair(t, backend)
				exposed := buffers([]int{4096, 100000}, 1)
				pop := expose(t, passive, kind, exposed)
				md := pop.Metadata()
				require.NoError(t, pop.Close())
				assert.Equal(t, StatusCancelled, pop.Status())
				require.ErrorIs(t, pop.Wait(ctx), ErrClosed)
				requireUnregistered(t, passive)

				local := buffers([]int{4096, 100000}, 2)
				aop, err := begin(ctx, activeConn, md, local)
				if err == nil {
					err = aop.Wait(ctx)
					assert.Equal(t, StatusErrored, aop.Status())
				}
				require.ErrorIs(t, err, ErrAccessDenied)
				requireSame(t, buffers([]int{4096, 100000}, 1), exposed)
				requireSame(t, buffers([]int{4096, 100000}, 2), local)
				requireUnregistered(t, activeConn)
			})
		}
	}
}

func TestCloseKeepsReportedCompletion(t *testing.T) {
	ctx := guarded(t)
	passive, activeConn := pair(t, "mem")
	pop := expose(t, passive, KindRead, buffers([]int{64}, 1))
	moved(t, ctx, activeConn, pop.Metadata(), buffers([]int{64}, 0))
	// Nobody waited on the passive side; the completion is queued.
	require.NoError(t, pop.Close())
	assert.Equal(t, StatusComplete, pop.Status())
	require.NoError(t, pop.Wait(ctx))
}

func TestSharedBuffer(t *testing.T) {
	ctx := guarded(t)
	passive, activeConn := pair(t, "mem")
	src := buffers([]int{4096, 8192}, 4)
	first := expose(t, passive, KindRead, src)
	second := expose(t, passive, KindRead, src[:1])
	regions, refs := passive.a.Registered()
	assert.Equal(t, 2, regions)
	assert.Equal(t, 3, refs)

	require.NoError(t, first.Close())
	regions, refs = passive.a.Registered()
	assert.Equal(t, 1, regions)
	assert.Equal(t, 1, refs)

	dst := buffers([]int{4096}, 0)
	moved(t, ctx, activeConn, second.Metadata(), dst)
	requireSame(t, src[:1], dst)

	require.NoError(t, second.Close())
	requireUnregistered(t, passive)
}

func TestConcurrentReaders(t *testing.T) {
	ctx := guarded(t)
	passive, activeConn := pair(t, transferBackends[len(transferBackends)-1])
	src := buffers([]int{200000, 3}, 6)
	pop := expose(t, passive, KindRead, src)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			dst := buffers([]int{200000, 3}, 0)
			aop, err := begin(ctx, activeConn, pop.Metadata(), dst)
			if !assert.NoError(t, err) {
				return
			}
			assert.NoError(t, aop.Wait(ctx))
			assert.Equal(t, src, dst)
		})
	}
	wg.Wait()
	require.NoError(t, pop.Wait(ctx))
}

func TestCloseIdempotent(t *testing.T) {
	ctx := guarded(t)
	c := startConnector(t)
	pop := create(t, c, KindRead, [][]byte{make([]byte, 10)})
	require.NoError(t, pop.Close())
	require.NoError(t, pop.Close())
	require.ErrorIs(t, pop.Wait(ctx), ErrClosed)

	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() { assert.NoError(t, c.Close()) })
	}
	wg.Wait()
	require.NoError(t, c.Close())

	_, err := c.CreateReadable(ctx, NewDescriptor(make([]byte, 10)))
	require.ErrorIs(t, err, ErrClosed)
	_, err = c.CreateWritable(ctx, NewDescriptor(make([]byte, 10)))
	require.ErrorIs(t, err, ErrClosed)
	_, err = c.BeginRead(ctx, pop.Metadata(), NewDescriptor(make([]byte, 10)))
	require.ErrorIs(t, err, ErrClosed)
}

func TestConnectorCloseWithOpsInFlight(t *testing.T) {
	passive, activeConn, stalled := stallPair(t)
	ctx := guarded(t)
	var waits sync.WaitGroup
	results := make(chan error, 16)
	wait := func(w interface{ Wait(context.Context) error }) {
		waits.Go(func() { results <- w.Wait(ctx) })
	}

	var pops []waiter
	for i := range 6 {
		kind := KindRead
		if i%2 == 1 {
			kind = KindWrite
		}
		pop := expose(t, passive, kind, buffers([]int{512, 1 << 20}, i+1))
		pops = append(pops, pop)
		wait(pop)
	}
	for _, pop := range pops[:4] {
		aop, err := begin(ctx, activeConn, pop.Metadata(), buffers([]int{512, 1 << 20}, 0))
		require.NoError(t, err)
		<-stalled
		wait(aop)
		wait(aop) // a second Wait on the same operation
	}

	// Close the passive side from two goroutines at once, then the active one.
	var closes sync.WaitGroup
	for range 2 {
		closes.Go(func() { assert.NoError(t, passive.Close()) })
	}
	closes.Wait()
	require.NoError(t, activeConn.Close())
	waits.Wait()
	close(results)
	n := 0
	for err := range results {
		assert.ErrorIs(t, err, ErrClosed)
		n++
	}
	assert.Equal(t, 6+8, n)
	for _, pop := range pops {
		assert.Equal(t, StatusCancelled, pop.Status())
	}
	goleak.VerifyNone(t)
}

// A peer whose agent closes in an orderly way is lost all the same: the mem
// backend tells every agent in the process, the tcp backend hears its
// goodbye. (Abrupt losses are TestCrossProcessActiveKilled's.)
func TestPeerLost(t *testing.T) {
	for _, backend := range transferBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			only := func() Option {
				if backend == "tcp" {
					return WithBackends(tcp.New())
				}
				return WithBackends(mem.New())
			}
			passive := newConnector(t, only())
			activeConn := newConnector(t, only()) // closed below

			pop := expose(t, passive, KindWrite, buffers([]int{64}, 1))
			bindPeer(t, activeConn, pop)
			require.NoError(t, activeConn.Close())

			err := pop.Wait(ctx)
			require.ErrorIs(t, err, ErrRemoteLost)
			var te *TransferError
			require.ErrorAs(t, err, &te)
			assert.Equal(t, "writable", te.Op)
			assert.Equal(t, activeConn.a.ID(), te.Peer)
			assert.Equal(t, StatusErrored, pop.Status())
		})
	}
}

// A live peer is never lost, however idle its connections, with any
// keepalive WithKeepalive accepts: an idle connection sends keepalives often
// enough that it is never silent for the timeout. The peer here has bound
// the passive operation and then says nothing for several timeouts.
func TestKeepaliveKeepsIdlePeer(t *testing.T) {
	// Keepalives on an idle connection can be 1.5 intervals apart: a timeout
	// shorter than two intervals would lose live peers, so it is refused.
	_, err := NewConnector(quiet, WithTCPOptions(tcp.WithKeepalive(200*time.Millisecond, 250*time.Millisecond)))
	require.ErrorIs(t, err, ErrInvalidOption)

	for _, ka := range []struct{ interval, timeout time.Duration }{
		{250 * time.Millisecond, 500 * time.Millisecond},
		{100 * time.Millisecond, 200 * time.Millisecond},
	} {
		t.Run(fmt.Sprintf("%v/%v", ka.interval, ka.timeout), func(t *testing.T) {
			t.Parallel()
			newTCP := func() *Connector {
				return newConnector(t, WithBackends(tcp.New(tcp.WithKeepalive(ka.interval, ka.timeout))))
			}
			passive, activeConn := newTCP(), newTCP()
			pop := expose(t, passive, KindWrite, buffers([]int{64}, 1))
			bindPeer(t, activeConn, pop)

			silence := 4 * ka.timeout
			idle, cancel := context.WithTimeout(t.Context(), silence)
			defer cancel()
			start := time.Now()
			err := pop.Wait(idle)
			require.ErrorIs(t, err, context.DeadlineExceeded, "a live peer idle for %v was reported lost after %v", silence, time.Since(start))
			assert.Equal(t, StatusInProgress, pop.Status())
		})
	}
}

func TestClosedPeer(t *testing.T) {
	for _, backend := range transferBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive := startConnector(t)
			activeConn := newConnector(t, WithBackend(backend))
			md := create(t, passive, KindRead, [][]byte{make([]byte, 4096)}).Metadata()
			require.NoError(t, passive.Close())

			err := beginWait(ctx, activeConn, md, [][]byte{make([]byte, 4096)})
			require.ErrorIs(t, err, ErrRemoteLost)
			var te *TransferError
			require.ErrorAs(t, err, &te)
			assert.Equal(t, passive.a.ID(), te.Peer)
			requireUnregistered(t, activeConn)
		})
	}
}

func TestUnrelatedAgentLossIsIgnored(t *testing.T) {
	passive := newConnector(t)
	pop := expose(t, passive, KindRead, buffers([]int{64}, 1))
	// A Connector that fails to start closes its backends unstarted; the mem
	// backend then announces the loss of an agent with the nil ID to every
	// agent in the process. No operation may take that for its peer.
	_, err := NewConnector(WithBackends(mem.New()), WithLogger(nil))
	require.ErrorIs(t, err, ErrInvalidOption)

	short, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, pop.Wait(short), context.DeadlineExceeded)
	assert.Equal(t, StatusInitialized, pop.Status())
}

func TestMalformedNotificationsIgnored(t *testing.T) {
	ctx := guarded(t)
	passive, activeConn := pair(t, "mem")
	src := buffers([]int{64}, 1)
	pop := expose(t, passive, KindRead, src)
	md := pop.Metadata()
	for _, msg := range [][]byte{{}, {0}, {4, 'x'}, {0xff}} {
		notice(t, activeConn, md, msg)
	}
	assert.Equal(t, StatusInProgress, pop.Status(), "the peer is known, nothing is decided")

	dst := buffers([]int{64}, 0)
	moved(t, ctx, activeConn, md, dst)
	require.NoError(t, pop.Wait(ctx))
}

func TestPeerReportsFailure(t *testing.T) {
	ctx := guarded(t)
	passive, activeConn := pair(t, "mem")
	pop := expose(t, passive, KindRead, buffers([]int{64}, 1))
	notice(t, activeConn, pop.Metadata(), encodeNotice(noticeFailed, "disk on fire\n"))
	err := pop.Wait(ctx)
	require.ErrorIs(t, err, errPeerFailed)
	assert.NotErrorIs(t, err, ErrCancelled)
	assert.Contains(t, err.Error(), `"disk on fire\n"`, "the remote's reason is quoted")
	assert.Equal(t, StatusErrored, pop.Status())
}

func TestStatusStrings(t *testing.T) {
	for s, want := range map[Status]string{
		StatusInitialized: "INIT",
		StatusInProgress:  "PROC",
		StatusComplete:    "DONE",
		StatusCancelled:   "STOP",
		StatusErrored:     "ERR",
		Status(9):         "Status(9)",
	} {
		assert.Equal(t, want, s.String())
	}
	assert.Equal(t, "READ", KindRead.String())
	assert.Equal(t, "WRITE", KindWrite.String())
	assert.Equal(t, "OperationKind(0)", OperationKind(0).String())
}

func TestNotice(t *testing.T) {
	long := make([]byte, 1000)
	for i := range long {
		long[i] = 'a'
	}
	tests := []struct {
		name   string
		msg    []byte
		code   byte
		reason string
		ok     bool
	}{
		{"done", encodeNotice(noticeDone, ""), noticeDone, "", true},
		{"cancelled", encodeNotice(noticeCancelled, "ctx"), noticeCancelled, "ctx", true},
		{"empty", nil, 0, "", false},
		{"code 0", []byte{0, 'x'}, 0, "", false},
		{"unknown code", []byte{9}, 0, "", false},
		{"invalid UTF-8", []byte{noticeFailed, 'a', 0xff, 'b'}, noticeFailed, "a\uFFFDb", true},
		{"long reason", append([]byte{noticeFailed}, long...), noticeFailed, string(long[:maxReason]), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, reason, ok := decodeNotice(tt.msg)
			assert.Equal(t, tt.ok, ok)
			assert.Equal(t, tt.code, code)
			assert.Equal(t, tt.reason, reason)
		})
	}
	// Encoding cuts a long reason at a rune boundary.
	msg := encodeNotice(noticeFailed, string(long[:maxReason-1])+"é")
	assert.Len(t, msg, maxReason)
}

func TestOptions(t *testing.T) {
	tests := []struct {
		name string
		opts []Option
		want string
	}{
		{"no backends", []Option{WithBackends()}, "goxfer: invalid option: WithBackends needs at least one backend"},
		{"nil backend", []Option{WithBackends(nil)}, "goxfer: invalid option: WithBackends: backend 0 is nil"},
		{"empty name", []Option{WithBackend("")}, "goxfer: invalid option: WithBackend needs a backend name"},
		{"unknown backend", []Option{WithBackends(mem.New()), WithBackend("rdma")}, `goxfer: invalid option: WithBackend("rdma"): the backends are ["mem"]`},
		{"nil logger", []Option{WithLogger(nil)}, "goxfer: invalid option: WithLogger needs a logger"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewConnector(tt.opts...)
			require.ErrorIs(t, err, ErrInvalidOption)
			assert.EqualError(t, err, tt.want)
			assert.Nil(t, c)
		})
	}

	_, err := NewConnector(WithBackends(mem.New()), WithTCPOptions(tcp.WithStreams(2)))
	require.ErrorIs(t, err, ErrInvalidOption)
	assert.EqualError(t, err, "goxfer: invalid option: WithTCPOptions configures a default backend, which WithBackends replaces")
	_, err = NewConnector(quiet, WithTCPOptions(tcp.WithStreams(0)))
	require.ErrorIs(t, err, ErrInvalidOption)
	require.ErrorIs(t, err, agent.ErrInvalidOption)

	c, err := NewConnector(quiet, WithTCPOptions(tcp.WithStreams(2)), WithTCPOptions(tcp.WithKeepalive(time.Second, 3*time.Second)))
	require.NoError(t, err)
	assert.Equal(t, []string{"mem", "cma", "tcp"}, c.a.Backends())
	require.NoError(t, c.Close())

	c, err = NewConnector(quiet, WithoutCMA())
	require.NoError(t, err)
	assert.Equal(t, []string{"mem", "tcp"}, c.a.Backends())
	require.NoError(t, c.Close())
	_, err = NewConnector(quiet, WithoutCMA(), WithCMAOptions(cma.WithWorkers(2)))
	assert.EqualError(t, err, "goxfer: invalid option: WithCMAOptions configures the cma backend, which WithoutCMA leaves out")
	_, err = NewConnector(quiet, WithBackends(mem.New()), WithoutCMA())
	require.ErrorIs(t, err, ErrInvalidOption)
	_, err = NewConnector(quiet, WithCMAOptions(cma.WithWorkers(-1)))
	require.ErrorIs(t, err, ErrInvalidOption)
	require.ErrorIs(t, err, agent.ErrInvalidOption)

	// A backend that fails to start fails the Connector, naming it.
	_, err = NewConnector(quiet, WithBackends(mem.New(), mem.New()))
	require.Error(t, err)
	assert.Contains(t, err.Error(), `backend "mem" given twice`)
	goleak.VerifyNone(t)
}

func TestTransferError(t *testing.T) {
	peer := uuid.MustParse("a1a1a1a1-0000-4000-8000-000000000001")
	err := &TransferError{Op: "read", Peer: peer, Backend: "tcp", Err: ErrRemoteLost}
	assert.EqualError(t, err, "connect: read with agent a1a1a1a1-0000-4000-8000-000000000001 over tcp: goxfer: remote agent lost")
	assert.ErrorIs(t, err, ErrRemoteLost)
	assert.EqualError(t, &TransferError{Op: "writable", Err: ErrClosed}, "connect: writable: goxfer: closed")
	assert.True(t, errors.Is(ErrAccessDenied, agent.ErrAccessDenied))
}

// The usual "write, then exit" pattern: a completion the active side
// reported must reach the passive side before the news that it left, on
// every backend.
func TestCompletionBeforeDeparture(t *testing.T) {
	for _, backend := range transferBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive := newConnector(t)
			for i := range 100 {
				activeConn := startConnector(t, WithBackend(backend))
				op := create(t, passive, KindWrite, [][]byte{make([]byte, 64<<10)})
				moved(t, ctx, activeConn, op.Metadata(), [][]byte{make([]byte, 64<<10)})
				require.NoError(t, activeConn.Close())
				require.NoError(t, op.Wait(ctx), "round %d: the passive side lost a completed write to the peer's departure", i)
				require.NoError(t, op.Close())
			}
		})
	}
}
