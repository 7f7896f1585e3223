// Package agent is goxfer's transfer agent, shaped after NIXL's nixlAgent:
// the layer the connect package is built on. Use it directly when you need
// transfers that connect's pairing of operations does not express. It knows
// nothing of tokens or NATS; moving the metadata between agents is the
// caller's business. Implementing a transport is a different job: the
// [Backend] interface's doc is the implementer's guide.
//
// # Agents
//
// [New] starts an [Agent] over one or more backends ([WithBackends]), in
// order of preference, and starts each of them. [Agent.Info] is the agent's
// public metadata (its ID and, per backend, how to reach it): send it to
// the peers that will transfer with this agent. An Agent is safe for
// concurrent use; [Agent.Close] ends it.
//
// # Memory
//
// A [Local] names memory of this process: [DRAM] for a []byte, [Device] for
// raw memory such as a CUDA pointer. The agent never copies or frees it:
// the caller keeps it alive and in place while any registration, exposure
// or transfer uses it. [Agent.Register] registers regions with the
// backends that must prepare memory before use (a [Registrar], such as
// ucx), once, reference-counted; the returned [Registration]'s Release
// drops the references. Transfers and exposures do not check registration:
// backends prepare unregistered memory per transfer, which costs time.
//
// # Device memory
//
// GPU memory ([Device] with [KindVRAM]) is checked through the agent's
// device driver ([WithDevice]; by default the CUDA driver, bound without
// cgo by package devmem) when it is posted or exposed: device memory of
// the GPU named, inside one allocation. Every backend moves it. One that
// supports VRAM itself (ucx with a CUDA-enabled UCX) is given it as it
// is; for the others the agent stages it through a bounded pool of pinned
// host buffers ([WithStaging]): local device memory in chunks, pipelined,
// each posted to the backend as host memory; a peer's access to this
// agent's device memory through the lease the backend holds for it
// ([DeviceStager]). [Xfer.Path] says which ("tcp+staging").
//
// # Exposing memory
//
// The passive side of a transfer calls [Agent.Expose] with the access it
// grants ([AccessRead] or [AccessWrite]) and the regions. The [Exposure]'s
// [Key] is an unguessable capability: every remote access names it and is
// checked against the exposure's regions and access before a byte is
// touched. Send the key and the regions' addresses ([Region]) to the peer.
// [Exposure.Events] delivers the notifications sent to the key and the
// loss of the peer using it, in a small bounded queue per exposure (further
// events are counted dropped in [Stats]). [Exposure.Revoke] ends access
// and returns once no peer can touch the memory any more.
//
// # Transfers
//
// The active side calls [Agent.Post] with a [Request]: the direction
// ([OpRead] copies the peer's memory into local memory, [OpWrite] the
// reverse), the peer's [Info], the exposure's key, and segments
// ([Segment]) pairing local memory with remote regions of the same length. Post chooses a
// backend (the first that reaches the peer and moves the memory involved,
// or the one Request.Backend names), starts the transfer and returns an
// [*Xfer] without waiting. [Xfer.Done] is closed when the transfer has
// ended and the backend no longer touches local memory; [Xfer.Err] is then
// its outcome. [Xfer.Cancel] aborts it; Request.OnDone, if set, is called
// when it ends, without a goroutine per transfer. The segments' local
// memory must stay alive and untouched until Done is closed.
//
// # Notifications and peer loss
//
// A request may carry a notification (Request.Notify), which its backend
// delivers to the peer's exposure only after every byte is in place: right
// after the transfer reports success, so that the active side's waiter is
// not held up by it, or with the data itself where a backend can carry it
// there. [Agent.Close] waits for notifications being sent; one that fails
// cannot undo a success (it is counted, [Stats].LostNotifications, and the
// passive side sees the failure as a lost peer). [Agent.Notify] sends one
// on its own. The receiving agent hands each notification and each loss of a peer
// to the exposure that owns the key, on the delivering goroutine and
// without blocking: no polling, no hand-off. A peer is lost when a backend
// loses the channel it used the exposure through ([EventPeerLost]), or when
// [Agent.PeerDeparted] says so on word from outside the backends.
//
// # Closing
//
// [Agent.Close] cancels every transfer in flight and waits for it to end
// (unless it completed first, its error matches [ErrCancelled] and
// [ErrClosed]), revokes every exposure, then stops the backends. Errors are the package's sentinels ([ErrClosed],
// [ErrCancelled], [ErrRemoteLost], [ErrAccessDenied], [ErrNoBackend],
// [ErrInvalid], [ErrInvalidOption]), matched with [errors.Is].
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
//	x, _ := b.Post(ctx, agent.Request{Op: agent.OpRead, Peer: info, Key: key, Segments: segs, Notify: []byte("done")})
//	<-x.Done()
//	err := x.Err()
package agent
