// Package connect moves bulk memory (KV-cache blocks, embeddings, tensors)
// between processes and hosts, in the style of NVIDIA Dynamo's NIXL Connect.
//
// One side, the passive one, exposes memory with [Connector.CreateReadable]
// or [Connector.CreateWritable] and hands out the operation's [Metadata], a
// small token. The other side, the active one, passes the token to
// [Connector.BeginRead] or [Connector.BeginWrite], which move the bytes
// one-sidedly over the first backend both sides share that reaches the peer
// (in-process copy, same-host cross-memory attach, TCP, ...). Both sides
// await completion with Wait: the active side's Wait returns once every
// byte is in place, then the passive side hears of it. Tokens travel
// however the application likes (NATS, HTTP, a file) as plain strings
// ([Metadata.Text]); they are capabilities, so printing or logging one
// shows a redacted form instead.
//
// The happy path, READ:
//
//	conn, err := connect.NewConnector()       // one per process; safe for concurrent use
//	defer conn.Close()
//
//	ctx, cancel := context.WithTimeout(ctx, 10*time.Second) // every wait has a deadline
//	defer cancel()
//	op, err := conn.CreateReadable(ctx, connect.NewDescriptor(src)) // passive side
//	defer op.Close()                          // src is the caller's again once it returns
//	token := op.Metadata().Text()             // send it to the peer; a secret
//	err = op.Wait(ctx)                        // the peer has read src, failed, or ctx ended
//
//	md, err := connect.ParseMetadata(token)   // active side, in the peer
//	rop, err := conn.BeginRead(ctx, md, connect.NewDescriptor(dst))
//	err = rop.Wait(ctx)                       // dst holds src's bytes
//
// A reader that will not use a token says so ([Connector.Release]), and an
// exposure unused for too long closes itself ([WithExpiry]), so memory is
// never left exposed for a peer that went away. Memory exposed once and
// read by many peers, many times, is a [Connector.Expose]; part of a token
// is [Metadata.Select].
//
// WRITE mirrors it with CreateWritable and BeginWrite. An operation may
// carry any number of descriptors; the local ones must match the remote ones
// in number and, index by index, in size.
//
// Memory stays owned by the caller: the package never copies or frees it.
// Keep it alive and leave alone the bytes being moved until the passive
// operation's Close returns or the active operation's Wait returns.
//
// Contexts: the one given to BeginRead or BeginWrite bounds the whole
// transfer, and the one given to an active Wait cancels the transfer too
// when it ends; the one given to a passive Wait bounds only that wait.
//
// Errors match the package's sentinels with [errors.Is]; failures of a
// transfer come as [*TransferError], naming the operation, the peer and the
// backend.
package connect
