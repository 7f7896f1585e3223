package connect

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
)

// selectBackends are the backends selection runs over: a narrowed token's
// ranges reach each backend's own checks.
var selectBackends = []string{"mem", "tcp", "cma"}

// selectSizes are the descriptors the selection tests expose: odd sizes,
// one spanning several tcp chunks.
var selectSizes = []int{4096, 100000, 1<<20 + 7, 33}

// spanBytes returns the bytes s names in bufs.
func spanBytes(bufs [][]byte, s Span) []byte {
	b := bufs[s.Index][s.Offset:]
	if s.Length > 0 {
		b = b[:s.Length]
	}
	return b
}

func TestSelect(t *testing.T) {
	md := testMetadata(KindRead, 3) // 64 KiB each; descriptor 7 would be a GPU's
	sel, err := md.Select(Span{Index: 2}, Span{Index: 0, Offset: 100, Length: 28}, Span{Index: 1, Offset: 65535}, Span{Index: 0, Offset: 120, Length: 8})
	require.NoError(t, err)
	assert.Equal(t, []int{65536, 28, 1, 8}, sel.Sizes())
	assert.Equal(t, KindRead, sel.Kind())
	assert.Equal(t, md.Agent(), sel.Agent())
	assert.Equal(t, md.key, sel.key, "the same key: the same passive operation")
	assert.Equal(t, md.peer, sel.peer)
	assert.Equal(t, []agent.Region{
		md.regions[2],
		{Addr: md.regions[0].Addr + 100, Len: 28},
		{Addr: md.regions[1].Addr + 65535, Len: 1},
		{Addr: md.regions[0].Addr + 120, Len: 8},
	}, sel.regions)
	assert.Equal(t, uniform(3, 65536), md.Sizes(), "md is unchanged")
	assert.Contains(t, sel.String(), "descriptors=4 bytes=65573 full key="+md.fingerprint())

	// A narrowed token is a token: it travels and parses like any other.
	back, err := ParseMetadata(sel.Text())
	require.NoError(t, err)
	assert.Equal(t, sel, back)

	// Narrowing again indexes the narrowed token's descriptors.
	again, err := sel.Select(Span{Index: 1, Offset: 4, Length: 4}, Span{Index: 0, Length: 10})
	require.NoError(t, err)
	assert.Equal(t, []agent.Region{
		{Addr: md.regions[0].Addr + 104, Len: 4},
		{Addr: md.regions[2].Addr, Len: 10},
	}, again.regions)

	// Compact stays compact; GPU descriptors keep their device.
	gpu := testMetadata(KindWrite, 8).Compact()
	gsel, err := gpu.Select(Span{Index: 7, Offset: 4096, Length: 4096})
	require.NoError(t, err)
	assert.True(t, gsel.IsCompact())
	assert.Equal(t, agent.Region{Addr: gpu.regions[7].Addr + 4096, Len: 4096, Kind: agent.KindVRAM, Device: gpu.regions[7].Device}, gsel.regions[0])
	assert.Equal(t, KindWrite, gsel.Kind())
}

func TestSelectInvalidSpans(t *testing.T) {
	read := testMetadata(KindRead, 3)
	write := testMetadata(KindWrite, 3)
	tests := []struct {
		name  string
		md    Metadata
		spans []Span
		want  string
	}{
		{"none", read, nil, "want at least one span, found none"},
		{"index past the end", read, []Span{{Index: 0}, {Index: 3}}, "span 1: want a descriptor index in [0, 3), found 3"},
		{"negative index", read, []Span{{Index: -1}}, "span 0: want a descriptor index in [0, 3), found -1"},
		{"offset at the end", read, []Span{{Index: 1, Offset: 65536}}, "span 0: descriptor 1 has 65536 bytes: want an offset in [0, 65536), found 65536"},
		{"negative offset", read, []Span{{Index: 1, Offset: -1, Length: 2}}, "want an offset in [0, 65536), found -1"},
		{"negative length", read, []Span{{Index: 2, Length: -5}}, "span 0: want a length of 0 (to the end) or more, found -5"},
		{"past the end", read, []Span{{Index: 2, Offset: 65000, Length: 537}}, "span 0: descriptor 2 has 65536 bytes: want at most 536 from offset 65000, found a length of 537"},
		{"overflowing length", read, []Span{{Index: 2, Offset: 10, Length: int(^uint(0) >> 1)}}, "want at most 65526 from offset 10"},
		{"write overlap", write, []Span{{Index: 1, Offset: 0, Length: 100}, {Index: 0}, {Index: 1, Offset: 99, Length: 1}}, "spans 0 and 2 of a WRITE token overlap: want disjoint spans, found descriptor 1 [0, 100) and descriptor 1 [99, 100)"},
		{"write repeat", write, []Span{{Index: 2}, {Index: 2}}, "spans 0 and 1 of a WRITE token overlap"},
		{"write to the end overlaps", write, []Span{{Index: 0, Offset: 1000}, {Index: 0, Offset: 5000, Length: 1}}, "found descriptor 0 [1000, 65536) and descriptor 0 [5000, 5001)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sel, err := tt.md.Select(tt.spans...)
			require.ErrorIs(t, err, ErrInvalidSpan)
			assert.ErrorContains(t, err, tt.want)
			assert.Zero(t, sel.Kind())
		})
	}
	_, err := Metadata{}.Select(Span{})
	require.ErrorIs(t, err, ErrInvalidMetadata)

	// READ spans may repeat and overlap; WRITE spans may touch.
	_, err = read.Select(Span{Index: 1}, Span{Index: 1, Offset: 5, Length: 5})
	require.NoError(t, err)
	_, err = write.Select(Span{Index: 0, Length: 100}, Span{Index: 0, Offset: 100, Length: 100}, Span{Index: 1, Length: 100})
	require.NoError(t, err)
}

// Real Connectors move the selected bytes, and only those, in the order
// given; the passive side completes as with the whole token.
func TestSelectTransfers(t *testing.T) {
	spans := []Span{
		{Index: 3},                              // a small descriptor whole
		{Index: 2, Offset: 100, Length: 700000}, // inside a large one
		{Index: 0, Offset: 4000},                // to the end
		{Index: 2, Offset: 900000, Length: 1},   // one byte, after a later span of the same descriptor
	}
	for _, backend := range selectBackends {
		t.Run(backend+"/READ", func(t *testing.T) {
			ctx := guarded(t)
			passive, act := pair(t, backend)
			exposed := buffers(selectSizes, 1)
			pop := expose(t, passive, KindRead, exposed)
			md, err := pop.Metadata().Select(spans...)
			require.NoError(t, err)
			local := buffers(md.Sizes(), 0)
			op := moved(t, ctx, act, md, local)
			assert.Equal(t, backend, op.Backend())
			for i, s := range spans {
				require.True(t, bytes.Equal(spanBytes(exposed, s), local[i]), "span %d", i)
			}
			require.NoError(t, pop.Wait(ctx))
			assert.Equal(t, StatusComplete, pop.Status())
			requireSame(t, buffers(selectSizes, 1), exposed)
		})
		t.Run(backend+"/WRITE", func(t *testing.T) {
			ctx := guarded(t)
			passive, act := pair(t, backend)
			exposed := buffers(selectSizes, 1)
			pop := expose(t, passive, KindWrite, exposed)
			md, err := pop.Metadata().Select(spans...)
			require.NoError(t, err)
			src := buffers(md.Sizes(), 7)
			moved(t, ctx, act, md, src)
			require.NoError(t, pop.Wait(ctx))
			require.NoError(t, pop.Close())
			want := buffers(selectSizes, 1)
			for i, s := range spans {
				copy(spanBytes(want, s), src[i])
			}
			requireSame(t, want, exposed)
		})
	}
}

// Local descriptors mirror the narrowed token, not the whole one.
func TestSelectLocalSizes(t *testing.T) {
	ctx := guarded(t)
	passive, act := pair(t, "mem")
	pop := expose(t, passive, KindRead, buffers([]int{100, 200}, 1))
	md, err := pop.Metadata().Select(Span{Index: 1, Offset: 50, Length: 60})
	require.NoError(t, err)
	_, err = begin(ctx, act, md, buffers([]int{100, 200}, 0))
	require.ErrorIs(t, err, ErrSizeMismatch)
	assert.ErrorContains(t, err, "2 local descriptors != 1 remote descriptors")
	_, err = begin(ctx, act, md, buffers([]int{200}, 0))
	require.ErrorIs(t, err, ErrSizeMismatch)
	assert.ErrorContains(t, err, "descriptor 0: local size 200 != remote size 60")
	moved(t, ctx, act, md, buffers([]int{60}, 0))
}

// Parts of one token read one after the other, as a pipelined reader does:
// the first completion completes the passive operation, and the token
// keeps granting its memory until Close, as a whole token would.
func TestSelectPartsOneByOne(t *testing.T) {
	for _, backend := range selectBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive, act := pair(t, backend)
			exposed := buffers(uniform(4, 8192), 1)
			pop := expose(t, passive, KindRead, exposed)
			md := pop.Metadata()
			for layer := range 4 {
				part, err := md.Select(Span{Index: layer})
				require.NoError(t, err)
				local := buffers([]int{8192}, 0)
				moved(t, ctx, act, part, local)
				require.Equal(t, exposed[layer], local[0], "layer %d", layer)
				require.NoError(t, pop.Wait(ctx), "layer %d", layer)
				assert.Equal(t, StatusComplete, pop.Status(), "layer %d: the first part's completion stands", layer)
			}
			require.NoError(t, pop.Close())
			part, err := md.Select(Span{Index: 0, Length: 1})
			require.NoError(t, err)
			require.ErrorIs(t, beginWait(ctx, act, part, buffers([]int{1}, 0)), ErrAccessDenied)
			require.NoError(t, pop.Wait(ctx), "the outcome stays the first reader's")
		})
	}
}

// A failed selected WRITE fails the passive operation, as any would.
func TestSelectFailureReachesPassive(t *testing.T) {
	ctx := guarded(t)
	passive, act, _ := stallPair(t)
	pop := expose(t, passive, KindWrite, buffers([]int{64, 64}, 1))
	md, err := pop.Metadata().Select(Span{Index: 1, Offset: 8, Length: 8})
	require.NoError(t, err)
	op, err := begin(ctx, act, md, buffers([]int{8}, 2))
	require.NoError(t, err)
	op.Cancel()
	require.ErrorIs(t, op.Wait(ctx), ErrCancelled)
	require.ErrorIs(t, pop.Wait(ctx), ErrCancelled)
	assert.Equal(t, StatusCancelled, pop.Status())
}

// A token widened by hand beyond what was exposed is refused by the
// exposing side, whichever way it is widened, and the refusal is counted:
// no byte outside the exposure is read or written, and a READ's widened
// descriptor reads nothing (the valid one may have moved before the
// refusal, as bytes of a failed transfer may). Widened within what was
// exposed, it is not refused: a narrowed token's key grants the whole
// exposure.
func TestWidenedTokenRefused(t *testing.T) {
	// The token is narrowed to part of descriptor 0 and all of descriptor
	// 1, adjacent halves of one buffer inside a larger one: every byte
	// around them is addressable memory that was not exposed. Each forgery
	// widens one descriptor and says which.
	widen := map[string]func(rs []agent.Region) int{
		"before the exposure":           func(rs []agent.Region) int { rs[0].Addr -= 11; rs[0].Len += 11; return 0 },
		"past the exposure":             func(rs []agent.Region) int { rs[1].Len++; return 1 },
		"moved past":                    func(rs []agent.Region) int { rs[1].Addr += 16; return 1 },
		"across both halves":            func(rs []agent.Region) int { rs[0].Len += rs[1].Len; return 0 },
		"a megabyte":                    func(rs []agent.Region) int { rs[1].Len = 1 << 20; return 1 },
		"a page before":                 func(rs []agent.Region) int { rs[0].Addr -= 4096; return 0 },
		"within the exposure (allowed)": func(rs []agent.Region) int { rs[0].Addr -= 10; rs[0].Len += 10; return 0 },
	}
	for _, backend := range selectBackends {
		for _, kind := range []OperationKind{KindRead, KindWrite} {
			for name, widen := range widen {
				t.Run(fmt.Sprintf("%s/%v/%s", backend, kind, name), func(t *testing.T) {
					ctx := guarded(t)
					passive, act := pair(t, backend)
					outer := buffers([]int{3 * 4096}, 1)[0]
					halves := [][]byte{outer[4096 : 4096+2048], outer[4096+2048 : 2*4096]}
					pop := expose(t, passive, kind, halves)
					md, err := pop.Metadata().Select(Span{Index: 0, Offset: 10}, Span{Index: 1})
					require.NoError(t, err)
					md.regions = append([]agent.Region(nil), md.regions...)
					bad := widen(md.regions)
					// On the wire, as a peer would forge it.
					forged, err := ParseMetadata(md.Text())
					require.NoError(t, err)
					local := buffers(forged.Sizes(), 9)
					before := passive.Stats().Refused
					err = beginWait(ctx, act, forged, local)
					if name == "within the exposure (allowed)" {
						require.NoError(t, err)
						return
					}
					require.ErrorIs(t, err, ErrAccessDenied)
					assert.Greater(t, passive.Stats().Refused, before, "the refusal is counted")
					want := buffers([]int{3 * 4096}, 1)[0]
					require.Equal(t, want[:4096], outer[:4096], "memory before the exposure")
					require.Equal(t, want[2*4096:], outer[2*4096:], "memory after the exposure")
					if kind == KindRead {
						require.Equal(t, buffers(forged.Sizes(), 9)[bad], local[bad], "the widened descriptor read nothing")
					}
				})
			}
		}
	}
}

// Simulated GPU memory: parts of device descriptors, read into host and
// device memory and written from host memory, over every backend (cma
// maps the peer's GPU memory, the others stage it).
func TestSelectGPU(t *testing.T) {
	sim := devmem.NewSim(2)
	const n = 1<<20 + 4096
	alloc := func(t *testing.T, fill []byte) uintptr {
		p, err := sim.Alloc(1, n)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sim.Free(p) })
		if fill != nil {
			require.NoError(t, devmem.CopyToDevice(sim, 1, p, fill))
		}
		return p
	}
	read := func(t *testing.T, p uintptr, size int) []byte {
		out := make([]byte, size)
		require.NoError(t, devmem.CopyToHost(sim, 1, out, p))
		return out
	}
	for _, backend := range selectBackends {
		t.Run(backend, func(t *testing.T) {
			ctx := guarded(t)
			passive := newConnector(t, WithDevice(sim), WithStaging(256<<10, 8<<20))
			act := newConnector(t, WithDevice(sim), WithStaging(256<<10, 8<<20), WithBackend(backend))
			src := make([]byte, n)
			for i := range src {
				src[i] = byte(rand.Uint32())
			}
			// Two device descriptors in one allocation, and one of host memory.
			rp := alloc(t, src)
			host := buffers([]int{5000}, 3)[0]
			rop, err := passive.CreateReadable(ctx,
				NewDeviceDescriptor(rp, n/2, CUDA(1)), NewDeviceDescriptor(rp+n/2, n/2, CUDA(1)), NewDescriptor(host))
			require.NoError(t, err)
			t.Cleanup(func() { _ = rop.Close() })
			md, err := rop.Metadata().Select(Span{Index: 1, Offset: 1000, Length: 300000}, Span{Index: 2, Offset: 17}, Span{Index: 0, Offset: 4096, Length: 65536})
			require.NoError(t, err)

			// Into GPU memory, then host memory.
			lp := alloc(t, nil)
			hostDst := make([]byte, 65536)
			hostDst2 := make([]byte, 5000-17)
			rd, err := act.BeginRead(ctx, md, NewDeviceDescriptor(lp, 300000, CUDA(1)), NewDescriptor(hostDst2), NewDescriptor(hostDst))
			require.NoError(t, err)
			require.NoError(t, rd.Wait(ctx))
			require.NoError(t, rop.Wait(ctx))
			assert.Equal(t, gpuPath(backend), rd.Path())
			require.True(t, bytes.Equal(src[n/2+1000:n/2+1000+300000], read(t, lp, 300000)), "device span into device memory")
			require.True(t, bytes.Equal(host[17:], hostDst2), "host span")
			require.True(t, bytes.Equal(src[4096:4096+65536], hostDst), "device span into host memory")
			require.NoError(t, rop.Close())

			// WRITE parts of the peer's GPU memory; the rest stays as it was.
			gp := alloc(t, src)
			wop, err := passive.CreateWritable(ctx, NewDeviceDescriptor(gp, n, CUDA(1)))
			require.NoError(t, err)
			t.Cleanup(func() { _ = wop.Close() })
			wmd, err := wop.Metadata().Select(Span{Index: 0, Offset: n - 4096}, Span{Index: 0, Offset: 8, Length: 100000})
			require.NoError(t, err)
			a, b := buffers([]int{4096}, 5)[0], buffers([]int{100000}, 6)[0]
			wr, err := act.BeginWrite(ctx, wmd, NewDescriptor(a), NewDescriptor(b))
			require.NoError(t, err)
			require.NoError(t, wr.Wait(ctx))
			require.NoError(t, wop.Wait(ctx))
			require.NoError(t, wop.Close())
			want := bytes.Clone(src)
			copy(want[n-4096:], a)
			copy(want[8:], b)
			require.True(t, bytes.Equal(want, read(t, gp, n)), "WRITE of parts of GPU memory")
		})
	}
}
