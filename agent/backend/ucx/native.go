//go:build ucx

package ucx

/*
#cgo LDFLAGS: -lucp -luct -lucs
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>

// The native side of the backend. Every function that takes a gx_t runs on
// the backend's progress thread, except gx_map, gx_unmap and gx_pack, which
// touch only the context (created with mt_workers_shared, so UCX locks it).
// Callbacks never call into Go: they append events to g->ev, which the
// progress loop drains after each ucp_worker_progress. Nothing here keeps a
// pointer to Go memory except the addresses of registered regions and of
// transfers in flight, which the agent's contract keeps alive and in place.

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

typedef struct gx_cb gx_cb;

typedef struct {
	ucp_context_h ctx;
	ucp_worker_h  worker;
	gx_event     *ev;
	size_t        nev, cap;
	int           lost;  // events dropped for want of memory
	gx_cb        *kept;  // error callback arguments freed with the worker (see gx_ep_close)
} gx_t;

// gx_cb is a callback's argument: an operation's, or an endpoint error
// handler's, which must outlive every call UCX may still make with it.
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

// gx_init reads UCX's configuration from the environment, applies the
// n key=value overrides, and creates the context and a worker with wakeup
// support. On failure it returns the status and names the step in *what.
static ucs_status_t gx_init(gx_t **out, char **keys, char **vals, int n, int *efd, const char **what) {
	ucp_config_t *cfg;
	ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
	if (st != UCS_OK) { *what = "ucp_config_read"; return st; }
	for (int i = 0; i < n; i++) {
		st = ucp_config_modify(cfg, keys[i], vals[i]);
		if (st != UCS_OK) { *what = keys[i]; ucp_config_release(cfg); return st; }
	}
	gx_t *g = calloc(1, sizeof(*g));
	if (g == NULL) { ucp_config_release(cfg); *what = "calloc"; return UCS_ERR_NO_MEMORY; }
	ucp_params_t p;
	memset(&p, 0, sizeof(p));
	p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
	p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
	p.mt_workers_shared = 1; // ucp_mem_map from the agent's goroutines
	p.name = "goxfer";
	st = ucp_init(&p, cfg, &g->ctx);
	ucp_config_release(cfg);
	if (st != UCS_OK) { free(g); *what = "ucp_init"; return st; }
	ucp_worker_params_t wp;
	memset(&wp, 0, sizeof(wp));
	wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
	wp.thread_mode = UCS_THREAD_MODE_SINGLE; // only the progress thread touches it
	st = ucp_worker_create(g->ctx, &wp, &g->worker);
	if (st != UCS_OK) { ucp_cleanup(g->ctx); free(g); *what = "ucp_worker_create"; return st; }
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

static void gx_fini(gx_t *g) {
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

static ucs_status_t gx_address(gx_t *g, void **addr, size_t *len) {
	ucp_address_t *a;
	ucs_status_t st = ucp_worker_get_address(g->worker, &a, len);
	if (st != UCS_OK) return st;
	*addr = malloc(*len);
	if (*addr == NULL) { ucp_worker_release_address(g->worker, a); return UCS_ERR_NO_MEMORY; }
	memcpy(*addr, a, *len);
	ucp_worker_release_address(g->worker, a);
	return UCS_OK;
}

// gx_progress progresses the worker until it has nothing more to do, at
// most rounds times, and returns how many times it made progress.
static unsigned gx_progress(gx_t *g, int rounds) {
	unsigned total = 0;
	for (int i = 0; i < rounds; i++) {
		unsigned n = ucp_worker_progress(g->worker);
		total += n;
		if (n == 0) break;
	}
	return total;
}

static ucs_status_t gx_arm(gx_t *g) { return ucp_worker_arm(g->worker); }

// gx_ep_create connects to the worker at addr with peer error handling:
// a failure of the peer is reported as a GX_EV_EPERR event naming id. *cbp
// is the callback's argument, freed by gx_ep_free once the endpoint is gone.
static ucs_status_t gx_ep_create(gx_t *g, const void *addr, uint64_t id, ucp_ep_h *ep, gx_cb **cbp) {
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
	if (st != UCS_OK) { free(cb); return st; }
	*cbp = cb;
	return UCS_OK;
}

// gx_ep_close closes ep, whose error handler's argument is epcb; force
// drops what is queued. It returns 1 when the close completes later, with a
// GX_EV_DONE event naming id: epcb is the caller's to free after that event.
// Otherwise gx_ep_close disposes of epcb. UCX calls no error handler of an
// endpoint marked closed, and ucp_ep_close_nbx marks it before it returns
// NULL or a request; when it returns an error instead (the endpoint was not
// closed), the handler may still run, and epcb lives as long as the worker.
static int gx_ep_close(gx_t *g, ucp_ep_h ep, gx_cb *epcb, int force, uint64_t id) {
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

// gx_am_send sends the n bytes at msg (copied first) as an active message,
// eagerly. The copy is freed when the send completes.
static ucs_status_t gx_am_send(ucp_ep_h ep, const void *msg, size_t n) {
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
	if (r == NULL) { free(buf); return UCS_OK; }
	if (UCS_PTR_IS_ERR(r)) { free(buf); return UCS_PTR_STATUS(r); }
	return UCS_OK;
}

// gx_rma posts n gets (write == 0) or puts, then a flush of ep that
// reports completion of all of them as a GX_EV_DONE event naming id. The
// operations' requests are released at once: the flush tells their
// outcome. It returns how many operations were posted; *st is the first
// failure to post, which stops posting (the flush is still posted).
static int gx_rma(gx_t *g, ucp_ep_h ep, int write, int n, const uint64_t *laddr, const uint64_t *raddr,
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

static ucs_status_t gx_map(gx_t *g, uint64_t addr, uint64_t len, int cuda, ucp_mem_h *memh) {
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

static ucs_status_t gx_unmap(gx_t *g, ucp_mem_h memh) { return ucp_mem_unmap(g->ctx, memh); }

// gx_alloc has UCX allocate len bytes of host memory and map them
// (UCP_MEM_MAP_ALLOCATE): with shared-memory transports the memory is a
// segment peers map, so RMA into it is a plain copy. *addr is where it lies.
static ucs_status_t gx_alloc(gx_t *g, uint64_t len, ucp_mem_h *memh, void **addr, uint64_t *got) {
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

static ucs_status_t gx_pack(gx_t *g, ucp_mem_h memh, void **buf, size_t *len) {
	return ucp_rkey_pack(g->ctx, memh, buf, len);
}

static ucs_status_t gx_unpack(ucp_ep_h ep, const void *buf, uintptr_t *rkey) {
	ucp_rkey_h k;
	ucs_status_t st = ucp_ep_rkey_unpack(ep, buf, &k);
	if (st == UCS_OK) *rkey = (uintptr_t)k;
	return st;
}

static void gx_rkey_destroy(uintptr_t rkey) { ucp_rkey_destroy((ucp_rkey_h)rkey); }

// gx_cuda reports whether the context can reach CUDA memory.
static int gx_cuda(gx_t *g) {
	ucp_context_attr_t a;
	memset(&a, 0, sizeof(a));
	a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
	if (ucp_context_query(g->ctx, &a) != UCS_OK) return 0;
	return (a.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

// gx_take moves the queued events to the caller, which frees them with free.
static gx_event *gx_take(gx_t *g, size_t *n, int *lost) {
	gx_event *ev = g->ev;
	*n = g->nev;
	*lost = g->lost;
	g->ev = NULL;
	g->nev = g->cap = 0;
	g->lost = 0;
	return ev;
}
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// status is a UCX status code as an error.
type status C.ucs_status_t

func (s status) Error() string {
	return C.GoString(C.ucs_status_string(C.ucs_status_t(s)))
}

// statusErr returns nil for UCS_OK, else the status with what failed.
func statusErr(what string, st C.ucs_status_t) error {
	if st == C.UCS_OK {
		return nil
	}
	return fmt.Errorf("ucx: %s: %w", what, status(st))
}

// native is the backend's UCX context and worker.
type native struct {
	g   *C.gx_t
	efd int
}

// event is a drained native event, with the message copied to Go memory.
type event struct {
	kind   uint8
	rndv   bool
	id     uint64
	status C.ucs_status_t
	msg    []byte
}

func newNative(settings [][2]string) (*native, error) {
	keys := make([]*C.char, len(settings))
	vals := make([]*C.char, len(settings))
	for i, kv := range settings {
		keys[i], vals[i] = C.CString(kv[0]), C.CString(kv[1])
	}
	defer func() {
		for i := range keys {
			C.free(unsafe.Pointer(keys[i]))
			C.free(unsafe.Pointer(vals[i]))
		}
	}()
	// The arrays of C string pointers live in C memory: cgo forbids passing
	// Go memory that holds pointers.
	n := max(len(settings), 1)
	ck := (*[1 << 20]*C.char)(C.malloc(C.size_t(n) * C.size_t(unsafe.Sizeof(uintptr(0)))))
	cv := (*[1 << 20]*C.char)(C.malloc(C.size_t(n) * C.size_t(unsafe.Sizeof(uintptr(0)))))
	defer C.free(unsafe.Pointer(ck))
	defer C.free(unsafe.Pointer(cv))
	for i := range settings {
		ck[i], cv[i] = keys[i], vals[i]
	}
	var g *C.gx_t
	var efd C.int
	var what *C.char
	st := C.gx_init(&g, &ck[0], &cv[0], C.int(len(settings)), &efd, &what)
	if st != C.UCS_OK {
		return nil, fmt.Errorf("ucx: %s: %w", C.GoString(what), status(st))
	}
	return &native{g: g, efd: int(efd)}, nil
}

func (n *native) close() { C.gx_fini(n.g) }

func (n *native) address() ([]byte, error) {
	var p unsafe.Pointer
	var l C.size_t
	if err := statusErr("ucp_worker_get_address", C.gx_address(n.g, &p, &l)); err != nil {
		return nil, err
	}
	defer C.free(p)
	return C.GoBytes(p, C.int(l)), nil
}

func (n *native) cuda() bool { return C.gx_cuda(n.g) != 0 }

func (n *native) progress() uint { return uint(C.gx_progress(n.g, 64)) }

// arm returns true when the worker may sleep until its event fd fires.
func (n *native) arm() bool { return C.gx_arm(n.g) == C.UCS_OK }

// take drains the native event queue into evs.
func (n *native) take(evs []event) ([]event, int) {
	var cnt C.size_t
	var lost C.int
	p := C.gx_take(n.g, &cnt, &lost)
	if p == nil {
		return evs, int(lost)
	}
	defer C.free(unsafe.Pointer(p))
	for _, e := range unsafe.Slice(p, int(cnt)) {
		ev := event{kind: uint8(e.kind), rndv: e.rndv != 0, id: uint64(e.id), status: C.ucs_status_t(e.status)}
		if e.buf != nil {
			ev.msg = C.GoBytes(e.buf, C.int(e.len))
			C.free(e.buf)
		}
		evs = append(evs, ev)
	}
	return evs, int(lost)
}

// endpoint is a UCX endpoint and its error callback's argument.
type endpoint struct {
	ep C.ucp_ep_h
	cb *C.gx_cb
}

func (n *native) connect(addr []byte, id uint64) (endpoint, error) {
	if len(addr) == 0 {
		return endpoint{}, fmt.Errorf("ucx: empty worker address")
	}
	ca := C.CBytes(addr)
	defer C.free(ca)
	var e endpoint
	if err := statusErr("ucp_ep_create", C.gx_ep_create(n.g, ca, C.uint64_t(id), &e.ep, &e.cb)); err != nil {
		return endpoint{}, err
	}
	return e, nil
}

// closeEP starts closing e and reports whether a done event naming id
// will follow; then e's error callback argument is the caller's to free
// with freeEP once the event came (or the worker is destroyed), when no
// callback can come any more. Otherwise closeEP disposed of it.
func (n *native) closeEP(e endpoint, force bool, id uint64) bool {
	f := C.int(0)
	if force {
		f = 1
	}
	return C.gx_ep_close(n.g, e.ep, e.cb, f, C.uint64_t(id)) != 0
}

func freeEP(e endpoint) { C.free(unsafe.Pointer(e.cb)) }

func (n *native) send(e endpoint, msg []byte) error {
	var p unsafe.Pointer
	if len(msg) > 0 {
		p = unsafe.Pointer(&msg[0])
	}
	return statusErr("ucp_am_send_nbx", C.gx_am_send(e.ep, p, C.size_t(len(msg))))
}

// rmaBatch holds the arguments of one gx_rma call; reused.
type rmaBatch struct {
	laddr, raddr, length []uint64
	rkey, memh           []uintptr
}

func (b *rmaBatch) reset() {
	b.laddr, b.raddr, b.length = b.laddr[:0], b.raddr[:0], b.length[:0]
	b.rkey, b.memh = b.rkey[:0], b.memh[:0]
}

func (b *rmaBatch) add(laddr, raddr, n uint64, rkey, memh uintptr) {
	b.laddr = append(b.laddr, laddr)
	b.raddr = append(b.raddr, raddr)
	b.length = append(b.length, n)
	b.rkey = append(b.rkey, rkey)
	b.memh = append(b.memh, memh)
}

// rma posts b's operations and a flush reported as a done event naming
// id. The flush is posted even when posting an operation fails, so the
// done event always comes; the error says what failed.
func (n *native) rma(e endpoint, write bool, b *rmaBatch, id uint64) error {
	cnt := len(b.laddr)
	if cnt == 0 {
		b.add(0, 0, 0, 0, 0) // keep the slices addressable; n below is 0
	}
	w := C.int(0)
	if write {
		w = 1
	}
	var st C.ucs_status_t
	r := C.gx_rma(n.g, e.ep, w, C.int(cnt),
		(*C.uint64_t)(unsafe.Pointer(&b.laddr[0])), (*C.uint64_t)(unsafe.Pointer(&b.raddr[0])),
		(*C.uint64_t)(unsafe.Pointer(&b.length[0])), (*C.uintptr_t)(unsafe.Pointer(&b.rkey[0])),
		(*C.uintptr_t)(unsafe.Pointer(&b.memh[0])), C.uint64_t(id), &st)
	if r < 0 {
		return fmt.Errorf("ucx: flush: %w", status(st))
	}
	if st != C.UCS_OK {
		op := "get"
		if write {
			op = "put"
		}
		return fmt.Errorf("ucx: post %s %d of %d: %w", op, int(r), cnt, status(st))
	}
	return nil
}

// memh is a registration of memory with the context.
type memh = C.ucp_mem_h

func (n *native) mapMem(addr, length uint64, cuda bool) (memh, error) {
	var m C.ucp_mem_h
	c := C.int(0)
	if cuda {
		c = 1
	}
	if err := statusErr("ucp_mem_map", C.gx_map(n.g, C.uint64_t(addr), C.uint64_t(length), c, &m)); err != nil {
		return nil, err
	}
	return m, nil
}

func (n *native) unmap(m memh) error { return statusErr("ucp_mem_unmap", C.gx_unmap(n.g, m)) }

// allocMem has UCX allocate and map length bytes of host memory. It
// returns the mapping, where the memory lies and how long it is (at least
// length).
func (n *native) allocMem(length uint64) (memh, unsafe.Pointer, uint64, error) {
	var m C.ucp_mem_h
	var p unsafe.Pointer
	var got C.uint64_t
	if err := statusErr("ucp_mem_map(ALLOCATE)", C.gx_alloc(n.g, C.uint64_t(length), &m, &p, &got)); err != nil {
		return nil, nil, 0, err
	}
	return m, p, uint64(got), nil
}

// pack returns the packed remote key of m, in Go memory.
func (n *native) pack(m memh) ([]byte, error) {
	var p unsafe.Pointer
	var l C.size_t
	if err := statusErr("ucp_rkey_pack", C.gx_pack(n.g, m, &p, &l)); err != nil {
		return nil, err
	}
	defer C.ucp_rkey_buffer_release(p)
	return C.GoBytes(p, C.int(l)), nil
}

// unpack unpacks a remote key for use on e.
func unpack(e endpoint, packed []byte) (uintptr, error) {
	if len(packed) == 0 {
		return 0, fmt.Errorf("ucx: empty remote key")
	}
	cp := C.CBytes(packed)
	defer C.free(cp)
	var k C.uintptr_t
	if err := statusErr("ucp_ep_rkey_unpack", C.gx_unpack(e.ep, cp, &k)); err != nil {
		return 0, err
	}
	return uintptr(k), nil
}

func destroyRkey(k uintptr) { C.gx_rkey_destroy(C.uintptr_t(k)) }

const (
	evAM    = C.GX_EV_AM
	evDone  = C.GX_EV_DONE
	evEPErr = C.GX_EV_EPERR
)

func memhPtr(m memh) uintptr { return uintptr(unsafe.Pointer(m)) }

// ucxVersion returns the version of the UCX library loaded.
func ucxVersion() (major, minor, release int) {
	var a, b, c C.uint
	C.ucp_get_version(&a, &b, &c)
	return int(a), int(b), int(c)
}
