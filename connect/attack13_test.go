package connect

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/cma"
	"github.com/goxfer/goxfer/agent/backend/mem"
	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/backend/ucx"
)

// Every invalid option of every backend, through connect, matches
// ErrInvalidOption (which is agent.ErrInvalidOption), and nothing is left
// running (TestMain checks for goroutines).
func TestAttack13InvalidBackendOptionsMatchErrInvalidOption(t *testing.T) {
	require.Same(t, agent.ErrInvalidOption, ErrInvalidOption)
	for name, opts := range map[string][]Option{
		"tcp":                         {WithTCPOptions(tcp.WithStreams(0))},
		"tcp check":                   {WithTCPOptions(tcp.WithChunkSize(1<<20), tcp.WithMaxFrameSize(64<<10))},
		"cma":                         {WithCMAOptions(cma.WithTimeout(time.Microsecond))},
		"ucx":                         {WithUCX(ucx.WithTimeout(time.Millisecond))},
		"ucx nil":                     {WithUCX(nil)},
		"tcp through backends":        {WithBackends(mem.New(), tcp.New(tcp.WithStreams(100)))},
		"cma through backends":        {WithBackends(mem.New(), cma.New(cma.WithTimeout(0)))},
		"tcp after a good cma":        {WithCMAOptions(cma.WithWorkers(2)), WithTCPOptions(tcp.WithListenAddr("nonsense"))},
		"ucx through backends":        {WithBackends(mem.New(), ucx.New(ucx.WithLeaseSize(1)))},
		"connect's own, nil resolver": {WithResolver(nil)},
	} {
		_, err := NewConnector(append([]Option{quiet}, opts...)...)
		require.Error(t, err, name)
		assert.ErrorIs(t, err, ErrInvalidOption, name)
	}
}

// A nil backend option is an invalid option, as ucx treats it
// ("ucx: nil option"): tcp and cma panic in New instead, inside
// NewConnector.
func TestAttack13NilBackendOptionIsInvalid(t *testing.T) {
	for name, opt := range map[string]Option{
		"tcp": WithTCPOptions(nil),
		"cma": WithCMAOptions(nil),
	} {
		var err error
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("%s: NewConnector panics: %v", name, r)
				}
			}()
			_, err = NewConnector(quiet, opt)
		}()
		assert.ErrorIs(t, err, ErrInvalidOption, name)
	}
}

// probing is a backend whose Reachable blocks on its first call until the
// caller's context ends, as cma's probe of a slow peer does, and then
// answers as a well-behaved backend must: context.Cause(ctx). Later calls
// say the peer is not reachable at once.
type probing struct {
	once    sync.Once
	probing chan struct{}
}

func (p *probing) Name() string                                                { return "probing" }
func (p *probing) Start(agent.Host) ([]byte, error)                            { return []byte{1}, nil }
func (p *probing) Supports(agent.MemKind) bool                                 { return true }
func (p *probing) Post(*agent.Work) error                                      { return errors.New("probing: no transfers") }
func (p *probing) Notify(context.Context, agent.Info, agent.Key, []byte) error { return nil }
func (p *probing) Close() error                                                { return nil }

func (p *probing) Reachable(ctx context.Context, _ agent.Info) error {
	first := false
	p.once.Do(func() { first = true })
	if !first {
		return errors.New("probing: unreachable")
	}
	close(p.probing)
	<-ctx.Done()
	return context.Cause(ctx)
}

// BeginRead: "ctx bounds the whole transfer ...: if it ends before the
// transfer finishes, the transfer is cancelled, with an error matching both
// ErrCancelled and ctx.Err() (and the cause ...)"; a ctx already done
// comes as a plain error. A ctx that ends while the agent chooses a backend
// (a probe in progress) gives neither: Begin returns a *TransferError that
// matches only the cause (not ErrCancelled, not context.Canceled), and the
// peer is told the transfer *failed*, so the passive Wait reports
// StatusErrored with "peer reports the transfer failed" instead of a
// cancellation.
func TestAttack13ContextEndingWhileChoosingIsACancellation(t *testing.T) {
	passive := newConnector(t, WithBackends(mem.New()))
	p := &probing{probing: make(chan struct{})}
	active := newConnector(t, WithBackends(p, mem.New()))
	src := buffers([]int{4096}, 3)
	op := expose(t, passive, KindRead, src)

	why := errors.New("client went away")
	ctx, cancel := context.WithCancelCause(context.Background())
	go func() {
		<-p.probing
		cancel(why)
	}()
	_, err := active.BeginRead(ctx, op.Metadata(), descriptors(buffers([]int{4096}, 0))...)
	require.Error(t, err)
	assert.ErrorIs(t, err, why)
	assert.ErrorIs(t, err, context.Canceled, "matches ctx.Err()")
	var te *TransferError
	if errors.As(err, &te) {
		assert.ErrorIs(t, err, ErrCancelled, "a transfer its context ended is cancelled")
	}

	wctx, wcancel := context.WithTimeout(context.Background(), hangGuard)
	defer wcancel()
	perr := op.Wait(wctx)
	assert.NotErrorIs(t, perr, context.DeadlineExceeded, "the peer was told")
	assert.ErrorIs(t, perr, ErrCancelled, "the peer hears a cancellation")
	assert.Equal(t, StatusCancelled, op.Status())
}

// noticing is a stall backend that records the context its Notify gets:
// its error and deadline while Notify runs.
type noticing struct {
	*stall
	ctxs chan noticeCtx
}

type noticeCtx struct {
	err      error
	deadline time.Time
	bounded  bool
}

func (n *noticing) Notify(ctx context.Context, _ agent.Info, _ agent.Key, _ []byte) error {
	dl, ok := ctx.Deadline()
	n.ctxs <- noticeCtx{ctx.Err(), dl, ok}
	return nil
}

// The notice telling the peer a transfer was cancelled goes out with a
// live context bounded by 10 s (tellPeer), not Background, not a done one.
func TestAttack13CancelNoticeBoundedByTenSeconds(t *testing.T) {
	passive := newConnector(t, WithBackends(mem.New(), newStall()))
	n := &noticing{stall: newStall(), ctxs: make(chan noticeCtx, 4)}
	active := newConnector(t, WithBackends(n))
	op := expose(t, passive, KindRead, buffers([]int{64}, 1))
	rop, err := active.BeginRead(context.Background(), op.Metadata(), descriptors(buffers([]int{64}, 0))...)
	require.NoError(t, err)
	<-n.posted
	start := time.Now()
	rop.Cancel()
	require.ErrorIs(t, rop.Wait(context.Background()), ErrCancelled)
	select {
	case c := <-n.ctxs:
		require.NoError(t, c.err, "the notice's context is live")
		require.True(t, c.bounded, "the notice is bounded")
		assert.WithinDuration(t, start.Add(tellPeerTimeout), c.deadline, 2*time.Second)
	case <-time.After(hangGuard):
		t.Fatal("the peer was not told")
	}
}

// NewConnector failing half-way (tcp's Start fails after mem and cma
// started): the error is not an option error, and nothing is left running.
func TestAttack13NewConnectorFailingHalfwayLeavesNothing(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	_, err = NewConnector(quiet, WithTCPOptions(tcp.WithListenAddr(ln.Addr().String())))
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrInvalidOption)
	goleak.VerifyNone(t, ignore)
}
