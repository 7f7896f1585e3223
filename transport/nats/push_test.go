package nats

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/pattern"
	"github.com/goxfer/goxfer/internal/wire"
)

// A decode worker offers a writable KV slot; a prefill worker takes the
// offer and writes the block into it.
func TestPublishAWritableOffer(t *testing.T) {
	ctx := guarded(t)
	srv := startServer(t)
	prefillNC, decodeNC := dial(t, srv), dial(t, srv)
	prefill, decode := newConnector(t), newConnector(t)
	offers := subscribe(t, prefillNC, "kv.slots", WithQueue("prefill"))

	slot := make([]byte, 64<<10)
	op, err := decode.CreateWritable(ctx, connect.NewDescriptor(slot))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, op.Close()) })
	require.NoError(t, Publish(ctx, decodeNC, "kv.slots", op.Metadata(), []byte("request 7"), WithHeader(nats.Header{"Model": {"llama"}})))

	offer, err := offers.Next(ctx)
	require.NoError(t, err)
	assert.Equal(t, "kv.slots", offer.Subject)
	assert.Equal(t, "request 7", string(offer.Data))
	assert.Equal(t, nats.Header{"Model": {"llama"}}, offer.Header)
	require.Equal(t, connect.KindWrite, offer.Metadata.Kind())

	seed := pattern.NextSeed()
	block := make([]byte, offer.Metadata.Sizes()[0])
	pattern.Fill(block, seed, 0, 0)
	wop, err := prefill.BeginWrite(ctx, offer.Metadata, connect.NewDescriptor(block))
	require.NoError(t, err)
	require.NoError(t, wop.Wait(ctx))
	require.NoError(t, op.Wait(ctx))
	require.NoError(t, pattern.Check(slot, seed, 0, 0))
}

func TestPublishReachesEverySubscriberWithoutAQueue(t *testing.T) {
	ctx := guarded(t)
	srv := startServer(t)
	nc := dial(t, srv)
	md := testToken(t)
	a, b := subscribe(t, nc, "offers.>"), subscribe(t, dial(t, srv), "offers.>")
	require.NoError(t, Publish(ctx, nc, "offers.x", md, nil))
	for _, s := range []*Subscription{a, b} {
		o, err := s.Next(ctx)
		require.NoError(t, err)
		assert.Equal(t, "offers.x", o.Subject)
		assert.Equal(t, md.Text(), o.Metadata.Text())
		assert.Empty(t, o.Data)
		assert.Nil(t, o.Header)
	}
}

func TestSubscriptionSkipsACorruptMessage(t *testing.T) {
	ctx := guarded(t)
	srv := startServer(t)
	nc := dial(t, srv)
	md := testToken(t)
	s := subscribe(t, nc, "offers")
	require.NoError(t, nc.Publish("offers", []byte("garbage")))
	require.NoError(t, Publish(ctx, nc, "offers", md, []byte("good")))

	_, err := s.Next(ctx)
	require.ErrorIs(t, err, connect.ErrInvalidMetadata)
	assert.Contains(t, err.Error(), `subject "offers"`)
	o, err := s.Next(ctx)
	require.NoError(t, err)
	assert.Equal(t, "good", string(o.Data))
}

func TestPublishTooLargeIsNotSent(t *testing.T) {
	ctx := guarded(t)
	srv := startServer(t)
	nc := dial(t, srv)
	md := testToken(t)
	s := subscribe(t, nc, "offers")
	err := Publish(ctx, nc, "offers", md, make([]byte, nc.MaxPayload()))
	var tl *PayloadTooLargeError
	require.ErrorAs(t, err, &tl)
	// magic, version, the token's length as a uvarint, the token, the data.
	assert.Equal(t, int64(len(msgMagic)+1+wire.UvarintLen(uint64(md.EncodedLen()))+md.EncodedLen())+nc.MaxPayload(), tl.Size)
	// Nothing went out: the next offer is the small one.
	require.NoError(t, Publish(ctx, nc, "offers", md, []byte("small")))
	o, err := s.Next(ctx)
	require.NoError(t, err)
	assert.Equal(t, "small", string(o.Data))
}

func TestSubscriptionCloseEndsNext(t *testing.T) {
	srv := startServer(t)
	s, err := Subscribe(dial(t, srv), "offers")
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := s.Next(guarded(t))
		done <- err
	}()
	time.Sleep(20 * time.Millisecond) // let Next block; either order must give ErrClosed
	require.NoError(t, s.Close())
	require.ErrorIs(t, <-done, ErrClosed)
	_, err = s.Next(context.Background())
	require.ErrorIs(t, err, ErrClosed)
	assert.Contains(t, err.Error(), `subject "offers"`)
	require.NoError(t, s.Close())
}

func TestSubscriptionNextHonoursCtx(t *testing.T) {
	srv := startServer(t)
	s := subscribe(t, dial(t, srv), "offers")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err := s.Next(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

func TestSubscriptionReportsASlowConsumer(t *testing.T) {
	ctx := guarded(t)
	srv := startServer(t)
	nc := dial(t, srv, nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	md := testToken(t)
	s := subscribe(t, nc, "offers")
	require.NoError(t, s.sub.SetPendingLimits(2, -1))
	pub := dial(t, srv)
	for range 5 {
		require.NoError(t, Publish(ctx, pub, "offers", md, nil))
	}
	require.NoError(t, nc.Flush()) // every offer has reached nc
	var slow error
	for range 3 {
		if _, err := s.Next(ctx); err != nil {
			slow = err
			break
		}
	}
	require.ErrorIs(t, slow, nats.ErrSlowConsumer)
	assert.Contains(t, slow.Error(), `subscription to subject "offers" is a slow consumer`)
	_, err := s.Next(ctx) // still usable
	require.NoError(t, err)
}
