// Package serve is the connection plumbing that goxfer's socket backends
// (tcp over TCP, cma over a Unix-domain socket) share on their listening
// side, and in part on their dialling side: what every backend that accepts
// connections from untrusted peers needs, written once.
//
//   - Accept runs an accept loop on any net.Listener: it backs off on
//     errors (5 ms doubling to 1 s, as net/http's Server.Serve does),
//     logs each backoff, and ends when its context is done or the
//     listener is closed.
//   - Caps bounds the connections held per key: per remote address, per
//     process, per claimed identity at an address.
//   - Gate bounds the connections still in their handshake: when a new
//     one finds the gate full, the oldest is closed to make room.
//   - Set tracks the connections and goroutines a backend must end on
//     Close: it refuses new ones once stopped, hands back the members to
//     close, and waits for the goroutines. Its Admit lets an accepted
//     connection into a Gate and serves it, in one step that its Stop is
//     ordered against: a backend that is closing evicts nothing.
//   - Counters are the counters behind agent.BackendStats, with each
//     dropped connection counted in exactly one kind and in Disconnected.
//   - CheckHandshake is the identity check every handshake makes.
//
// What the package leaves to each backend: its wire format (the frame
// header both encode is package framehdr's; their piece tables and
// handshakes differ in layout), its handshake beyond the
// identity check, deadlines on its connections, and what it tells the agent
// (agent.Host.Refused, LinkLost).
//
// A listening side puts the parts together in its accept handler, in this
// order:
//
//	serve.Accept(ctx, ln, log, func(c net.Conn) bool {
//		k := keyOf(c) // remote address, peer process, …
//		if !perKey.Acquire(k) {
//			_ = c.Close()
//			if set.Stopping() { // refused while closing: not the peer's fault
//				return false
//			}
//			stats.Drop(serve.LimitRejected) // refused before any Stop: counted
//			host.Refused()
//			return true
//		}
//		evicted, ok := set.Admit(gate, c, c, func(c net.Conn, pass *serve.Pass) {
//			defer perKey.Release(k)
//			defer pass.Done()
//			defer c.Close()
//			handshake(c, pass) // reads the hello, then: if !pass.Done() { return } (evicted, counted already)
//			…
//		})
//		if !ok { // the set is stopped: the backend is closing
//			perKey.Release(k)
//			_ = c.Close()
//			return false
//		}
//		if evicted { // the oldest handshake, closed to make room
//			stats.Drop(serve.LimitRejected)
//			host.Refused()
//		}
//		return true
//	})
//
// Admit checks that the set is not stopped, enters the gate and starts the
// goroutine under the lock Stop takes: checking Stopping first and then
// entering the gate would let a connection that arrives as Close begins
// evict a handshake that Close is closing anyway, and count that against
// its peer.
//
// Nothing in the package starts a goroutine that outlives the calls that
// start it, except the ones a Set runs for its caller, and none waits on a
// clock of its own: timing goes through the time package (time.NewTimer)
// and contexts, so tests run it inside a testing/synctest bubble.
package serve
