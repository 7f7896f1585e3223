//go:build linux

package cma

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// newAgent starts an agent on a cma backend with opts.
func newAgent(t testing.TB, opts ...Option) (*agent.Agent, *Backend) {
	t.Helper()
	b := New(opts...)
	return backendtest.NewAgent(t, b), b
}

// rawPeer is a hand-driven client speaking the control protocol.
type rawPeer struct {
	t  testing.TB
	c  *net.UnixConn
	br *bufio.Reader
	id uuid.UUID
}

func dialRaw(t testing.TB, b *Backend) *rawPeer {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: "@" + b.self.sock, Net: "unix"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return &rawPeer{t: t, c: c, br: bufio.NewReader(c), id: uuid.New()}
}

// hello handshakes as process pid, expecting agent expect, presenting no
// key.
func (p *rawPeer) hello(expect uuid.UUID, pid int) (handshake, error) {
	return p.shake(handshake{self: p.id, expect: expect, pid: uint32(pid)})
}

// helloWithKey handshakes as this process, expecting agent to, presenting
// key for access acc.
func (p *rawPeer) helloWithKey(key agent.Key, acc agent.Access, to *agent.Agent) (handshake, error) {
	return p.shake(handshake{self: p.id, expect: to.ID(), pid: uint32(os.Getpid()), status: uint8(acc), nonce: key})
}

// shake sends the handshake out and reads the answer.
func (p *rawPeer) shake(out handshake) (handshake, error) {
	var hs [hsSize]byte
	out.put(hs[:])
	_, err := p.c.Write(hs[:])
	require.NoError(p.t, err)
	_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(p.br, hs[:]); err != nil {
		return handshake{}, err
	}
	return getHandshake(hs[:])
}

// joinRaw dials b, agent a's backend, and completes an honest handshake.
func joinRaw(t testing.TB, a *agent.Agent, b *Backend) *rawPeer {
	t.Helper()
	p := dialRaw(t, b)
	in, err := p.hello(a.ID(), os.Getpid())
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), in.status)
	return p
}

// holdLease starts an agent, with opts, that exposes 4096 bytes at addr
// for WRITE, and a raw peer that holds a granted lease (id 1) on all of
// them.
func holdLease(t *testing.T, opts ...Option) (a *agent.Agent, exp *agent.Exposure, p *rawPeer, addr uint64) {
	t.Helper()
	a, b := newAgent(t, opts...)
	buf := make([]byte, 4096)
	exp, err := a.Expose(agent.AccessWrite, []agent.Local{agent.DRAM(buf)})
	require.NoError(t, err)
	addr = agent.DRAM(buf).Addr
	p = joinRaw(t, a, b)
	p.send(header{typ: tBegin, status: uint8(agent.AccessWrite), count: 1, id: 1, key: exp.Key()}, [][2]uint64{{addr, 4096}}, nil)
	h, _, err := p.grant()
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), h.status)
	return a, exp, p, addr
}

func (p *rawPeer) send(h header, table [][2]uint64, payload []byte) {
	b := make([]byte, hdrSize)
	h.put(b)
	for _, r := range table {
		b = binary.LittleEndian.AppendUint64(b, r[0])
		b = binary.LittleEndian.AppendUint64(b, r[1])
	}
	_, err := p.c.Write(append(b, payload...))
	require.NoError(p.t, err)
}

// grant reads the answer to a lease request.
func (p *rawPeer) grant() (header, string, error) {
	var hb [hdrSize]byte
	var h header
	_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(p.br, hb[:]); err != nil {
		return h, "", err
	}
	h.get(hb[:])
	msg := make([]byte, h.length)
	_, err := io.ReadFull(p.br, msg)
	return h, string(msg), err
}

// spam writes b to p's connection over and over, each write given up to
// wait, until stop is closed.
func (p *rawPeer) spam(b []byte, wait time.Duration, stop <-chan struct{}) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		_ = p.c.SetWriteDeadline(time.Now().Add(wait))
		_, _ = p.c.Write(b)
	}
}

// The handshake's claims are checked against the kernel's: a dialler that
// names another process, or expects another agent, is refused and counted.
func TestHandshakeRefusals(t *testing.T) {
	a, b := newAgent(t)
	for _, c := range []struct {
		name   string
		expect uuid.UUID
		pid    int
	}{
		{"OtherPID", a.ID(), os.Getpid() + 1},
		{"OtherAgent", uuid.New(), os.Getpid()},
	} {
		t.Run(c.name, func(t *testing.T) {
			before, stats := a.Stats().Refused, b.Stats()
			p := dialRaw(t, b)
			in, err := p.hello(c.expect, c.pid)
			require.NoError(t, err)
			assert.Equal(t, uint8(stWrong), in.status)
			assert.Zero(t, in.probe, "a refused dialler learns no probe address")
			_, err = p.br.ReadByte()
			assert.ErrorIs(t, err, io.EOF, "the connection is dropped")
			require.Eventually(t, func() bool { return a.Stats().Refused > before }, 5*time.Second, time.Millisecond)
			waitStats(t, b, stats, Stats{Disconnected: 1, HandshakeFailures: 1})
		})
	}
}

// Every lease request is checked: forged key, wrong access, ranges outside
// the exposure, device memory. Refusals leave the connection up.
func TestLeaseRefusals(t *testing.T) {
	a, b := newAgent(t)
	src := bytes.Repeat([]byte{7}, 64<<10)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(src)})
	require.NoError(t, err)
	defer exp.Revoke()
	base := agent.DRAM(src).Addr
	p := joinRaw(t, a, b)
	cases := []struct {
		name  string
		key   agent.Key
		acc   agent.Access
		table [][2]uint64
		want  string
	}{
		{"ForgedKey", agent.NewKey(), agent.AccessRead, [][2]uint64{{base, 16}}, "no exposure for key"},
		{"WrongAccess", exp.Key(), agent.AccessWrite, [][2]uint64{{base, 16}}, "write access to memory exposed for read"},
		{"Outside", exp.Key(), agent.AccessRead, [][2]uint64{{base, 16}, {base + 64<<10 - 8, 16}}, "range 1"},
		{"Overflow", exp.Key(), agent.AccessRead, [][2]uint64{{^uint64(0) - 4, 16}}, "outside the exposed regions"},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before, stats := a.Stats().Refused, b.Stats()
			p.send(header{typ: tBegin, status: uint8(c.acc), count: uint32(len(c.table)), id: uint64(i + 1), key: c.key}, c.table, nil)
			h, msg, err := p.grant()
			require.NoError(t, err)
			assert.Equal(t, uint8(stDenied), h.status)
			assert.Equal(t, uint64(i+1), h.id)
			assert.Contains(t, msg, c.want)
			assert.Greater(t, a.Stats().Refused, before)
			assert.Equal(t, Stats{Denied: 1}, delta(b.Stats(), stats))
		})
	}
	p.send(header{typ: tBegin, status: uint8(agent.AccessRead), count: 1, id: 99, key: exp.Key()}, [][2]uint64{{base, 64 << 10}}, nil)
	h, _, err := p.grant()
	require.NoError(t, err)
	require.Equal(t, uint8(stOK), h.status, "a valid request after refusals")
	p.send(header{typ: tEnd, id: 99}, nil, nil)
}

// Revoke waits for a granted lease: it returns only once the peer ends the
// lease, or once the peer's connection closes.
func TestRevokeWaitsForLease(t *testing.T) {
	for _, how := range []string{"End", "Disconnect"} {
		t.Run(how, func(t *testing.T) {
			_, exp, p, addr := holdLease(t)

			revoked := make(chan struct{})
			go func() { exp.Revoke(); close(revoked) }()
			select {
			case <-revoked:
				t.Fatal("Revoke returned while a lease was held")
			case <-time.After(50 * time.Millisecond):
			}
			if how == "End" {
				p.send(header{typ: tEnd, id: 1}, nil, nil)
			} else {
				_ = p.c.Close()
			}
			<-revoked
			// A later request on the same key is refused.
			if how == "End" {
				p.send(header{typ: tBegin, status: uint8(agent.AccessWrite), count: 1, id: 2, key: exp.Key()}, [][2]uint64{{addr, 4096}}, nil)
				h, msg, err := p.grant()
				require.NoError(t, err)
				assert.Equal(t, uint8(stDenied), h.status)
				assert.Contains(t, msg, "revoked")
			}
		})
	}
}

// Malformed frames drop the connection and are counted, and release the
// leases the connection held.
func TestMalformedFrames(t *testing.T) {
	a, b := newAgent(t)
	buf := make([]byte, 4096)
	exp, err := a.Expose(agent.AccessRead, []agent.Local{agent.DRAM(buf)})
	require.NoError(t, err)
	defer exp.Revoke()
	protocol := Stats{Disconnected: 1, ProtocolErrors: 1}
	limit := Stats{Disconnected: 1, LimitRejected: 1}
	for _, c := range []struct {
		name string
		h    header
		want Stats
	}{
		{"UnknownType", header{typ: 42}, protocol},
		{"TooManyRanges", header{typ: tBegin, status: 1, count: 1 << 20}, limit},
		{"NoRanges", header{typ: tBegin, status: 1}, protocol},
		{"BadAccess", header{typ: tBegin, status: 9, count: 1}, protocol},
		{"HugeNotify", header{typ: tNotify, length: 1 << 30}, limit},
		{"GrantFromActive", header{typ: tGrant}, protocol},
		{"EndWithRanges", header{typ: tEnd, count: 1}, protocol},
		{"EndWithPayload", header{typ: tEnd, length: 1}, protocol},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := joinRaw(t, a, b)
			p.send(header{typ: tBegin, status: 1, count: 1, id: 1, key: exp.Key()}, [][2]uint64{{agent.DRAM(buf).Addr, 16}}, nil)
			h, _, err := p.grant()
			require.NoError(t, err)
			require.Equal(t, uint8(stOK), h.status)
			before, stats := a.Stats().Refused, b.Stats()
			p.send(c.h, nil, nil)
			_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err = p.br.ReadByte()
			require.Error(t, err)
			var ne net.Error
			require.False(t, errors.As(err, &ne) && ne.Timeout(), "the connection was not dropped")
			require.Eventually(t, func() bool { return a.Stats().Refused > before }, 5*time.Second, time.Millisecond)
			waitStats(t, b, stats, c.want)
		})
	}
	done := make(chan struct{})
	go func() { exp.Revoke(); close(done) }()
	<-done // every lease the dropped connections held is released
}

func TestConnInfo(t *testing.T) {
	ci := connInfo{host: [8]byte{1, 2, 3, 4, 5, 6, 7, 8}, pid: 4242, sock: "goxfer-cma/x"}
	got, err := parseConnInfo(ci.marshal())
	require.NoError(t, err)
	require.Equal(t, ci, got)
	for _, bad := range [][]byte{nil, {protoVersion}, append([]byte{9}, ci.marshal()[1:]...), append(ci.marshal(), strings.Repeat("x", 200)...)} {
		_, err := parseConnInfo(bad)
		require.Error(t, err)
	}
}
