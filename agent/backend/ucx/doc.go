// Package ucx is goxfer's backend over UCX (the Unified Communication X
// library NIXL's main backend runs on): through it goxfer reaches
// InfiniBand and RoCE verbs, shared memory and TCP, and, with a UCX built
// with CUDA, GPU memory.
//
// The backend is compiled only with the build tag ucx, against UCX 1.13 or
// later (Debian: apt-get install libucx-dev); without the tag the package
// still builds, and its backend fails to start with an error wrapping
// [ErrNotBuiltIn]:
//
//	go test -tags ucx ./agent/backend/ucx/
//	a, err := agent.New(agent.WithBackends(ucx.New(ucx.WithTransports("tcp,self"))))
//
// Each backend owns a UCP context and one worker, driven by one goroutine
// locked to its OS thread (the progress thread): it polls the worker while
// operations are outstanding and sleeps on the worker's event file
// descriptor otherwise. The agent's connection information carries the
// worker address; endpoints are created per remote agent, with peer error
// handling, and kept.
//
// A transfer is cut into leases (16 MiB by default). For each, the
// transferring agent asks the exposing one, in an active message, for
// access to the lease's ranges under the exposure's key; the exposing agent
// checks them ([agent.Host].Open and [agent.Lease.Slice]) and answers with
// the packed remote keys of the registrations holding them. The
// transferring agent then moves the bytes with one-sided ucp_get_nbx or
// ucp_put_nbx, flushes the endpoint (for a WRITE, remote completion), ends
// the lease, and after the last lease sends the notification. Revoking an
// exposure therefore waits for its leases. Transfers of at most 16 KiB
// ([WithInlineSize]) travel in the request and its answer instead, checked
// byte by byte by the exposing agent. [Backend.Alloc] places buffers in
// memory UCX allocates, which shared-memory transports share directly.
// Heartbeats on every connection bound how long a dead peer goes unnoticed
// ([WithTimeout]); [Backend.PeerDeparted] ([agent.Departer]) drops a peer a
// presence registry declared gone at once, and [Backend.Stats]
// ([agent.Counting]) counts what peers did wrong. See docs/ucx.md for the
// transports, the options, the trust model and measurements.
package ucx

import "errors"

// Name is the backend's name in metadata and reports ([agent.ConnInfo],
// [agent.Xfer.Backend]).
const Name = "ucx"

// ErrNotBuiltIn reports that this binary was built without the ucx build
// tag: the backend exists only as a placeholder whose Start, Post, Notify,
// Reachable and Alloc fail with it.
var ErrNotBuiltIn = errors.New("ucx: not built in: rebuild with -tags ucx against libucx-dev (UCX 1.13+)")

// ErrNotAllocated reports a [Backend.Free] of memory the backend did not
// allocate, or has freed already.
var ErrNotAllocated = errors.New("ucx: not allocated by this backend, or freed already")

// ErrInUse reports a [Backend.Free] of memory that is still registered with
// the agent, or used by a lease or a transfer.
var ErrInUse = errors.New("ucx: memory in use")
