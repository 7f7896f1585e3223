// A fake libcuda.so.1 for the tests of the purego binding on machines without
// a GPU. It implements the driver calls goxfer binds, with the C prototypes
// of cuda.h, over host memory, and is stricter than the real driver where
// that catches binding mistakes: every call that needs a context fails with
// CUDA_ERROR_INVALID_CONTEXT unless the right one is current on the calling
// thread (and counts it), pinned memory must be asked for as portable,
// streams as non-blocking, and copies run only at cuStreamSynchronize, so a
// caller that reads a copy's result before Sync sees stale bytes.
//
// Sharing: legacy IPC handles round-trip within the fake (it is one process,
// so cuIpcOpenMemHandle_v2 maps the allocation's pages a second time, at
// another address, with mremap), and it checks all 64 bytes of a handle it
// is given by value and keeps the last one for the tests. VMM memory is a
// memfd per cuMemCreate, mapped into reservations of PROT_NONE address
// space, exported as a dup of the memfd and imported by matching its
// inode. Structures passed by pointer are checked field by field against
// cuda.h's layouts.
//
// Build knobs: -DINIT_RESULT=n makes cuInit fail with n; -DVERSION=n sets
// the driver version; -DOMIT_MEMALLOC leaves cuMemAlloc_v2 out; -DOMIT_VMM
// leaves every VMM entry point out, -DOMIT_IPC the IPC ones, -DOMIT_UUID_V2
// cuDeviceGetUuid_v2; -DNO_MAPPING_ATTRS refuses the pointer attributes of
// CUDA 12 (MAPPING_SIZE, MAPPING_BASE_ADDR, MEMPOOL_HANDLE) as older
// drivers do. fake_fail(name, code) makes the next call of the VMM or IPC
// entry point name fail with code.

#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef INIT_RESULT
#define INIT_RESULT 0
#endif
#ifndef VERSION
#define VERSION 12040
#endif

typedef int CUresult;
typedef uint64_t CUdeviceptr;
typedef int CUdevice;
typedef struct fake_ctx {
	int dev;
} *CUcontext;

enum {
	OK = 0,
	INVALID_VALUE = 1,
	NOT_INITIALIZED = 3,
	NO_DEVICE = 100,
	INVALID_DEVICE = 101,
	INVALID_CONTEXT = 201,
	INVALID_HANDLE = 400,
	NOT_SUPPORTED = 801,
};

#define NDEV 2

static struct fake_ctx primaries[NDEV] = {{0}, {1}};
static struct fake_ctx foreign = {-1}; // no GPU's primary: another library's context
static int inited;
static long wrong_context, retains[NDEV];
static __thread CUcontext current;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

enum { K_MEM, K_HOST, K_IPC, K_VMM };

struct vmm; // a cuMemCreate allocation

struct alloc {
	uintptr_t base;
	size_t size;
	int dev, host;
	int kind;                 // K_*
	unsigned long long id;    // BUFFER_ID
	struct vmm *h;            // K_VMM: the allocation mapped
	uintptr_t res_base;       // K_VMM: the reservation holding the mapping
	size_t res_size;
	int access;               // K_VMM: cuMemSetAccess was called
	struct alloc *next;
};
static struct alloc *allocs;
static long live_streams;
static unsigned long long next_id = 1;

struct op {
	void *dst;
	const void *src;
	size_t n;
};
typedef struct fake_stream {
	CUcontext ctx;
	struct op *ops;
	size_t nops, cap;
} *CUstream;

static int known_ctx(CUcontext c) {
	return c == NULL || c == &foreign || (c >= primaries && c < primaries + NDEV);
}

// need checks that a GPU's context is current; want, if not NULL, is the
// one that must be.
static CUresult need(CUcontext want) {
	if (!inited)
		return NOT_INITIALIZED;
	if (current == NULL || current == &foreign || (want != NULL && current != want)) {
		__atomic_add_fetch(&wrong_context, 1, __ATOMIC_SEQ_CST);
		return INVALID_CONTEXT;
	}
	return OK;
}

// find returns the allocation holding [p, p+n), the caller holding mu.
static struct alloc *find(uintptr_t p, size_t n) {
	for (struct alloc *a = allocs; a; a = a->next)
		if (p >= a->base && p < a->base + a->size)
			return n <= a->size - (p - a->base) ? a : NULL;
	return NULL;
}

CUresult cuInit(unsigned flags) {
	if (flags != 0)
		return INVALID_VALUE;
	if (INIT_RESULT != 0)
		return INIT_RESULT;
	inited = 1;
	return OK;
}

static char fail_name[64];
static CUresult fail_code;

// injected returns the result to fail a call of fn with, or OK.
static CUresult injected(const char *fn) {
	CUresult r = OK;
	pthread_mutex_lock(&mu);
	if (fail_name[0] && strcmp(fail_name, fn) == 0) {
		r = fail_code;
		fail_name[0] = 0;
	}
	pthread_mutex_unlock(&mu);
	return r;
}

CUresult cuGetErrorName(CUresult r, const char **s) {
	switch (r) {
	case OK: *s = "CUDA_SUCCESS"; break;
	case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
	case NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
	case NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; break;
	case INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
	case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
	case INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
	case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
	case NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
	default: *s = NULL; return INVALID_VALUE;
	}
	return OK;
}

CUresult cuDriverGetVersion(int *v) {
	*v = VERSION;
	return OK;
}

CUresult cuDeviceGetCount(int *n) {
	if (!inited)
		return NOT_INITIALIZED;
	*n = NDEV;
	return OK;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
	if (!inited)
		return NOT_INITIALIZED;
	if (ordinal < 0 || ordinal >= NDEV)
		return INVALID_DEVICE;
	*d = ordinal;
	return OK;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
	if (!inited)
		return NOT_INITIALIZED;
	if (d < 0 || d >= NDEV)
		return INVALID_DEVICE;
	__atomic_add_fetch(&retains[d], 1, __ATOMIC_SEQ_CST);
	*c = &primaries[d];
	return OK;
}

CUresult cuCtxGetCurrent(CUcontext *c) {
	if (!inited)
		return NOT_INITIALIZED;
	*c = current;
	return OK;
}

CUresult cuCtxSetCurrent(CUcontext c) {
	if (!inited)
		return NOT_INITIALIZED;
	if (!known_ctx(c))
		return INVALID_CONTEXT;
	current = c;
	return OK;
}

static size_t pages(size_t n) {
	size_t ps = (size_t)sysconf(_SC_PAGESIZE);
	return (n + ps - 1) / ps * ps;
}

// add records an allocation, returning it, or NULL out of memory.
static struct alloc *add(uintptr_t p, size_t n, int dev, int kind) {
	struct alloc *a = calloc(1, sizeof *a);
	if (a == NULL)
		return NULL;
	pthread_mutex_lock(&mu);
	*a = (struct alloc){.base = p, .size = n, .dev = dev, .host = kind == K_HOST, .kind = kind, .id = next_id++};
	a->next = allocs;
	allocs = a;
	pthread_mutex_unlock(&mu);
	return a;
}

static CUresult track(void *p, size_t n, int dev, int host) {
	if (p == NULL || add((uintptr_t)p, n, dev, host ? K_HOST : K_MEM) == NULL) {
		free(p);
		return 2; // CUDA_ERROR_OUT_OF_MEMORY
	}
	return OK;
}

// take removes and returns the allocation of that kind at p, or NULL.
static struct alloc *take(uintptr_t p, int kind) {
	pthread_mutex_lock(&mu);
	for (struct alloc **pa = &allocs; *pa; pa = &(*pa)->next) {
		struct alloc *a = *pa;
		if (a->base == p && a->kind == kind) {
			*pa = a->next;
			pthread_mutex_unlock(&mu);
			return a;
		}
	}
	pthread_mutex_unlock(&mu);
	return NULL;
}

static CUresult untrack(uintptr_t p, int host) {
	struct alloc *a = take(p, host ? K_HOST : K_MEM);
	if (a == NULL)
		return INVALID_VALUE;
	if (host)
		free((void *)a->base);
	else
		munmap((void *)a->base, pages(a->size));
	free(a);
	return OK;
}

#ifndef OMIT_MEMALLOC
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
	CUresult r = need(NULL);
	if (r != OK)
		return r;
	if (n == 0)
		return INVALID_VALUE;
	// Shared, so that an IPC handle can map the same pages again.
	void *m = mmap(NULL, pages(n), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED)
		return 2;
	if (add((uintptr_t)m, n, current->dev, K_MEM) == NULL) {
		munmap(m, pages(n));
		return 2;
	}
	*p = (CUdeviceptr)(uintptr_t)m;
	return OK;
}
#endif

CUresult cuMemFree_v2(CUdeviceptr p) {
	CUresult r = need(NULL);
	return r != OK ? r : untrack((uintptr_t)p, 0);
}

CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
	CUresult r = need(NULL);
	if (r != OK)
		return r;
	if (n == 0 || flags != 1) // CU_MEMHOSTALLOC_PORTABLE, and nothing else
		return INVALID_VALUE;
	void *m = malloc(n);
	if ((r = track(m, n, -1, 1)) != OK)
		return r;
	*p = m;
	return OK;
}

CUresult cuMemFreeHost(void *p) {
	CUresult r = need(NULL);
	return r != OK ? r : untrack((uintptr_t)p, 1);
}

static unsigned vmm_types(const struct alloc *a);

CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, CUdeviceptr p) {
	if (!inited)
		return NOT_INITIALIZED;
	if (p < 0x10000)
		return INVALID_VALUE; // as drivers before CUDA 11 answer for unknown pointers
	pthread_mutex_lock(&mu);
	struct alloc *a = find((uintptr_t)p, 1);
	struct alloc c = a ? *a : (struct alloc){0};
	pthread_mutex_unlock(&mu);
	for (unsigned i = 0; i < n; i++) {
		switch (attrs[i]) {
#ifdef NO_MAPPING_ATTRS
		case 17: case 18: case 19: return INVALID_VALUE;
#endif
		default: break;
		}
	}
	for (unsigned i = 0; i < n; i++) {
		switch (attrs[i]) {
		case 2: *(unsigned *)data[i] = a ? (c.host ? 1 : 2) : 0; break; // MEMORY_TYPE
		case 7: *(unsigned long long *)data[i] = c.id; break;           // BUFFER_ID
		case 8: *(unsigned char *)data[i] = 0; break;                    // IS_MANAGED: a bool
		case 9: *(int *)data[i] = a ? c.dev : -2; break;                 // DEVICE_ORDINAL
		case 10: *(unsigned char *)data[i] = a && c.kind == K_MEM; break; // IS_LEGACY_CUDA_IPC_CAPABLE: a bool
		// RANGE_*: for VMM memory, the whole reservation, which may hold
		// more than the mapping (PyTorch's expandable segments map many
		// allocations into one); MAPPING_* say which mapping.
		case 11: *(void **)data[i] = (void *)(c.kind == K_VMM ? c.res_base : c.base); break; // RANGE_START_ADDR
		case 12: *(size_t *)data[i] = c.kind == K_VMM ? c.res_size : c.size; break;         // RANGE_SIZE
		case 14: *(unsigned *)data[i] = vmm_types(&c); break;                               // ALLOWED_HANDLE_TYPES: 32 bits
		case 17: *(void **)data[i] = NULL; break;                                           // MEMPOOL_HANDLE
		case 18: *(size_t *)data[i] = c.size; break;                                        // MAPPING_SIZE
		case 19: *(void **)data[i] = (void *)c.base; break;                                 // MAPPING_BASE_ADDR
		default: return INVALID_VALUE;
		}
	}
	return OK;
}

CUresult cuStreamCreate(CUstream *s, unsigned flags) {
	CUresult r = need(NULL);
	if (r != OK)
		return r;
	if (flags != 1) // CU_STREAM_NON_BLOCKING
		return INVALID_VALUE;
	CUstream st = calloc(1, sizeof *st);
	st->ctx = current;
	__atomic_add_fetch(&live_streams, 1, __ATOMIC_SEQ_CST);
	*s = st;
	return OK;
}

static CUresult enqueue(CUstream s, void *dst, const void *src, size_t n, uintptr_t dev) {
	if (s == NULL)
		return INVALID_HANDLE; // goxfer never uses the legacy default stream
	CUresult r = need(s->ctx);
	if (r != OK)
		return r;
	pthread_mutex_lock(&mu);
	struct alloc *a = find(dev, n);
	int ok = a != NULL && !a->host && (a->kind != K_VMM || a->access);
	pthread_mutex_unlock(&mu);
	if (!ok)
		return INVALID_VALUE;
	if (s->nops == s->cap) {
		s->cap = s->cap ? 2 * s->cap : 16;
		s->ops = realloc(s->ops, s->cap * sizeof *s->ops);
	}
	s->ops[s->nops++] = (struct op){dst, src, n};
	return OK;
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
	return enqueue(s, dst, (const void *)(uintptr_t)src, n, (uintptr_t)src);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
	return enqueue(s, (void *)(uintptr_t)dst, src, n, (uintptr_t)dst);
}

// cuMemcpyAsync copies between two device allocations (of any GPU, as
// unified addressing allows).
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
	pthread_mutex_lock(&mu);
	struct alloc *a = find((uintptr_t)src, n);
	int ok = a != NULL && !a->host && (a->kind != K_VMM || a->access);
	pthread_mutex_unlock(&mu);
	if (!ok)
		return INVALID_VALUE;
	return enqueue(s, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, (uintptr_t)dst);
}

CUresult cuStreamSynchronize(CUstream s) {
	if (s == NULL)
		return INVALID_HANDLE;
	CUresult r = need(s->ctx);
	if (r != OK)
		return r;
	for (size_t i = 0; i < s->nops; i++)
		memcpy(s->ops[i].dst, s->ops[i].src, s->ops[i].n);
	s->nops = 0;
	return OK;
}

CUresult cuStreamDestroy_v2(CUstream s) {
	CUresult r = cuStreamSynchronize(s);
	if (r != OK)
		return r;
	free(s->ops);
	free(s);
	__atomic_sub_fetch(&live_streams, 1, __ATOMIC_SEQ_CST);
	return OK;
}


// Sharing.

typedef struct {
	unsigned char bytes[16];
} CUuuid;

static CUresult get_uuid(CUuuid *u, CUdevice d) {
	if (!inited)
		return NOT_INITIALIZED;
	if (d < 0 || d >= NDEV)
		return INVALID_DEVICE;
	memcpy(u->bytes, "fakecuda-gpu-0", 14);
	u->bytes[14] = '0' + d;
	u->bytes[15] = '!';
	return OK;
}

CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) { return get_uuid(u, d); }
#ifndef OMIT_UUID_V2
CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { return get_uuid(u, d); }
#endif

typedef struct {
	unsigned char reserved[64];
} CUipcMemHandle;

static unsigned char last_handle[64];
static long live_ipc;

#ifndef OMIT_IPC
// A handle: "FAKEIPC", the allocation's address, size and ID, then bytes
// that depend on their offset and the address, so that a handle that
// arrives with any byte moved or lost is refused.
static void ipc_fill(CUipcMemHandle *h, const struct alloc *a) {
	memset(h, 0, sizeof *h);
	memcpy(h->reserved, "FAKEIPC", 7);
	memcpy(h->reserved + 8, &a->base, 8);
	memcpy(h->reserved + 16, &a->size, 8);
	memcpy(h->reserved + 24, &a->id, 8);
	for (int i = 32; i < 64; i++)
		h->reserved[i] = (unsigned char)(i * 37 + a->base);
}

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
	CUresult r = need(NULL);
	if (r != OK || (r = injected("cuIpcGetMemHandle")) != OK)
		return r;
	pthread_mutex_lock(&mu);
	struct alloc *a = find((uintptr_t)p, 1);
	struct alloc c = a ? *a : (struct alloc){0};
	pthread_mutex_unlock(&mu);
	if (a == NULL || c.base != (uintptr_t)p || c.kind != K_MEM)
		return INVALID_VALUE;
	ipc_fill(h, &c);
	return OK;
}

// The handle comes by value: the C compiler finds it where the ABI puts
// a 64-byte struct argument.
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
	pthread_mutex_lock(&mu);
	memcpy(last_handle, h.reserved, 64);
	pthread_mutex_unlock(&mu);
	CUresult r = need(NULL);
	if (r != OK || (r = injected("cuIpcOpenMemHandle_v2")) != OK)
		return r;
	if (flags != 1) // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
		return INVALID_VALUE;
	uintptr_t base;
	memcpy(&base, h.reserved + 8, 8);
	pthread_mutex_lock(&mu);
	struct alloc *a = find(base, 1);
	struct alloc c = a ? *a : (struct alloc){0};
	pthread_mutex_unlock(&mu);
	if (a == NULL || c.base != base || c.kind != K_MEM)
		return INVALID_HANDLE; // freed, or never an allocation
	CUipcMemHandle want;
	ipc_fill(&want, &c);
	if (memcmp(&want, &h, sizeof h) != 0)
		return INVALID_HANDLE;
	void *m = mremap((void *)c.base, 0, pages(c.size), MREMAP_MAYMOVE);
	if (m == MAP_FAILED)
		return 2;
	if (add((uintptr_t)m, c.size, current->dev, K_IPC) == NULL) {
		munmap(m, pages(c.size));
		return 2;
	}
	__atomic_add_fetch(&live_ipc, 1, __ATOMIC_SEQ_CST);
	*p = (CUdeviceptr)(uintptr_t)m;
	return OK;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
	CUresult r = need(NULL);
	if (r != OK || (r = injected("cuIpcCloseMemHandle")) != OK)
		return r;
	struct alloc *a = take((uintptr_t)p, K_IPC);
	if (a == NULL)
		return INVALID_VALUE;
	munmap((void *)a->base, pages(a->size));
	free(a);
	__atomic_sub_fetch(&live_ipc, 1, __ATOMIC_SEQ_CST);
	return OK;
}
#endif

// VMM.

typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct {
	int type; // CUmemLocationType
	int id;
} CUmemLocation;

typedef struct {
	int type;                 // CUmemAllocationType
	int requestedHandleTypes; // CUmemAllocationHandleType
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;

typedef struct {
	CUmemLocation location;
	int flags; // CUmemAccess_flags
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc");
_Static_assert(sizeof(CUipcMemHandle) == 64, "CUipcMemHandle");

#define GRANULARITY (64 << 10)

struct vmm {
	int fd; // a memfd holding the bytes
	size_t size;
	int dev, types;
	long refs; // the handle's own, and one per mapping
	struct vmm *next;
};
static struct vmm *vmms;

struct reservation {
	uintptr_t base;
	size_t size;
	struct reservation *next;
};
static struct reservation *reservations;

static unsigned vmm_types(const struct alloc *a) { return a->kind == K_VMM ? (unsigned)a->h->types : 0; }

__attribute__((unused)) static int valid_prop(const CUmemAllocationProp *p) {
	static const unsigned char zero[8];
	return p->type == 1 && (p->requestedHandleTypes == 0 || p->requestedHandleTypes == 1) && p->location.type == 1 &&
	       p->location.id >= 0 && p->location.id < NDEV && p->win32HandleMetaData == NULL &&
	       memcmp(&p->allocFlags, zero, 8) == 0;
}

__attribute__((unused)) static void vmm_unref(struct vmm *h) {
	pthread_mutex_lock(&mu);
	if (--h->refs > 0) {
		pthread_mutex_unlock(&mu);
		return;
	}
	for (struct vmm **ph = &vmms; *ph; ph = &(*ph)->next)
		if (*ph == h) {
			*ph = h->next;
			break;
		}
	pthread_mutex_unlock(&mu);
	close(h->fd);
	free(h);
}

__attribute__((unused)) static struct vmm *vmm_find(CUmemGenericAllocationHandle handle) {
	for (struct vmm *h = vmms; h; h = h->next)
		if ((CUmemGenericAllocationHandle)(uintptr_t)h == handle)
			return h;
	return NULL;
}

#ifndef OMIT_VMM
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) {
	if (!inited)
		return NOT_INITIALIZED;
	if (!valid_prop(prop) || (option != 0 && option != 1))
		return INVALID_VALUE;
	*g = GRANULARITY;
	return OK;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, unsigned long long flags) {
	CUresult r = injected("cuMemCreate");
	if (!inited || r != OK)
		return inited ? r : NOT_INITIALIZED;
	if (!valid_prop(prop) || flags != 0 || size == 0 || size % GRANULARITY != 0)
		return INVALID_VALUE;
	struct vmm *h = calloc(1, sizeof *h);
	int fd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
	if (h == NULL || fd < 0 || ftruncate(fd, (off_t)size) != 0) {
		free(h);
		if (fd >= 0)
			close(fd);
		return 2;
	}
	*h = (struct vmm){fd, size, prop->location.id, prop->requestedHandleTypes, 1, NULL};
	pthread_mutex_lock(&mu);
	h->next = vmms;
	vmms = h;
	pthread_mutex_unlock(&mu);
	*handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
	return OK;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
	CUresult r = injected("cuMemRelease");
	if (!inited || r != OK)
		return inited ? r : NOT_INITIALIZED;
	pthread_mutex_lock(&mu);
	struct vmm *h = vmm_find(handle);
	pthread_mutex_unlock(&mu);
	if (h == NULL)
		return INVALID_VALUE;
	vmm_unref(h);
	return OK;
}

CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
	CUresult r = injected("cuMemAddressReserve");
	if (!inited || r != OK)
		return inited ? r : NOT_INITIALIZED;
	if (size == 0 || size % GRANULARITY != 0 || alignment != 0 || addr != 0 || flags != 0)
		return INVALID_VALUE;
	void *m = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	struct reservation *res = malloc(sizeof *res);
	if (m == MAP_FAILED || res == NULL) {
		free(res);
		if (m != MAP_FAILED)
			munmap(m, size);
		return 2;
	}
	pthread_mutex_lock(&mu);
	*res = (struct reservation){(uintptr_t)m, size, reservations};
	reservations = res;
	pthread_mutex_unlock(&mu);
	*p = (CUdeviceptr)(uintptr_t)m;
	return OK;
}

static struct reservation *reservation_of(uintptr_t p, size_t n) {
	for (struct reservation *res = reservations; res; res = res->next)
		if (p >= res->base && p < res->base + res->size)
			return n <= res->size - (p - res->base) ? res : NULL;
	return NULL;
}

CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
	CUresult r = injected("cuMemAddressFree");
	if (!inited || r != OK)
		return inited ? r : NOT_INITIALIZED;
	pthread_mutex_lock(&mu);
	struct reservation **pr = &reservations;
	for (; *pr; pr = &(*pr)->next)
		if ((*pr)->base == (uintptr_t)p && (*pr)->size == size)
			break;
	int mapped = 0;
	for (struct alloc *a = allocs; a; a = a->next)
		mapped |= a->kind == K_VMM && a->res_base == (uintptr_t)p;
	if (*pr == NULL || mapped) {
		pthread_mutex_unlock(&mu);
		return INVALID_VALUE;
	}
	struct reservation *res = *pr;
	*pr = res->next;
	pthread_mutex_unlock(&mu);
	munmap((void *)res->base, res->size);
	free(res);
	return OK;
}

CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags) {
	CUresult r = injected("cuMemMap");
	if (!inited || r != OK)
		return inited ? r : NOT_INITIALIZED;
	pthread_mutex_lock(&mu);
	struct vmm *h = vmm_find(handle);
	struct reservation *res = reservation_of((uintptr_t)p, size);
	struct alloc *over = find((uintptr_t)p, 1);
	if (h == NULL || res == NULL || over != NULL || offset != 0 || flags != 0 || size != h->size) {
		pthread_mutex_unlock(&mu);
		return INVALID_VALUE;
	}
	h->refs++;
	struct reservation rc = *res;
	pthread_mutex_unlock(&mu);
	void *m = mmap((void *)(uintptr_t)p, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, h->fd, 0);
	struct alloc *a = m == MAP_FAILED ? NULL : add((uintptr_t)p, size, h->dev, K_VMM);
	if (a == NULL) {
		vmm_unref(h);
		return 2;
	}
	pthread_mutex_lock(&mu);
	a->h = h;
	a->res_base = rc.base;
	a->res_size = rc.size;
	pthread_mutex_unlock(&mu);
	return OK;
}

CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
	CUresult r = injected("cuMemUnmap");
	if (!inited || r != OK)
		return inited ? r : NOT_INITIALIZED;
	pthread_mutex_lock(&mu);
	struct alloc *a = find((uintptr_t)p, 1);
	int ok = a != NULL && a->kind == K_VMM && a->base == (uintptr_t)p && a->size == size;
	pthread_mutex_unlock(&mu);
	if (!ok)
		return INVALID_VALUE;
	a = take((uintptr_t)p, K_VMM);
	mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
	vmm_unref(a->h);
	free(a);
	return OK;
}

CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *desc, size_t count) {
	CUresult r = injected("cuMemSetAccess");
	if (!inited || r != OK)
		return inited ? r : NOT_INITIALIZED;
	if (count == 0)
		return INVALID_VALUE;
	for (size_t i = 0; i < count; i++)
		if (desc[i].location.type != 1 || desc[i].location.id < 0 || desc[i].location.id >= NDEV || desc[i].flags != 3)
			return INVALID_VALUE;
	pthread_mutex_lock(&mu);
	struct alloc *a = find((uintptr_t)p, size);
	int ok = a != NULL && a->kind == K_VMM && a->base == (uintptr_t)p;
	if (ok)
		a->access = 1;
	pthread_mutex_unlock(&mu);
	return ok ? OK : INVALID_VALUE;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
	CUresult r = injected("cuMemRetainAllocationHandle");
	if (!inited || r != OK)
		return inited ? r : NOT_INITIALIZED;
	pthread_mutex_lock(&mu);
	struct alloc *a = find((uintptr_t)addr, 1);
	int ok = a != NULL && a->kind == K_VMM;
	if (ok) {
		a->h->refs++;
		*handle = (CUmemGenericAllocationHandle)(uintptr_t)a->h;
	}
	pthread_mutex_unlock(&mu);
	return ok ? OK : INVALID_VALUE;
}

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle, int type, unsigned long long flags) {
	CUresult r = injected("cuMemExportToShareableHandle");
	if (!inited || r != OK)
		return inited ? r : NOT_INITIALIZED;
	pthread_mutex_lock(&mu);
	struct vmm *h = vmm_find(handle);
	int fd = h ? h->fd : -1, types = h ? h->types : 0;
	pthread_mutex_unlock(&mu);
	if (h == NULL || flags != 0)
		return INVALID_VALUE;
	if (type != 1 || !(types & 1))
		return NOT_SUPPORTED;
	int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (d < 0)
		return 2;
	*(int *)out = d;
	return OK;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os, int type) {
	CUresult r = injected("cuMemImportFromShareableHandle");
	if (!inited || r != OK)
		return inited ? r : NOT_INITIALIZED;
	int fd = (int)(intptr_t)os; // the descriptor itself, cast to a pointer
	struct stat st;
	if (type != 1 || fd < 0 || fstat(fd, &st) != 0)
		return INVALID_VALUE;
	// The descriptor must be of an allocation's memfd, whose GPU it is: the
	// fake is one process.
	int dev = -1;
	pthread_mutex_lock(&mu);
	for (struct vmm *o = vmms; o; o = o->next) {
		struct stat ost;
		if (fstat(o->fd, &ost) == 0 && ost.st_ino == st.st_ino && ost.st_dev == st.st_dev)
			dev = o->dev;
	}
	pthread_mutex_unlock(&mu);
	if (dev < 0)
		return INVALID_VALUE;
	struct vmm *h = calloc(1, sizeof *h);
	int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (h == NULL || d < 0) {
		free(h);
		return 2;
	}
	*h = (struct vmm){d, (size_t)st.st_size, dev, 1, 1, NULL};
	pthread_mutex_lock(&mu);
	h->next = vmms;
	vmms = h;
	pthread_mutex_unlock(&mu);
	*handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
	return OK;
}
#endif

// Hooks for the tests of sharing.

void fake_fail(const char *fn, int code) {
	pthread_mutex_lock(&mu);
	strncpy(fail_name, fn, sizeof fail_name - 1);
	fail_code = code;
	pthread_mutex_unlock(&mu);
}

void fake_last_handle(unsigned char *out) {
	pthread_mutex_lock(&mu);
	memcpy(out, last_handle, 64);
	pthread_mutex_unlock(&mu);
}

long fake_live_ipc(void) { return __atomic_load_n(&live_ipc, __ATOMIC_SEQ_CST); }

long fake_live_vmm(void) {
	long n = 0;
	pthread_mutex_lock(&mu);
	for (struct vmm *h = vmms; h; h = h->next)
		n++;
	pthread_mutex_unlock(&mu);
	return n;
}

long fake_live_reservations(void) {
	long n = 0;
	pthread_mutex_lock(&mu);
	for (struct reservation *r = reservations; r; r = r->next)
		n++;
	pthread_mutex_unlock(&mu);
	return n;
}

// Hooks for the tests.

long fake_wrong_context(void) { return __atomic_load_n(&wrong_context, __ATOMIC_SEQ_CST); }
long fake_retains(int dev) { return __atomic_load_n(&retains[dev], __ATOMIC_SEQ_CST); }
long fake_live_streams(void) { return __atomic_load_n(&live_streams, __ATOMIC_SEQ_CST); }
void *fake_foreign_context(void) { return &foreign; }

long fake_live_allocs(void) {
	long n = 0;
	pthread_mutex_lock(&mu);
	for (struct alloc *a = allocs; a; a = a->next)
		n++;
	pthread_mutex_unlock(&mu);
	return n;
}
