// Package nats is goxfer's NATS control plane: it carries
// [connect.Metadata] tokens between services, request/reply ([Serve],
// [Request]) or push style ([Publish], [Subscribe]), and keeps a presence
// registry of agents in a JetStream key-value bucket ([OpenRegistry]),
// which resolves compact tokens and tells Connectors when a peer departs,
// long before transport keepalives would.
//
// Every function takes the caller's [*nats.Conn] (with the caller's TLS,
// credentials and reconnect settings), never dials a connection of its
// own, and never closes the caller's. Import it under another name, since
// nats.go's package is also nats:
//
//	// Worker: expose a KV block per request, answer with its token; the
//	// exposure closes when the reader completes, fails, releases it,
//	// departs, or leaves it unused past its expiry (ServeExposures).
//	svc, _ := gxnats.ServeExposures(nc, "prefill.kv", conn, func(ctx context.Context, req *gxnats.ServiceRequest) (*gxnats.Exposed, error) {
//		return &gxnats.Exposed{Kind: connect.KindRead, Descriptors: []connect.Descriptor{connect.NewDescriptor(kv)}}, nil
//	})
//	defer svc.Close()
//
// (For full control, [Serve] takes any handler that returns a [Reply]
// with a token.)
//
//	// Requester: get the token, read the block.
//	rep, err := gxnats.Request(ctx, nc, "prefill.kv", nil)
//	rop, err := conn.BeginRead(ctx, rep.Metadata, connect.NewDescriptor(buf))
//	err = rop.Wait(ctx)
//
// Options are typed by the call they configure, so that an option a call
// does not honour does not compile there (nats.go jetstream's pattern):
// each call takes its own interface ([ServeOption], [RequestOption],
// [PublishOption], [SubscribeOption], [RegistryOption], [JoinOption]), and
// an option honoured by several calls returns one that embeds each of
// theirs ([QueueOption], [SendOption], [LoggerOption], [HeartbeatOption]).
// Invalid values, and nil options, make the call fail with an error
// matching [ErrInvalidOption]. An option is a value: it may be shared and
// reused, concurrently too. The defaults are those of a call given no
// options; docs/nats.md gives each option's rationale.
//
//	Serve, ServeExposures: WithQueue, WithConcurrency, WithLogger
//	Request:      WithHeader, WithTimeout, WithRetry, WithAttemptTimeout
//	Publish:      WithHeader, WithTimeout
//	Subscribe:    WithQueue
//	OpenRegistry: WithBucket, WithHeartbeat, WithCreateBucket, WithReplicas, WithLogger
//	Join:         WithHeartbeat
//
// Token messages are framed as "gxt", a version byte, the token's length
// as a uvarint, the token's binary form, then the application's payload;
// goxfer's own headers start with "Goxfer-". Every message is checked
// against the server's max payload before it is sent. Package
// [github.com/goxfer/goxfer/transport/nats/natsserver] runs an embedded
// server for single-machine use and tests. docs/nats.md is the guide.
package nats
