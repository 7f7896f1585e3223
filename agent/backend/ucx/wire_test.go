package ucx

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

var testLimits = limits{maxRanges: 4096, maxNotify: 64 << 10}

func openMsg(push bool) []byte {
	b := header(nil, tOpen, uint8(agent.AccessRead), 2, cid{1})
	b = binary.LittleEndian.AppendUint64(b, 7)
	k := agent.NewKey()
	b = append(b, k[:]...)
	for i := range 2 {
		b = binary.LittleEndian.AppendUint64(b, uint64(0x1000*(i+1)))
		b = binary.LittleEndian.AppendUint64(b, 64)
	}
	if push {
		b[3] = 1
		b = binary.LittleEndian.AppendUint64(b, 0x9000)
		b = binary.LittleEndian.AppendUint64(b, 0x9040)
		b = binary.LittleEndian.AppendUint32(b, 1)
		b = binary.LittleEndian.AppendUint64(b, 3)
		b = binary.LittleEndian.AppendUint16(b, 2)
		b = append(b, 0xaa, 0xbb, 0, 0, 0, 0)
	}
	return b
}

func TestParseMsg(t *testing.T) {
	m, err := parseMsg(openMsg(false), testLimits)
	require.NoError(t, err)
	addr, n := m.rangeAt(1)
	require.Equal(t, [2]uint64{0x2000, 64}, [2]uint64{addr, n})
	m, err = parseMsg(openMsg(true), testLimits)
	require.NoError(t, err)
	require.True(t, m.push)
	require.Equal(t, uint64(0x9040), m.localAt(1))
	keys, idx, err := parseGrant(m.keys, m.nkeys, int(m.count), nil, nil)
	require.NoError(t, err)
	require.Equal(t, []uint16{0, 0}, idx)
	require.Equal(t, uint64(3), keys[0].reg)
	require.Equal(t, []byte{0xaa, 0xbb}, keys[0].packed)

	bad := openMsg(false)
	bad[3] = 9
	_, err = parseMsg(bad, testLimits)
	require.ErrorIs(t, err, errProtocol)
	_, err = parseMsg(openMsg(false)[:30], testLimits)
	require.ErrorIs(t, err, errProtocol)
	_, err = parseMsg(header(nil, tPing, 0, 5, cid{}), testLimits)
	require.ErrorIs(t, err, errProtocol)
}

func TestParseInline(t *testing.T) {
	inline := func(acc agent.Access, n uint64, data int) []byte {
		b := header(nil, tOpen, uint8(acc), 1, cid{1})
		b = binary.LittleEndian.AppendUint64(b, 7)
		k := agent.NewKey()
		b = append(b, k[:]...)
		b = binary.LittleEndian.AppendUint64(b, 0x1000)
		b = binary.LittleEndian.AppendUint64(b, n)
		b[3] = 2
		return append(b, make([]byte, data)...)
	}
	m, err := parseMsg(inline(agent.AccessWrite, 100, 100), testLimits)
	require.NoError(t, err)
	require.True(t, m.inline)
	require.Len(t, m.data, 100)
	m, err = parseMsg(inline(agent.AccessRead, 100, 0), testLimits)
	require.NoError(t, err)
	require.True(t, m.inline)
	_, err = parseMsg(inline(agent.AccessWrite, 100, 99), testLimits)
	require.ErrorIs(t, err, errProtocol, "short data")
	_, err = parseMsg(inline(agent.AccessWrite, 100, 101), testLimits)
	require.ErrorIs(t, err, errProtocol, "trailing data")
	_, err = parseMsg(inline(agent.AccessRead, maxInline+1, 0), testLimits)
	require.ErrorIs(t, err, errProtocol, "too big")
	_, err = parseMsg(inline(agent.AccessRead, 1<<63, 0), testLimits)
	require.ErrorIs(t, err, errProtocol, "huge")
}

func TestConnInfo(t *testing.T) {
	c := connInfo{net: true, host: [8]byte{1, 2}, addr: []byte("worker")}
	got, err := parseConnInfo(c.marshal())
	require.NoError(t, err)
	require.Equal(t, c, got)
	_, err = parseConnInfo([]byte{protoVersion, 0})
	require.Error(t, err)
}

// FuzzParse feeds untrusted active messages and grants to the decoders: no
// panic, and every accepted open is internally consistent.
func FuzzParse(f *testing.F) {
	f.Add(openMsg(false))
	f.Add(openMsg(true))
	f.Add(header(nil, tHello, 0, 0, cid{}))
	f.Add(append(header(nil, tGrant, stOK, 1, cid{}), make([]byte, 20)...))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseMsg(b, testLimits)
		if err != nil {
			return
		}
		switch m.typ {
		case tOpen:
			for i := range int(m.count) {
				m.rangeAt(i)
			}
			if m.push {
				_, _, _ = parseGrant(m.keys, m.nkeys, int(m.count), nil, nil)
			}
		case tGrant:
			_, _, _ = parseGrant(m.body, m.count, 4, nil, nil)
		}
	})
}
