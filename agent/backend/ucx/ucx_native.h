//go:build ucx

// ucx_native.h declares the native side of the UCX backend: the event
// queue's types and constants, which native.go reads, and the gx_*
// functions it calls. ucx_native.c defines them.
//
// Every function that takes a gx_t runs on the backend's progress thread,
// except gx_map, gx_unmap and gx_pack, which touch only the context
// (created with mt_workers_shared, so UCX locks it). Callbacks never call
// into Go: they append events to the gx_t's queue, which the progress loop
// drains with gx_take after each progress. Nothing here keeps a pointer to
// Go memory except the addresses of registered regions and of transfers in
// flight, which the agent's contract keeps alive and in place.

#ifndef GOXFER_UCX_NATIVE_H
#define GOXFER_UCX_NATIVE_H

#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

enum { GX_AM_ID = 0x6778 };
enum { GX_EV_AM = 1, GX_EV_DONE = 2, GX_EV_EPERR = 3 };

typedef struct {
	uint64_t id;     // GX_EV_DONE: the operation; GX_EV_EPERR: the endpoint
	void    *buf;    // GX_EV_AM: a malloc'd copy of the message, freed by Go
	size_t   len;
	int32_t  status;
	uint8_t  kind;
	uint8_t  rndv;   // GX_EV_AM: the peer sent a rendezvous message (refused)
} gx_event;

// gx_t is a context, its worker and its event queue; opaque outside
// ucx_native.c.
typedef struct gx_t gx_t;

// gx_cb is a callback's argument: an operation's, or an endpoint error
// handler's. Go holds only pointers to it, and frees an endpoint's with
// free as gx_ep_close says.
typedef struct gx_cb gx_cb;

// gx_init reads UCX's configuration from the environment, applies the
// n key=value overrides, and creates the context and a worker with wakeup
// support. On failure it returns the status and names the step in *what.
ucs_status_t gx_init(gx_t **out, char **keys, char **vals, int n, int *efd, const char **what);

// gx_fini destroys the worker and the context and frees g.
void gx_fini(gx_t *g);

// gx_address returns a malloc'd copy of the worker's address.
ucs_status_t gx_address(gx_t *g, void **addr, size_t *len);

// gx_progress progresses the worker until it has nothing more to do, at
// most rounds times, and returns how many times it made progress.
unsigned gx_progress(gx_t *g, int rounds);

// gx_arm arms the worker's event fd (ucp_worker_arm).
ucs_status_t gx_arm(gx_t *g);

// gx_ep_create connects to the worker at addr with peer error handling:
// a failure of the peer is reported as a GX_EV_EPERR event naming id. *cbp
// is the callback's argument, disposed of as gx_ep_close says.
ucs_status_t gx_ep_create(gx_t *g, const void *addr, uint64_t id, ucp_ep_h *ep, gx_cb **cbp);

// gx_ep_close closes ep, whose error handler's argument is epcb; force
// drops what is queued. It returns 1 when the close completes later, with a
// GX_EV_DONE event naming id: epcb is the caller's to free after that event.
// Otherwise gx_ep_close disposes of epcb.
int gx_ep_close(gx_t *g, ucp_ep_h ep, gx_cb *epcb, int force, uint64_t id);

// gx_am_send sends the n bytes at msg (copied first) as an active message,
// eagerly. The copy is freed when the send completes.
ucs_status_t gx_am_send(ucp_ep_h ep, const void *msg, size_t n);

// gx_rma posts n gets (write == 0) or puts, then a flush of ep that
// reports completion of all of them as a GX_EV_DONE event naming id. It
// returns how many operations were posted, or -1 - that many when the
// flush could not be posted; *st is the first failure to post, which stops
// posting (the flush is still posted).
int gx_rma(gx_t *g, ucp_ep_h ep, int write, int n, const uint64_t *laddr, const uint64_t *raddr,
           const uint64_t *len, const uintptr_t *rkey, const uintptr_t *memh, uint64_t id, ucs_status_t *st);

// gx_map registers len bytes at addr (CUDA memory when cuda != 0).
ucs_status_t gx_map(gx_t *g, uint64_t addr, uint64_t len, int cuda, ucp_mem_h *memh);

// gx_unmap releases a registration made by gx_map or gx_alloc.
ucs_status_t gx_unmap(gx_t *g, ucp_mem_h memh);

// gx_alloc has UCX allocate len bytes of host memory and map them; *addr
// is where they lie and *got (at least len) how many there are.
ucs_status_t gx_alloc(gx_t *g, uint64_t len, ucp_mem_h *memh, void **addr, uint64_t *got);

// gx_pack packs memh's remote key into *buf, released with
// ucp_rkey_buffer_release.
ucs_status_t gx_pack(gx_t *g, ucp_mem_h memh, void **buf, size_t *len);

// gx_unpack unpacks a remote key for use on ep; gx_rkey_destroy frees it.
ucs_status_t gx_unpack(ucp_ep_h ep, const void *buf, uintptr_t *rkey);
void gx_rkey_destroy(uintptr_t rkey);

// gx_cuda reports whether the context can reach CUDA memory.
int gx_cuda(gx_t *g);

// gx_take moves the queued events to the caller, which frees them (and
// each event's buf) with free. *lost is how many events were dropped for
// want of memory since the last call.
gx_event *gx_take(gx_t *g, size_t *n, int *lost);

#endif // GOXFER_UCX_NATIVE_H
