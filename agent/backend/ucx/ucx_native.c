//go:build ucx

// ucx_native.c defines the native side of the UCX backend declared in
// ucx_native.h: the context and worker, the UCX callbacks that queue
// events for Go, and the wrappers native.go calls. The build constraint
// keeps it out of builds without the ucx tag, which have no cgo files here.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ucx_native.h"

struct gx_t {
	ucp_context_h ctx;
	ucp_worker_h  worker;
	gx_event     *ev;
	size_t        nev, cap;
	int           lost;  // events dropped for want of memory
	gx_cb        *kept;  // error callback arguments freed with the worker (see gx_ep_close)
};

// An operation's callback argument, or an endpoint error handler's, which
// must outlive every call UCX may still make with it.
struct gx_cb {
	gx_t    *g;
	uint64_t id;
	gx_cb   *next; // in g->kept
};

static void gx_push(gx_t *g, gx_event e) {
	if (g->nev == g->cap) {
		size_t cap = g->cap ? 2 * g->cap : 64;
		gx_event *ev = realloc(g->ev, cap * sizeof(*ev));
		if (ev == NULL) {
			free(e.buf);
			g->lost++;
			return;
		}
		g->ev = ev;
		g->cap = cap;
	}
	g->ev[g->nev++] = e;
}

static ucs_status_t gx_am_cb(void *arg, const void *header, size_t header_length,
                             void *data, size_t length, const ucp_am_recv_param_t *param) {
	gx_t *g = arg;
	gx_event e = {0};
	e.kind = GX_EV_AM;
	if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
		e.rndv = 1; // this backend sends eagerly only: a peer that does not is refused
		gx_push(g, e);
		return UCS_OK;
	}
	e.len = length;
	e.buf = malloc(length ? length : 1);
	if (e.buf == NULL) {
		g->lost++;
		return UCS_OK;
	}
	if (length) memcpy(e.buf, data, length);
	gx_push(g, e);
	return UCS_OK;
}

static void gx_done_cb(void *request, ucs_status_t status, void *user_data) {
	gx_cb *cb = user_data;
	gx_event e = {0};
	e.kind = GX_EV_DONE;
	e.id = cb->id;
	e.status = status;
	gx_push(cb->g, e);
	free(cb);
	ucp_request_free(request);
}

static void gx_free_cb(void *request, ucs_status_t status, void *user_data) {
	free(user_data);
	ucp_request_free(request);
}

static void gx_ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
	gx_cb *cb = arg;
	gx_event e = {0};
	e.kind = GX_EV_EPERR;
	e.id = cb->id;
	e.status = status;
	gx_push(cb->g, e);
}

ucs_status_t gx_init(gx_t **out, char **keys, char **vals, int n, int *efd, const char **what) {
	ucp_config_t *cfg;
	ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
	if (st != UCS_OK) {
		*what = "ucp_config_read";
		return st;
	}
	for (int i = 0; i < n; i++) {
		st = ucp_config_modify(cfg, keys[i], vals[i]);
		if (st != UCS_OK) {
			*what = keys[i];
			ucp_config_release(cfg);
			return st;
		}
	}
	gx_t *g = calloc(1, sizeof(*g));
	if (g == NULL) {
		ucp_config_release(cfg);
		*what = "calloc";
		return UCS_ERR_NO_MEMORY;
	}
	ucp_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
	p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
	p.mt_workers_shared = 1; // ucp_mem_map from the agent's goroutines
	p.name = "goxfer";
	st = ucp_init(&p, cfg, &g->ctx);
	ucp_config_release(cfg);
	if (st != UCS_OK) {
		free(g);
		*what = "ucp_init";
		return st;
	}
	ucp_worker_params_t wp;
	memset(&wp, 0, sizeof(wp));
	wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
	wp.thread_mode = UCS_THREAD_MODE_SINGLE; // only the progress thread touches it
	st = ucp_worker_create(g->ctx, &wp, &g->worker);
	if (st != UCS_OK) {
		ucp_cleanup(g->ctx);
		free(g);
		*what = "ucp_worker_create";
		return st;
	}
	ucp_am_handler_param_t hp;
	memset(&hp, 0, sizeof(hp));
	hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
	hp.id = GX_AM_ID;
	hp.cb = gx_am_cb;
	hp.arg = g;
	st = ucp_worker_set_am_recv_handler(g->worker, &hp);
	if (st == UCS_OK) st = ucp_worker_get_efd(g->worker, efd);
	if (st != UCS_OK) {
		*what = "ucp_worker_get_efd";
		ucp_worker_destroy(g->worker);
		ucp_cleanup(g->ctx);
		free(g);
		return st;
	}
	*out = g;
	return UCS_OK;
}

void gx_fini(gx_t *g) {
	ucp_worker_destroy(g->worker); // no callback comes after this
	ucp_cleanup(g->ctx);
	while (g->kept != NULL) {
		gx_cb *cb = g->kept;
		g->kept = cb->next;
		free(cb);
	}
	for (size_t i = 0; i < g->nev; i++) free(g->ev[i].buf);
	free(g->ev);
	free(g);
}

ucs_status_t gx_address(gx_t *g, void **addr, size_t *len) {
	ucp_address_t *a;
	ucs_status_t st = ucp_worker_get_address(g->worker, &a, len);
	if (st != UCS_OK) return st;
	*addr = malloc(*len);
	if (*addr == NULL) {
		ucp_worker_release_address(g->worker, a);
		return UCS_ERR_NO_MEMORY;
	}
	memcpy(*addr, a, *len);
	ucp_worker_release_address(g->worker, a);
	return UCS_OK;
}

unsigned gx_progress(gx_t *g, int rounds) {
	unsigned total = 0;
	for (int i = 0; i < rounds; i++) {
		unsigned n = ucp_worker_progress(g->worker);
		total += n;
		if (n == 0) break;
	}
	return total;
}

ucs_status_t gx_arm(gx_t *g) {
	return ucp_worker_arm(g->worker);
}

ucs_status_t gx_ep_create(gx_t *g, const void *addr, uint64_t id, ucp_ep_h *ep, gx_cb **cbp) {
	gx_cb *cb = malloc(sizeof(*cb));
	if (cb == NULL) return UCS_ERR_NO_MEMORY;
	cb->g = g;
	cb->id = id;
	cb->next = NULL;
	ucp_ep_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
	               UCP_EP_PARAM_FIELD_ERR_HANDLER;
	p.address = addr;
	p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
	p.err_handler.cb = gx_ep_err_cb;
	p.err_handler.arg = cb;
	ucs_status_t st = ucp_ep_create(g->worker, &p, ep);
	if (st != UCS_OK) {
		free(cb);
		return st;
	}
	*cbp = cb;
	return UCS_OK;
}

// UCX calls no error handler of an endpoint marked closed, and
// ucp_ep_close_nbx marks it before it returns NULL or a request; when it
// returns an error instead (the endpoint was not closed), the handler may
// still run, and epcb lives as long as the worker.
int gx_ep_close(gx_t *g, ucp_ep_h ep, gx_cb *epcb, int force, uint64_t id) {
	gx_cb *cb = malloc(sizeof(*cb));
	if (cb == NULL) force = 1;
	ucp_request_param_t p;
	memset(&p, 0, sizeof(p));
	p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
	p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
	if (cb != NULL) {
		cb->g = g;
		cb->id = id;
		p.op_attr_mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
		p.cb.send = gx_done_cb;
		p.user_data = cb;
	}
	ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
	if (UCS_PTR_IS_ERR(r)) {
		free(cb);
		epcb->next = g->kept;
		g->kept = epcb;
		return 0;
	}
	if (r == NULL) {
		free(cb);
		free(epcb);
		return 0;
	}
	if (cb == NULL) { // no memory for the callback: wait here
		while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(g->worker);
		ucp_request_free(r);
		free(epcb);
		return 0;
	}
	return 1;
}

ucs_status_t gx_am_send(ucp_ep_h ep, const void *msg, size_t n) {
	void *buf = malloc(n ? n : 1);
	if (buf == NULL) return UCS_ERR_NO_MEMORY;
	memcpy(buf, msg, n);
	ucp_request_param_t p;
	memset(&p, 0, sizeof(p));
	p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
	p.flags = UCP_AM_SEND_FLAG_EAGER;
	p.cb.send = gx_free_cb;
	p.user_data = buf;
	ucs_status_ptr_t r = ucp_am_send_nbx(ep, GX_AM_ID, NULL, 0, buf, n, &p);
	if (r == NULL) {
		free(buf);
		return UCS_OK;
	}
	if (UCS_PTR_IS_ERR(r)) {
		free(buf);
		return UCS_PTR_STATUS(r);
	}
	return UCS_OK;
}

// The operations' requests are released at once: the flush tells their
// outcome.
int gx_rma(gx_t *g, ucp_ep_h ep, int write, int n, const uint64_t *laddr, const uint64_t *raddr,
           const uint64_t *len, const uintptr_t *rkey, const uintptr_t *memh, uint64_t id, ucs_status_t *st) {
	ucp_request_param_t p;
	*st = UCS_OK;
	int i;
	for (i = 0; i < n; i++) {
		memset(&p, 0, sizeof(p));
		if (memh[i] != 0) {
			p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
			p.memh = (ucp_mem_h)memh[i];
		}
		void *buf = (void *)(uintptr_t)laddr[i];
		ucs_status_ptr_t r = write
			? ucp_put_nbx(ep, buf, len[i], raddr[i], (ucp_rkey_h)rkey[i], &p)
			: ucp_get_nbx(ep, buf, len[i], raddr[i], (ucp_rkey_h)rkey[i], &p);
		if (UCS_PTR_IS_ERR(r)) {
			*st = UCS_PTR_STATUS(r);
			break;
		}
		if (r != NULL) ucp_request_free(r);
	}
	gx_cb *cb = malloc(sizeof(*cb));
	if (cb == NULL) {
		if (*st == UCS_OK) *st = UCS_ERR_NO_MEMORY;
		return -1 - i;
	}
	cb->g = g;
	cb->id = id;
	memset(&p, 0, sizeof(p));
	p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
	p.cb.send = gx_done_cb;
	p.user_data = cb;
	ucs_status_ptr_t r = ucp_ep_flush_nbx(ep, &p);
	if (r == NULL || UCS_PTR_IS_ERR(r)) { // done at once: report it the same way
		gx_event e = {0};
		e.kind = GX_EV_DONE;
		e.id = id;
		e.status = r == NULL ? UCS_OK : UCS_PTR_STATUS(r);
		gx_push(g, e);
		free(cb);
	}
	return i;
}

ucs_status_t gx_map(gx_t *g, uint64_t addr, uint64_t len, int cuda, ucp_mem_h *memh) {
	ucp_mem_map_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
	p.address = (void *)(uintptr_t)addr;
	p.length = len;
	if (cuda) {
		p.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
		p.memory_type = UCS_MEMORY_TYPE_CUDA;
	}
	return ucp_mem_map(g->ctx, &p, memh);
}

ucs_status_t gx_unmap(gx_t *g, ucp_mem_h memh) {
	return ucp_mem_unmap(g->ctx, memh);
}

// gx_alloc maps with UCP_MEM_MAP_ALLOCATE: with shared-memory transports
// the memory is a segment peers map, so RMA into it is a plain copy.
ucs_status_t gx_alloc(gx_t *g, uint64_t len, ucp_mem_h *memh, void **addr, uint64_t *got) {
	ucp_mem_map_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
	p.address = NULL;
	p.length = len;
	p.flags = UCP_MEM_MAP_ALLOCATE;
	ucs_status_t st = ucp_mem_map(g->ctx, &p, memh);
	if (st != UCS_OK) return st;
	ucp_mem_attr_t a;
	memset(&a, 0, sizeof(a));
	a.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
	st = ucp_mem_query(*memh, &a);
	if (st != UCS_OK || a.address == NULL || a.length < len) {
		ucp_mem_unmap(g->ctx, *memh);
		return st != UCS_OK ? st : UCS_ERR_NO_MEMORY;
	}
	*addr = a.address;
	*got = a.length;
	return UCS_OK;
}

ucs_status_t gx_pack(gx_t *g, ucp_mem_h memh, void **buf, size_t *len) {
	return ucp_rkey_pack(g->ctx, memh, buf, len);
}

ucs_status_t gx_unpack(ucp_ep_h ep, const void *buf, uintptr_t *rkey) {
	ucp_rkey_h k;
	ucs_status_t st = ucp_ep_rkey_unpack(ep, buf, &k);
	if (st == UCS_OK) *rkey = (uintptr_t)k;
	return st;
}

void gx_rkey_destroy(uintptr_t rkey) {
	ucp_rkey_destroy((ucp_rkey_h)rkey);
}

int gx_cuda(gx_t *g) {
	ucp_context_attr_t a;
	memset(&a, 0, sizeof(a));
	a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
	if (ucp_context_query(g->ctx, &a) != UCS_OK) return 0;
	return (a.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

gx_event *gx_take(gx_t *g, size_t *n, int *lost) {
	gx_event *ev = g->ev;
	*n = g->nev;
	*lost = g->lost;
	g->ev = NULL;
	g->nev = g->cap = 0;
	g->lost = 0;
	return ev;
}
