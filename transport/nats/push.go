package nats

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/connect"
)

// Publish offers md, with the optional payload data, on subject: for
// example a decode worker offering a writable KV slot to whoever
// subscribes ([Subscribe]). The message is checked against the server's
// max payload first (a [*PayloadTooLargeError], nothing sent), then
// published and flushed: a nil error means the server has it, not that a
// subscriber got it; an error after the size check may still leave it
// buffered for sending once a reconnecting connection is back. NATS core
// delivers at most once: offers nobody takes should be closed by their
// owner after a while. A ctx without a deadline gets [WithTimeout]'s
// (default 10 s) for the flush. data and the headers are not retained.
// Options honoured: WithHeader, WithTimeout. Safe for concurrent use.
func Publish(ctx context.Context, nc *nats.Conn, subject string, md connect.Metadata, data []byte, opts ...PublishOption) error {
	o, err := connOptions("Publish", nc, opts, PublishOption.applyPublish)
	if err != nil {
		return err
	}
	body, err := encodeMessage(md, data)
	if err != nil {
		return fmt.Errorf("goxfer/nats: publish to subject %q: %w", subject, err)
	}
	m := &nats.Msg{Subject: subject, Header: mergeHeader(o.header), Data: body}
	if len(m.Header) == 0 {
		m.Header = nil
	}
	if err := checkSize(nc, subject, m.Header, body); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("goxfer/nats: publish to subject %q: %w", subject, err)
	}
	if err := nc.PublishMsg(m); err != nil {
		return fmt.Errorf("goxfer/nats: publish to subject %q: %w", subject, err)
	}
	ctx, cancel := o.bound(ctx)
	defer cancel()
	if err := nc.FlushWithContext(ctx); err != nil {
		return fmt.Errorf("goxfer/nats: publish to subject %q: server did not confirm: %w", subject, err)
	}
	return nil
}

// Offer is a token received by a [Subscription]. The receiver owns it.
type Offer struct {
	Subject  string           // the subject it was published to
	Metadata connect.Metadata // the token
	Data     []byte           // the publisher's payload, if any
	Header   nats.Header      // the publisher's headers (goxfer's own removed); may be nil
}

// Subscription receives tokens published with [Publish]; see [Subscribe].
// [Subscription.Next] may be called from one goroutine at a time,
// [Subscription.Close] from any. The connection stays the caller's.
type Subscription struct {
	subject string
	sub     *nats.Subscription

	mu     sync.Mutex
	closed bool
}

// Subscribe starts receiving tokens published on subject, which may hold
// wildcards. With [WithQueue], each offer goes to one subscriber of the
// group; by default every subscriber gets every offer. Messages wait in the
// subscription's pending buffer (nats.go's limits) until
// [Subscription.Next] takes them. Subscribe uses nc, which stays the
// caller's. Options honoured: WithQueue.
func Subscribe(nc *nats.Conn, subject string, opts ...SubscribeOption) (*Subscription, error) {
	o, err := connOptions("Subscribe", nc, opts, SubscribeOption.applySubscribe)
	if err != nil {
		return nil, err
	}
	var sub *nats.Subscription
	if o.queue != nil {
		sub, err = nc.QueueSubscribeSync(subject, *o.queue)
	} else {
		sub, err = nc.SubscribeSync(subject)
	}
	if err != nil {
		return nil, fmt.Errorf("goxfer/nats: subscribe to subject %q: %w", subject, err)
	}
	return &Subscription{subject: subject, sub: sub}, nil
}

// Next returns the next offer, which the caller owns, waiting for one until
// ctx is done. A message that is no token message returns an error
// matching [connect.ErrInvalidMetadata] that names the subject; a
// subscription that fell behind and had messages dropped returns an error
// matching [nats.ErrSlowConsumer] once. In both cases the Subscription
// stays usable: the next call gets the next message. After Close, Next
// returns an error matching [ErrClosed]. Not for concurrent use with
// itself.
func (s *Subscription) Next(ctx context.Context) (*Offer, error) {
	m, err := s.sub.NextMsgWithContext(ctx)
	if err != nil {
		switch {
		case s.isClosed():
			return nil, fmt.Errorf("%w: subscription to subject %q", ErrClosed, s.subject)
		case errors.Is(err, nats.ErrSlowConsumer):
			return nil, fmt.Errorf("goxfer/nats: subscription to subject %q is a slow consumer: the client dropped offers it could not buffer: %w", s.subject, err)
		case ctx.Err() != nil:
			return nil, fmt.Errorf("goxfer/nats: subscription to subject %q: %w", s.subject, ctx.Err())
		}
		return nil, fmt.Errorf("goxfer/nats: subscription to subject %q: %w", s.subject, err)
	}
	md, payload, err := decodeMessage(m.Data)
	if err != nil {
		return nil, fmt.Errorf("goxfer/nats: message on subject %q: %w", m.Subject, err)
	}
	return &Offer{Subject: m.Subject, Metadata: md, Data: payload, Header: appHeader(m.Header)}, nil
}

func (s *Subscription) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// Close stops the subscription; offers not yet taken are dropped (their
// publishers keep their memory exposed until they close the operations).
// A Next in progress returns [ErrClosed]. The connection stays open. Close
// is idempotent and safe for concurrent use.
func (s *Subscription) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	if err := s.sub.Unsubscribe(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) && !errors.Is(err, nats.ErrBadSubscription) {
		return fmt.Errorf("goxfer/nats: close subscription to subject %q: %w", s.subject, err)
	}
	return nil
}
