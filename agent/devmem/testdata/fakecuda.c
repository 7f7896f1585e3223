// A fake libcuda.so.1 for the tests of the purego binding on machines without
// a GPU. It implements the driver calls goxfer binds, with the C prototypes
// of cuda.h, over host memory, and is stricter than the real driver where
// that catches binding mistakes: every call that needs a context fails with
// CUDA_ERROR_INVALID_CONTEXT unless the right one is current on the calling
// thread (and counts it), pinned memory must be asked for as portable,
// streams as non-blocking, and copies run only at cuStreamSynchronize, so a
// caller that reads a copy's result before Sync sees stale bytes.
//
// Build knobs: -DINIT_RESULT=n makes cuInit fail with n; -DVERSION=n sets
// the driver version; -DOMIT_MEMALLOC leaves cuMemAlloc_v2 out.

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
};

#define NDEV 2

static struct fake_ctx primaries[NDEV] = {{0}, {1}};
static struct fake_ctx foreign = {-1}; // no GPU's primary: another library's context
static int inited;
static long wrong_context, retains[NDEV];
static __thread CUcontext current;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

struct alloc {
	uintptr_t base;
	size_t size;
	int dev, host;
	struct alloc *next;
};
static struct alloc *allocs;
static long live_streams;

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

CUresult cuGetErrorName(CUresult r, const char **s) {
	switch (r) {
	case OK: *s = "CUDA_SUCCESS"; break;
	case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
	case NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
	case NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; break;
	case INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
	case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
	case INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
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

static CUresult track(void *p, size_t n, int dev, int host) {
	struct alloc *a = malloc(sizeof *a);
	if (p == NULL || a == NULL) {
		free(p);
		free(a);
		return 2; // CUDA_ERROR_OUT_OF_MEMORY
	}
	*a = (struct alloc){(uintptr_t)p, n, dev, host, NULL};
	pthread_mutex_lock(&mu);
	a->next = allocs;
	allocs = a;
	pthread_mutex_unlock(&mu);
	return OK;
}

static CUresult untrack(uintptr_t p, int host) {
	pthread_mutex_lock(&mu);
	for (struct alloc **pa = &allocs; *pa; pa = &(*pa)->next) {
		struct alloc *a = *pa;
		if (a->base == p && a->host == host) {
			*pa = a->next;
			pthread_mutex_unlock(&mu);
			free((void *)a->base);
			free(a);
			return OK;
		}
	}
	pthread_mutex_unlock(&mu);
	return INVALID_VALUE;
}

#ifndef OMIT_MEMALLOC
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
	CUresult r = need(NULL);
	if (r != OK)
		return r;
	if (n == 0)
		return INVALID_VALUE;
	void *m = malloc(n);
	if ((r = track(m, n, current->dev, 0)) != OK)
		return r;
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
		case 2: *(unsigned *)data[i] = a ? (c.host ? 1 : 2) : 0; break; // MEMORY_TYPE
		case 8: *(unsigned char *)data[i] = 0; break;                    // IS_MANAGED: a bool
		case 9: *(int *)data[i] = a ? c.dev : -2; break;                 // DEVICE_ORDINAL
		case 11: *(void **)data[i] = (void *)c.base; break;               // RANGE_START_ADDR
		case 12: *(size_t *)data[i] = c.size; break;                      // RANGE_SIZE
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
	int ok = a != NULL && !a->host;
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
	int ok = a != NULL && !a->host;
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
