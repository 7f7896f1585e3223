//go:build linux

package cma

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"reflect"
	"slices"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/internal/oneline"
)

// The same-host device path (CUDA IPC). When both sides' agents have a
// device driver that shares memory (devmem.Sharer) of the same kind, the
// handshake agrees capDevice: the exposing side answers a lease request
// that covers its device memory, after the usual key, access and range
// checks, with the allocations those ranges lie in (tShare, once per
// allocation and connection; a VMM allocation's file descriptor rides on
// the frame as SCM_RIGHTS) and a grant naming, per range, the share and
// the address in it. The copying side maps each share once (a process-wide
// cache by exporting process and allocation, devmem.Sharer.Import), and
// copies on its own GPU streams: device to device when its memory is
// device memory, else one copy between the mapping and its host memory. A
// window's copies are synchronised before it ends, and the notification
// follows the last window: it never overtakes the data.
//
// The exposing side takes its shares back: once no exposure that a share
// served on a connection lives any more (revoked, or the agent closing),
// it sends tUnshare, and the copier drops its mapping when the copies in
// flight on it end. The copier also drops every mapping of a connection
// that ends. A mapping reaches the whole allocation: goxfer's checks keep
// well-behaved peers within the ranges leased; a peer process that maps
// an allocation could touch all of it (docs/gpu.md, the trust model).

// Windows over a peer's device memory mapped by IPC: copies run on the
// GPU, so a window is large (a lease round trip would cost more than the
// copy of a small one) and one task copies up to a window's worth.
const (
	ipcDepth = 4
	// bounceSize is a pinned buffer that carries host memory of the peer
	// (process_vm_readv/writev) to or from local device memory, for a
	// range the peer could not share and staged instead.
	bounceSize = 4 << 20
	// maxQueuedFDs bounds the descriptors received and not yet claimed by
	// a tShare: a peer that sends more is hostile.
	maxQueuedFDs = 16
	// maxShares bounds the allocations one connection's peer may have
	// this process map: each costs address space and a driver mapping.
	maxShares = 4096
)

// devState is what the backend knows of the agent's device driver, found
// at first need.
type devState struct {
	once   sync.Once
	drv    devmem.Driver
	sharer devmem.Sharer
	caps   uint16 // capDevice, with capSim for the simulator; 0: no sharing

	mu      sync.Mutex
	streams map[int][]devmem.Stream // idle streams by GPU
	bounce  [][]byte                // idle pinned buffers
}

// device returns the backend's device state, loading the driver once: an
// agent whose driver cannot share, or a backend made WithDeviceIPC(false),
// has caps 0.
func (b *Backend) device() *devState {
	d := &b.dev
	d.once.Do(func() {
		if !b.cfg.ipc || b.host == nil {
			return
		}
		drv, err := b.host.Device()
		if err != nil || drv == nil {
			return
		}
		sh, ok := drv.(devmem.Sharer)
		if !ok {
			return
		}
		if n, err := drv.Devices(); err != nil || n == 0 {
			return
		}
		d.drv, d.sharer, d.caps = drv, sh, capDevice
		if drv.Name() == "sim" {
			d.caps |= capSim
		}
	})
	return d
}

// agreeDevice returns the caps of a dialler's hello (in) that this side
// answers: capDevice, with capSim, when both sides share device memory of
// the same kind.
func (b *Backend) agreeDevice(in uint16) uint16 {
	if in&capDevice == 0 {
		return 0
	}
	d := b.device()
	if d.caps == 0 || in&(capDevice|capSim) != d.caps {
		return 0
	}
	return d.caps
}

// stream returns an idle stream of GPU gpu, making one if none is idle.
func (d *devState) stream(gpu int) (devmem.Stream, error) {
	d.mu.Lock()
	if ss := d.streams[gpu]; len(ss) > 0 {
		s := ss[len(ss)-1]
		d.streams[gpu] = ss[:len(ss)-1]
		d.mu.Unlock()
		return s, nil
	}
	d.mu.Unlock()
	return d.drv.NewStream(gpu)
}

// idle gives back a stream whose copies were synchronised.
func (d *devState) idle(gpu int, s devmem.Stream) {
	d.mu.Lock()
	if d.streams == nil {
		d.streams = map[int][]devmem.Stream{}
	}
	d.streams[gpu] = append(d.streams[gpu], s)
	d.mu.Unlock()
}

// buffer returns an idle pinned bounce buffer, allocating one if none is.
func (d *devState) buffer() ([]byte, error) {
	d.mu.Lock()
	if n := len(d.bounce); n > 0 {
		b := d.bounce[n-1]
		d.bounce = d.bounce[:n-1]
		d.mu.Unlock()
		return b, nil
	}
	d.mu.Unlock()
	return d.drv.HostAlloc(bounceSize)
}

func (d *devState) putBuffer(b []byte) {
	d.mu.Lock()
	d.bounce = append(d.bounce, b)
	d.mu.Unlock()
}

// close frees the idle streams and buffers: at Close, when no copy runs.
func (d *devState) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, ss := range d.streams {
		for _, s := range ss {
			_ = s.Close()
		}
	}
	for _, b := range d.bounce {
		_ = d.drv.HostFree(b)
	}
	d.streams, d.bounce = nil, nil
}

// DirectDevice implements [agent.DeviceDirect]: cma moves a transfer with
// device memory itself ("ipc") when the connection to peer agreed
// capDevice and no local device memory faces the peer's host memory (that
// pairing is staged by the agent, the peer's side copied with
// process_vm_readv/writev).
func (b *Backend) DirectDevice(peer agent.Info, segs []agent.Segment) (string, bool) {
	p, err := b.usable(peer)
	if err != nil {
		return "", false
	}
	b.xwg.Done()
	if !p.device {
		return "", false
	}
	for i := range segs {
		if segs[i].Local.Kind == agent.KindVRAM && segs[i].Remote.Kind == agent.KindDRAM {
			return "", false
		}
	}
	return "ipc", true
}

// imported is a peer's device allocation mapped into this process, shared
// by every connection and window that uses it.
type imported struct {
	key  importKey
	base uint64
	size uint64
	m    devmem.Mapping
	refs int // under importsMu
}

// importKey names an allocation: the driver that mapped it, the exporting
// process and the allocation's ID there.
type importKey struct {
	drv any // the driver, or its devState if the driver is no map key
	pid int
	id  uint64
}

var (
	importsMu sync.Mutex
	imports   = map[importKey]*imported{}
)

// acquireImport maps sh of process pid, or takes another reference on its
// mapping. A share whose ID names a mapping of another span is refused:
// the exporting process reuses no ID.
func acquireImport(d *devState, pid int, sh share, fd int) (*imported, error) {
	var drv any = d
	if reflect.ValueOf(d.drv).Comparable() {
		drv = d.drv // process-wide: the CUDA driver maps a handle once
	}
	k := importKey{drv: drv, pid: pid, id: sh.id}
	importsMu.Lock()
	defer importsMu.Unlock()
	if im := imports[k]; im != nil {
		if im.base != sh.base || im.size != sh.size {
			return nil, fmt.Errorf("%w: device share %d of process %d spans [0x%x, +%d), mapped before as [0x%x, +%d)", errProtocol, sh.id, pid, sh.base, sh.size, im.base, im.size)
		}
		im.refs++
		return im, nil
	}
	// On the exporting GPU where this process sees it (matched by UUID),
	// else on its first GPU, reaching the memory peer to peer: one GPU per
	// process (CUDA_VISIBLE_DEVICES) is the usual deployment.
	m, err := d.sharer.Import(devmem.Share{Kind: sh.kind, GPU: sh.gpu, ID: sh.id, Base: uintptr(sh.base), Size: sh.size, Handle: sh.hdl, FD: fd}, 0)
	if err != nil {
		return nil, err
	}
	im := &imported{key: k, base: sh.base, size: sh.size, m: m, refs: 1}
	imports[k] = im
	return im, nil
}

// release drops one reference; the last unmaps.
func (im *imported) release() {
	importsMu.Lock()
	im.refs--
	last := im.refs == 0
	if last {
		delete(imports, im.key)
	}
	importsMu.Unlock()
	if last {
		_ = im.m.Close()
	}
}

// shareRef is a share as a connection knows it: mapped, or why not.
type shareRef struct {
	im  *imported
	err error
}

// rightsReader reads a connection whose peer may attach file descriptors
// (SCM_RIGHTS) to tShare frames: it queues them, in order, for the frames
// that claim them.
type rightsReader struct {
	c   *net.UnixConn
	oob []byte
	fds []int
	err error
}

func (r *rightsReader) Read(b []byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	if r.oob == nil {
		r.oob = make([]byte, unix.CmsgSpace(4*maxQueuedFDs))
	}
	n, oobn, flags, _, err := r.c.ReadMsgUnix(b, r.oob)
	if n < 0 {
		n = 0 // an error may come with -1
	}
	if oobn < 0 {
		oobn = 0
	}
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(r.oob[:oobn])
		for i := range msgs {
			fds, ferr := unix.ParseUnixRights(&msgs[i])
			if ferr == nil {
				r.fds = append(r.fds, fds...)
			}
		}
		if perr != nil && r.err == nil {
			r.err = fmt.Errorf("%w: unreadable ancillary data: %w", errProtocol, perr)
		}
	}
	if flags&unix.MSG_CTRUNC != 0 && r.err == nil {
		r.err = fmt.Errorf("%w: more file descriptors attached than a share carries", errProtocol)
	}
	if len(r.fds) > maxQueuedFDs && r.err == nil {
		r.err = fmt.Errorf("%w: %d file descriptors received and unclaimed, at most %d", errProtocol, len(r.fds), maxQueuedFDs)
	}
	if r.err != nil {
		// The bytes that came with the descriptors too many are the
		// hostile peer's: no frame among them is acted on.
		return 0, r.err
	}
	return n, err
}

// take returns the oldest unclaimed descriptor, or -1.
func (r *rightsReader) take() int {
	if len(r.fds) == 0 {
		return -1
	}
	fd := r.fds[0]
	r.fds = r.fds[1:]
	return fd
}

// close closes the unclaimed descriptors.
func (r *rightsReader) close() {
	for _, fd := range r.fds {
		_ = unix.Close(fd)
	}
	r.fds = nil
}

// share handles a tShare (f): it maps the allocation, or records why it
// could not, for the grants that name it. A share by file descriptor
// claims the descriptor that came with it.
func (p *peer) share(f *frame, rr *rightsReader) error {
	sh, err := getShare(f)
	fd := -1
	if sh.kind == devmem.ShareFD {
		if fd = rr.take(); fd < 0 {
			return fmt.Errorf("%w: device share %d by file descriptor came with none", errProtocol, f.id)
		}
		defer unix.Close(fd)
	}
	if err != nil {
		return err
	}
	p.mu.Lock()
	if p.waiting == nil {
		p.mu.Unlock()
		return nil // failed: maps nothing more
	}
	if len(p.shares) >= maxShares {
		p.mu.Unlock()
		return fmt.Errorf("%w: more than %d device allocations shared on one connection", errLimit, maxShares)
	}
	if _, dup := p.shares[sh.id]; dup {
		p.mu.Unlock()
		return fmt.Errorf("%w: device share %d shared twice", errProtocol, sh.id)
	}
	p.mu.Unlock()
	im, err := acquireImport(p.b.device(), int(p.ci.pid), sh, fd)
	if errors.Is(err, errProtocol) {
		return err
	}
	ref := &shareRef{im: im}
	if err != nil {
		if exited(int(p.ci.pid)) {
			// Its memory went with it: the peer is lost, not its memory
			// unshareable.
			err = fmt.Errorf("%w: the process exited: %w", agent.ErrRemoteLost, err)
		}
		ref = &shareRef{err: fmt.Errorf("cma: mapping GPU memory of peer %s (pid %d): %w", p.id, p.ci.pid, err)}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if ref.err != nil && !p.mapWarned { // once a connection: a hostile peer could send thousands
		p.mapWarned = true
		p.b.log.Warn("cma: could not map a peer's GPU memory; transfers of it fail", "peer", p.id, "err", ref.err)
	}
	if p.waiting == nil { // failed meanwhile: its shares were dropped
		if im != nil {
			im.release()
		}
		return nil
	}
	if p.shares == nil {
		p.shares = map[uint64]*shareRef{}
	}
	p.shares[sh.id] = ref
	return nil
}

// exited reports whether process pid has exited (it is gone, or a zombie
// not yet reaped).
func exited(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH)
	}
	// pid (comm) state ...: comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return false
	}
	return b[i+2] == 'Z' || b[i+2] == 'X'
}

// unshare handles a tUnshare: the connection's reference on the mapping
// goes; windows copying on it keep theirs.
func (p *peer) unshare(id uint64) error {
	p.mu.Lock()
	ref, ok := p.shares[id]
	delete(p.shares, id)
	failed := p.waiting == nil
	p.mu.Unlock()
	if !ok {
		if failed {
			return nil
		}
		return fmt.Errorf("%w: unshare of device share %d, which was not shared", errProtocol, id)
	}
	if ref.im != nil {
		ref.im.release()
	}
	return nil
}

// dropShares releases the connection's mappings: it failed.
func (p *peer) dropShares() {
	p.mu.Lock()
	shares := p.shares
	p.shares = nil
	p.mu.Unlock()
	for _, ref := range shares {
		if ref.im != nil {
			ref.im.release()
		}
	}
}

// devAt is where a window's range lies in a mapped share.
type devAt struct {
	ptr uintptr // in this process; 0: the range is host memory of the peer
	gpu int
	im  *imported // the mapping ptr lies in
}

// place records where the peer's grant (f) tells w to copy, on a
// connection that agreed capDevice: host addresses in w.addrs (staged if
// any differs from the range's own), mapped device addresses in w.devs,
// each share referenced until w ends. The caller holds p.mu. A grant that
// names a share never shared, or a range outside its share, breaks the
// protocol; a share that could not be mapped fails w only (failed).
func (p *peer) place(w *window, f *frame) (failed error, err error) {
	es, err := grantEntries(f, w.pieces, w.lens())
	if err != nil || es == nil {
		return nil, err
	}
	w.addrs = make([]uint64, len(es))
	i := 0
	for pc := range w.st.x.Pieces(w.start, w.n) {
		e := es[i]
		if e.share == 0 {
			w.addrs[i] = e.addr
			w.staged = w.staged || e.addr != pc.RemoteAddr()
			i++
			continue
		}
		ref := p.shares[e.share]
		if ref == nil {
			return nil, fmt.Errorf("%w: grant of lease %d names device share %d, which was not shared", errProtocol, f.id, e.share)
		}
		if ref.err != nil {
			failed = ref.err
			i++
			continue
		}
		im := ref.im
		if e.addr < im.base || e.addr+pc.Len > im.base+im.size {
			return nil, fmt.Errorf("%w: grant of lease %d places range %d (%d bytes) at 0x%x, outside device share %d [0x%x, +%d)", errProtocol, f.id, i, pc.Len, e.addr, e.share, im.base, im.size)
		}
		if w.devs == nil {
			w.devs = make([]devAt, len(es))
		}
		w.devs[i] = devAt{ptr: im.m.Ptr() + uintptr(e.addr-im.base), gpu: im.m.Dev(), im: im}
		importsMu.Lock()
		im.refs++
		importsMu.Unlock()
		w.ims = append(w.ims, im)
		i++
	}
	return failed, nil
}

// devAddr returns where piece pc, of segment seg, of w lies in a mapped
// share, if it does.
func (w *window) devAddr(seg int, pc agent.Piece) (devAt, bool) {
	if w.devs == nil {
		return devAt{}, false
	}
	i, off := seg-w.start.Seg, pc.Off
	if i == 0 {
		off -= w.start.Off
	}
	d := w.devs[i]
	if d.ptr == 0 {
		return devAt{}, false
	}
	d.ptr += uintptr(off)
	return d, true
}

// devCopy is one copy on a GPU stream; contiguous neighbours merge.
type devCopy struct {
	gpu      int
	dst, src uintptr // device to device
	host     []byte  // or between host and device: dev is dst (READ into host: src)
	dev      uintptr
	toHost   bool
	n        uint64
	// The mapping the peer's side lies in: a copy never runs from one
	// mapping into another, however neighbouring they are.
	im *imported
	// Device to device, the local side: where it begins, and the local
	// segment the copy's last piece lies in. The agent checked that each
	// segment lies in one allocation; a copy that merged pieces of
	// several has the lengths of its runs per segment in parts, and is
	// split into them unless the driver finds local in one allocation.
	local uintptr
	seg   int
	parts []uint64
}

// copyDevice copies task t of a window that involves device memory: on
// GPU streams for ranges of mapped shares (merging neighbours that are
// contiguous on both sides), with process_vm_readv/writev for the peer's
// host memory, through a pinned bounce buffer where local device memory
// faces it. Every stream is synchronised before it returns.
func (st *xstate) copyDevice(t task) error {
	p := st.p
	d := st.b.device()
	if d.drv == nil {
		return fmt.Errorf("cma: %w: this agent has no device driver", agent.ErrStaging)
	}
	var copies []devCopy
	seg := t.start.Seg
	var hostErr error
	for pc := range st.x.Pieces(t.start, t.n) {
		local := pc.Seg.Local
		at, onDev := t.w.devAddr(seg, pc)
		remote := t.w.remoteAddr(seg, pc)
		pseg := seg
		if pc.Off+pc.Len == pc.Seg.Local.Len {
			seg++
		}
		switch {
		case onDev && local.Kind == agent.KindVRAM:
			c := devCopy{gpu: int(local.Device), n: pc.Len, im: at.im, local: uintptr(pc.LocalAddr()), seg: pseg}
			if st.write {
				c.dst, c.src = at.ptr, c.local
			} else {
				c.dst, c.src = c.local, at.ptr
			}
			copies = mergeCopy(copies, c)
		case onDev:
			copies = mergeCopy(copies, devCopy{gpu: at.gpu, host: pc.Local(), dev: at.ptr, toHost: !st.write, n: pc.Len, im: at.im})
		case local.Kind == agent.KindVRAM:
			if hostErr == nil {
				hostErr = st.bounce(d, pc, remote)
			}
		default:
			if hostErr == nil {
				hostErr = st.vmPiece(pc.Local(), remote)
			}
		}
	}
	err := runCopies(d, copies)
	if err != nil {
		err = fmt.Errorf("cma: %v of peer %s's GPU memory (mapped): %w", st.x.Op, p.id, err)
	}
	return oneline.Join(hostErr, err)
}

// mergeCopy appends c to cs, or extends the last copy if c continues it on
// both sides, within one mapping of the peer's.
func mergeCopy(cs []devCopy, c devCopy) []devCopy {
	if n := len(cs); n > 0 {
		l := &cs[n-1]
		if l.gpu == c.gpu && l.im == c.im && l.host == nil && c.host == nil && l.dst+uintptr(l.n) == c.dst && l.src+uintptr(l.n) == c.src {
			switch {
			case l.seg != c.seg: // maybe another local allocation
				if l.parts == nil {
					l.parts = []uint64{l.n}
				}
				l.parts = append(l.parts, c.n)
			case l.parts != nil:
				l.parts[len(l.parts)-1] += c.n
			}
			l.n, l.seg = l.n+c.n, c.seg
			return cs
		}
		if l.gpu == c.gpu && l.im == c.im && l.host != nil && c.host != nil && l.toHost == c.toHost && l.dev+uintptr(l.n) == c.dev && sameNext(l.host, c.host) {
			l.host = l.host[:len(l.host)+len(c.host)]
			l.n += c.n
			return cs
		}
	}
	return append(cs, c)
}

// sameNext reports whether b starts right after a, within a's capacity.
func sameNext(a, b []byte) bool {
	if len(b) == 0 || cap(a)-len(a) < len(b) {
		return false
	}
	return &a[:len(a)+1][len(a)] == &b[0]
}

// runCopies enqueues cs on one stream per GPU and waits for all of them.
func runCopies(d *devState, cs []devCopy) error {
	if len(cs) == 0 {
		return nil
	}
	type used struct {
		gpu int
		s   devmem.Stream
	}
	var ss []used
	var errs []error
	get := func(gpu int) devmem.Stream {
		for _, u := range ss {
			if u.gpu == gpu {
				return u.s
			}
		}
		s, err := d.stream(gpu)
		if err != nil {
			errs = append(errs, err)
			return nil
		}
		ss = append(ss, used{gpu, s})
		return s
	}
	for _, c := range cs {
		s := get(c.gpu)
		if s == nil {
			break
		}
		var err error
		switch {
		case c.host == nil && c.parts != nil && d.drv.Check(c.local, c.n, c.gpu) != nil:
			// Neighbouring segments of different allocations: a copy
			// may not run from one into the other.
			var off uintptr
			for _, n := range c.parts {
				if err = s.Copy(c.dst+off, c.src+off, int(n)); err != nil {
					break
				}
				off += uintptr(n)
			}
		case c.host == nil:
			err = s.Copy(c.dst, c.src, int(c.n))
		case c.toHost:
			err = s.ToHost(c.host, c.dev)
		default:
			err = s.ToDevice(c.dev, c.host)
		}
		if err != nil {
			errs = append(errs, err)
			break
		}
	}
	for _, u := range ss {
		if err := u.s.Sync(); err != nil {
			errs = append(errs, err)
			_ = u.s.Close() // its state is unknown: not reused
			continue
		}
		d.idle(u.gpu, u.s)
	}
	return oneline.Join(errs...)
}

// vmPiece copies one piece between local host memory and the peer's, at
// remote.
func (st *xstate) vmPiece(local []byte, remote uintptr) error {
	l := []unix.Iovec{{Base: &local[0]}}
	l[0].SetLen(len(local))
	r := []unix.RemoteIovec{{Base: remote, Len: len(local)}}
	if err := vmCopy(int(st.p.ci.pid), st.write, l, r, uint64(len(local))); err != nil {
		return st.copyError(err)
	}
	return nil
}

// bounce copies one piece of local device memory to or from the peer's
// host memory at remote, through a pinned buffer, a buffer's worth at a
// time.
func (st *xstate) bounce(d *devState, pc agent.Piece, remote uintptr) error {
	buf, err := d.buffer()
	if err != nil {
		return fmt.Errorf("cma: %w: pinned bounce buffer: %w", agent.ErrStaging, err)
	}
	defer d.putBuffer(buf)
	gpu := int(pc.Seg.Local.Device)
	s, err := d.stream(gpu)
	if err != nil {
		return fmt.Errorf("cma: %w: %w", agent.ErrStaging, err)
	}
	dev := uintptr(pc.LocalAddr())
	for off := uint64(0); off < pc.Len; {
		n := min(pc.Len-off, uint64(len(buf)))
		b := buf[:n]
		if st.write {
			err = s.ToHost(b, dev+uintptr(off))
			if err == nil {
				err = s.Sync()
			}
			if err == nil {
				err = st.vmPiece(b, remote+uintptr(off))
			}
		} else {
			err = st.vmPiece(b, remote+uintptr(off))
			if err == nil {
				err = s.ToDevice(dev+uintptr(off), b)
			}
			if err == nil {
				err = s.Sync()
			}
		}
		if err != nil {
			_ = s.Close()
			return err
		}
		off += n
	}
	d.idle(gpu, s)
	return nil
}

// exported is a device allocation shared on a connection, with the keys
// of the exposures it served there.
type exported struct {
	id   uint64
	base uint64
	size uint64
	dev  int
	keys map[agent.Key]struct{}
	// sh is what Export said, for the tShare; a descriptor it holds is
	// closed once the grant is answered.
	sh devmem.Share
}

// grantDevice answers a lease request (f, lease opened) that covers device
// memory on a connection that agreed capDevice: every device range is
// shared (tShare for allocations new to the connection) and the grant
// names its share. Every range is checked, and every allocation exported,
// before anything is sent: a request refused for one range, or staged
// because one allocation cannot be shared, hands out no share. It reports
// false, having answered nothing, when some device range cannot be
// shared: the caller stages the request instead.
func (s *server) grantDevice(f *frame, lease agent.Lease, acc agent.Access) (bool, error) {
	count := int(f.count)
	regions := make([]agent.Region, count)
	for i := range count {
		addr, n := f.rangeAt(i)
		r, ok := lease.Region(addr, n)
		if !ok {
			_, err := lease.Slice(addr, n) // says why, and counts it
			lease.Release()
			s.b.stats.Deny()
			return true, s.answer(tGrant, f.id, stDenied, fmt.Errorf("range %d: %w", i, err), nil)
		}
		regions[i] = r
	}
	d := s.b.device()
	s.shareMu.Lock()
	defer s.shareMu.Unlock()
	es := make([]grantEntry, count)
	var used, fresh []*exported // the grant's allocations; those new to the connection
	defer func() {
		for _, ex := range fresh { // sent or not, the descriptor is done with
			if ex.sh.Kind == devmem.ShareFD {
				_ = unix.Close(ex.sh.FD)
				ex.sh.FD = -1
			}
		}
	}()
	for i := range count {
		addr, n := f.rangeAt(i)
		es[i].addr = addr
		if regions[i].Kind != agent.KindVRAM {
			continue
		}
		ex, isNew, err := s.shareFor(d, f.key, addr, n, int(regions[i].Device), used)
		if err != nil {
			// Not shareable (ErrNotShareable: managed memory, a pool, a
			// mapping of another process's), or the driver failed to
			// export it: staged instead, as without the device path.
			s.b.log.Debug("cma: device memory not shared; staging it", "peer", s.peer, "err", err)
			return false, nil
		}
		if isNew {
			fresh = append(fresh, ex)
		}
		if !slices.Contains(used, ex) {
			used = append(used, ex)
		}
		es[i].share = ex.id
	}
	// The request is granted: the shares new to the connection go out
	// before the grant that names them.
	for _, ex := range fresh {
		if err := s.sendShare(ex); err != nil {
			lease.Release()
			return true, err
		}
		if s.exports == nil {
			s.exports, s.byKey = map[uint64]*exported{}, map[agent.Key][]*exported{}
		}
		s.exports[ex.id] = ex
	}
	for _, ex := range used {
		s.serves(ex, f.key, &lease)
	}
	s.mu.Lock()
	s.hold(f.id, held{lease: lease, key: f.key, acc: acc, since: time.Now()})
	s.mu.Unlock()
	return true, s.answerEntries(f.id, es)
}

// shareFor returns the allocation holding [addr, addr+n) of GPU dev for
// the exposure key: one the connection shared for it already, one of
// used (the grant's so far), or one exported now: shared on the
// connection for another exposure, or new to it (isNew; a file
// descriptor it holds is the caller's to close). The caller holds
// s.shareMu.
func (s *server) shareFor(d *devState, key agent.Key, addr, n uint64, dev int, used []*exported) (ex *exported, isNew bool, err error) {
	for _, ex := range s.byKey[key] {
		if ex.covers(dev, addr, n) {
			return ex, false, nil
		}
	}
	for _, ex := range used {
		if ex.covers(dev, addr, n) {
			return ex, false, nil
		}
	}
	sh, err := d.sharer.Export(uintptr(addr), dev)
	if err != nil {
		return nil, false, err
	}
	base, size := uint64(sh.Base), sh.Size
	if sh.ID == 0 || addr < base || addr+n > base+size || base+size < base {
		if sh.Kind == devmem.ShareFD {
			_ = unix.Close(sh.FD)
		}
		return nil, false, fmt.Errorf("%w: allocation %d [0x%x, +%d) does not hold [0x%x, +%d)", devmem.ErrNotShareable, sh.ID, base, size, addr, n)
	}
	if ex := s.exports[sh.ID]; ex != nil { // shared for another exposure
		if sh.Kind == devmem.ShareFD {
			_ = unix.Close(sh.FD)
		}
		return ex, false, nil
	}
	return &exported{id: sh.ID, base: base, size: size, dev: dev, keys: map[agent.Key]struct{}{}, sh: sh}, true, nil
}

// covers reports whether ex is the allocation of GPU dev that holds
// [addr, addr+n).
func (ex *exported) covers(dev int, addr, n uint64) bool {
	return ex.dev == dev && addr >= ex.base && addr+n <= ex.base+ex.size
}

// serves records that ex serves the exposure key, whose lease is lease,
// and watches the exposure: once it is gone, the shares that served only
// it are taken back. The caller holds s.shareMu.
func (s *server) serves(ex *exported, key agent.Key, lease *agent.Lease) {
	if _, ok := ex.keys[key]; !ok {
		ex.keys[key] = struct{}{}
		s.byKey[key] = append(s.byKey[key], ex)
	}
	if s.watched == nil {
		s.watched = map[agent.Key]bool{}
	}
	if s.watched[key] {
		return
	}
	s.watched[key] = true
	gone := lease.Gone()
	s.watchWG.Add(1)
	go func() {
		defer s.watchWG.Done()
		select {
		case <-gone:
			s.unshareKey(key)
		case <-s.done:
		}
	}()
}

// unshareKey takes back the shares that served only the exposure key,
// which is gone: the copier unmaps them (tUnshare).
func (s *server) unshareKey(key agent.Key) {
	s.shareMu.Lock()
	defer s.shareMu.Unlock()
	for _, ex := range s.byKey[key] {
		delete(ex.keys, key)
		if len(ex.keys) > 0 || s.exports[ex.id] != ex {
			continue
		}
		delete(s.exports, ex.id)
		var b [hdrSize]byte
		(&header{typ: tUnshare, id: ex.id}).put(b[:])
		if err := s.write(b[:], nil); err != nil {
			s.abort(err)
			return
		}
	}
	delete(s.byKey, key)
	delete(s.watched, key)
}

// sendShare writes a tShare for ex, with its file descriptor attached if
// it has one.
func (s *server) sendShare(ex *exported) error {
	sh := ex.sh
	b := make([]byte, hdrSize, hdrSize+shareSize)
	(&header{typ: tShare, status: uint8(sh.Kind), id: sh.ID, length: shareSize}).put(b)
	b = putShare(b, sh)
	var oob []byte
	if sh.Kind == devmem.ShareFD {
		oob = unix.UnixRights(sh.FD)
	}
	return s.write(b, oob)
}

// answerEntries writes the grant of lease id on a connection that agreed
// capDevice: (address, share) per range.
func (s *server) answerEntries(id uint64, es []grantEntry) error {
	b := make([]byte, hdrSize, hdrSize+len(es)*devEntrySize)
	(&header{typ: tGrant, status: stOK, count: uint32(len(es)), id: id}).put(b)
	for _, e := range es {
		b = binary.LittleEndian.AppendUint64(b, e.addr)
		b = binary.LittleEndian.AppendUint64(b, e.share)
	}
	return s.write(b, nil)
}
