// Package cma is goxfer's same-host backend: two agents on one Linux host
// move bytes with cross-memory attach (process_vm_readv and
// process_vm_writev), one copy straight between their memories, with no
// help from the exposing process's threads.
//
// Each agent listens on a Unix-domain socket in the abstract namespace. The
// agent that copies (the active side) connects to the exposing one (the
// passive side) once per peer; the connection carries only control traffic:
// a handshake, lease requests and their answers, lease ends and
// notifications. Before each span of a transfer (16 MiB by default) is
// copied, the exposing agent grants a lease over the socket after checking
// the key, the access kind and every range against its exposures, exactly
// as the tcp backend checks a frame; the copying agent ends the lease right
// after. Revoking an exposure therefore waits for the leases granted on it,
// and no peer touches its memory afterwards. A peer that dies holding a
// lease closes its socket, which releases the lease.
//
// Small transfers skip the lease round trip where both agents agreed a
// lease table for the connection (same user; WithSharedMemory and
// WithLeaseFree): the exposing agent publishes its exposures of one host
// region there, and a transfer of at most 1 MiB inside one is copied at
// once, inside the table's slot for the exposure, which revocation marks
// and then waits for (path "cma+table"; exposures in shared segments are
// copied through the segments mapped, "cma+shm").
//
// GPU memory (VRAM) is staged through pinned host buffers by the agent that
// holds it ([agent.DeviceStager]): this side's before cma sees it, the
// exposing side's per lease, whose grant then names the buffers to copy at.
// Leases over a peer's GPU memory cover at most 4 MiB, four requested ahead
// per transfer, so that the peer's device copies overlap this side's.
//
// The backend reaches a peer only if the peer publishes the same host
// identity (boot ID, PID and network namespaces) and a trial read of its
// memory, made when connecting, succeeds. Otherwise Reachable says why, and
// the agent falls back to its next backend (tcp), logs the reason once and
// reports the backend it used on the transfer ([agent.Xfer.Backend]).
//
//	a, err := agent.New(agent.WithBackends(cma.New(), tcp.New()))
//
// On other systems than Linux the backend builds but reaches no peer.
// docs/cma.md describes the protocol, its bounds and the options in full.
package cma

// Name is the backend's name in metadata, errors and reports
// ([agent.Xfer.Backend]).
const Name = "cma"
