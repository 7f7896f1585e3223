//go:build ucx

package ucx

/*
// The native side of the backend is in ucx_native.h and ucx_native.c.
#cgo LDFLAGS: -lucp -luct -lucs
#include <stdlib.h> // C.malloc, C.free
#include "ucx_native.h"
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
