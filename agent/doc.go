// Package agent is goxfer's transfer agent, shaped after NIXL's nixlAgent.
//
// An Agent registers local memory, publishes its connection metadata (Info),
// loads the metadata of remote agents, and moves bytes with one-sided READ and
// WRITE transfers (Xfer) over pluggable backends. The passive side of a
// transfer exposes registered memory under an unguessable Key (Expose); every
// remote access names that key and is checked against the exposure's regions
// and access kind before a byte is touched. Notifications are small messages
// addressed to a Key: a transfer may carry one that its backend sends only
// after all of the transfer's data is in place, and standalone notifications
// can be sent at any time. The agent's dispatcher hands each incoming
// notification and peer-loss event to the exposure that owns the key, on
// the delivering goroutine and without blocking: no per-operation polling,
// no hand-off, and a bounded queue per exposure.
//
// The agent knows nothing of tokens, NATS or the connect package: it is the
// layer those are built on. Backends implement the small Backend interface
// and talk back to the agent only through Host.
//
// Typical use, on the passive side:
//
//	exp, _ := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(buf)})
//	// send a.Info(), exp.Key() and the regions to the peer
//	ev := <-exp.Events() // the peer's completion notification
//	exp.Revoke()         // no peer can touch buf any more
//
// and on the active side:
//
//	x, _ := b.Post(context.Background(), agent.Request{Op: agent.OpRead, Peer: info, Key: key, Segments: segs, Notify: []byte("done")})
//	<-x.Done()
//	err := x.Err()
package agent
