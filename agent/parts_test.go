package agent

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// capturingBackend hands every posted transfer to the test.
type capturingBackend struct {
	stubBackend
	posted chan *Work
}

func (b *capturingBackend) Post(w *Work) error { b.posted <- w; return nil }

func TestParts(t *testing.T) {
	b := &capturingBackend{stubBackend{name: "parts"}, make(chan *Work, 1)}
	a := newTestAgent(t, b)
	peer := Info{ID: uuid.New(), Conns: []ConnInfo{{Backend: "parts"}}}
	buf := make([]byte, 64)
	post := func(notify []byte) (*Xfer, *Work) {
		x, err := a.Post(context.Background(), Request{Op: OpWrite, Peer: peer, Notify: notify,
			Segments: []Segment{{Local: DRAM(buf), Remote: Region{Addr: 0x1000, Len: 64}}}})
		require.NoError(t, err)
		return x, <-b.posted
	}
	type sent struct {
		key Key
		msg string
	}

	cases := []struct {
		name      string
		notify    []byte
		notifyErr error
		run       func(p *Parts, x *Xfer)
		want      error // nil: success
		notified  bool
	}{
		{name: "every part succeeds, then the notification", notify: []byte("done"),
			run:      func(p *Parts, x *Xfer) { p.Add(); p.Add(); p.Done(nil); p.Done(nil); p.Done(nil) },
			notified: true},
		{name: "the first error wins", notify: []byte("done"),
			run: func(p *Parts, x *Xfer) {
				p.Add()
				p.Add()
				p.Done(ErrAccessDenied)
				p.Done(ErrRemoteLost)
				p.Done(nil)
			},
			want: ErrAccessDenied},
		{name: "a cancelled transfer never succeeds",
			run:  func(p *Parts, x *Xfer) { p.Add(); p.Done(nil); x.Cancel(nil); p.Done(nil) },
			want: ErrCancelled},
		{name: "a failed notification does not undo the success", notify: []byte("done"), notifyErr: ErrRemoteLost,
			run:      func(p *Parts, x *Xfer) { p.Done(nil) },
			notified: true},
		{name: "Fail records without finishing",
			run: func(p *Parts, x *Xfer) {
				p.Add()
				p.Fail(ErrRemoteLost)
				assert.True(t, p.Failed())
				select {
				case <-x.Done():
					t.Error("finished with a part still in flight")
				default:
				}
				p.Done(nil)
				p.Done(nil)
			},
			want: ErrRemoteLost},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			x, w := post(tc.notify)
			var mu sync.Mutex
			var notes []sent
			finished := 0
			var p Parts
			p.Init(w, func(k Key, msg []byte) error {
				mu.Lock()
				defer mu.Unlock()
				select {
				case <-x.Done():
				default:
					t.Error("notified before Finish released the waiter")
				}
				if finished != 0 {
					t.Error("the finished callback ran before the notification")
				}
				notes = append(notes, sent{k, string(msg)})
				return tc.notifyErr
			}, func() { finished++ })
			assert.Same(t, w, p.Work())
			assert.False(t, p.Failed())
			lost := a.Stats().LostNotifications
			tc.run(&p, x)
			<-x.Done()
			if tc.want == nil {
				require.NoError(t, x.Err())
			} else {
				require.True(t, errors.Is(x.Err(), tc.want), "got %v, want %v", x.Err(), tc.want)
			}
			assert.Equal(t, 1, finished)
			if tc.notified {
				assert.Equal(t, []sent{{w.Key, "done"}}, notes)
			} else {
				assert.Empty(t, notes)
			}
			wantLost := uint64(0)
			if tc.notified && tc.notifyErr != nil {
				wantLost = 1
			}
			assert.Equal(t, wantLost, a.Stats().LostNotifications-lost, "LostNotifications")
		})
	}
}

// TestCloseWaitsForNotification: a transfer's notification goes out after
// its waiter is released, and Close, called as soon as the transfer is
// done, waits for it before it stops the backends (it would otherwise be
// cut off with the connection, and the passive side see a lost peer where
// the transfer succeeded).
func TestCloseWaitsForNotification(t *testing.T) {
	b := &capturingBackend{stubBackend{name: "parts"}, make(chan *Work, 1)}
	a := newTestAgent(t, b)
	peer := Info{ID: uuid.New(), Conns: []ConnInfo{{Backend: "parts"}}}
	x, err := a.Post(context.Background(), Request{Op: OpRead, Peer: peer, Notify: []byte("done"),
		Segments: []Segment{{Local: DRAM(make([]byte, 8)), Remote: Region{Addr: 0x1000, Len: 8}}}})
	require.NoError(t, err)
	w := <-b.posted
	entered, release := make(chan struct{}), make(chan struct{})
	sent := make(chan struct{})
	var p Parts
	p.Init(w, func(Key, []byte) error {
		close(entered)
		<-release
		close(sent)
		return nil
	}, nil)
	go p.Done(nil)
	<-entered
	select {
	case <-x.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter was not released before the notification was sent")
	}
	require.NoError(t, x.Err())
	assert.Zero(t, a.Stats().InFlight, "a transfer sending its notification is not in flight")
	closed := make(chan error, 1)
	go func() { closed <- a.Close() }()
	select {
	case <-closed:
		t.Fatal("Close returned while a notification was being sent")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return once the notification was sent")
	}
	select {
	case <-sent:
	default:
		t.Fatal("Close returned before the notification was sent")
	}
}

func TestAfterCancel(t *testing.T) {
	a := newTestAgent(t)
	post := func() *Xfer {
		x, err := a.Post(context.Background(), Request{Op: OpRead, Peer: Info{ID: uuid.New()},
			Segments: []Segment{{Local: DRAM(make([]byte, 8)), Remote: Region{Addr: 0x1000, Len: 8}}}})
		require.NoError(t, err)
		return x
	}
	t.Run("runs once on cancel", func(t *testing.T) {
		x := post()
		w := &x.t.w
		ran := make(chan struct{}, 2)
		stop := w.AfterCancel(func() { ran <- struct{}{} })
		x.Cancel(nil)
		x.Cancel(nil)
		<-ran
		assert.False(t, stop(), "stop after f started")
		assert.Empty(t, ran, "f ran twice")
		w.Finish(w.CancelErr())
	})
	t.Run("stopped never runs", func(t *testing.T) {
		x := post()
		w := &x.t.w
		ran := make(chan struct{}, 1)
		stop := w.AfterCancel(func() { ran <- struct{}{} })
		assert.True(t, stop())
		assert.False(t, stop(), "a second stop")
		x.Cancel(nil)
		w.Finish(w.CancelErr())
		select {
		case <-ran:
			t.Fatal("f ran after stop")
		case <-time.After(20 * time.Millisecond):
		}
	})
	t.Run("already cancelled runs at once", func(t *testing.T) {
		x := post()
		w := &x.t.w
		x.Cancel(nil)
		ran := make(chan struct{})
		stop := w.AfterCancel(func() { close(ran) })
		<-ran
		assert.False(t, stop())
		w.Finish(w.CancelErr())
	})
}
