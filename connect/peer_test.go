package connect

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestAgentInfoRoundTrip(t *testing.T) {
	c := newConnector(t)
	ai := c.AgentInfo()
	assert.Equal(t, c.a.ID(), ai.ID())
	assert.Equal(t, []string{"mem", "cma", "tcp"}, ai.Backends())

	b, err := ai.MarshalBinary()
	require.NoError(t, err)
	var back AgentInfo
	require.NoError(t, back.UnmarshalBinary(b))
	assert.Equal(t, ai, back)

	_, err = AgentInfo{}.MarshalBinary()
	require.ErrorIs(t, err, ErrInvalidMetadata)
}

func TestAgentInfoCorrupt(t *testing.T) {
	valid, err := newConnector(t).AgentInfo().MarshalBinary()
	require.NoError(t, err)
	tests := []struct {
		name string
		in   []byte
		want string
	}{
		{"empty", nil, `want magic "gxa" and a version, found ""`},
		{"a token", []byte("gx\x01\x01"), `want magic "gxa"`},
		{"other version", append([]byte("gxa\x02"), valid[4:]...), "want version 1, found version 2"},
		{"truncated", valid[:20], "want at least 28 bytes, found 20 (truncated)"},
		{"damaged", append(append([]byte{}, valid[:10]...), append([]byte{valid[10] ^ 1}, valid[11:]...)...), "CRC-32C"},
		{"no backends", withCRC(append(append([]byte("gxa\x01"), valid[4:20]...), 0, 'x', 'x', 'x')), "want 1 to 16 backends, found 0"},
		{"nil agent", withCRC(append(append([]byte("gxa\x01"), make([]byte, 16)...), 1, 1, 'm', 0)), "want an agent ID, found the nil UUID"},
		{"trailing bytes", withCRC(append(append([]byte{}, valid[:len(valid)-4]...), 7)), "found 1 extra bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var ai AgentInfo
			err := ai.UnmarshalBinary(tt.in)
			require.ErrorIs(t, err, ErrInvalidMetadata)
			assert.ErrorContains(t, err, tt.want)
			assert.Equal(t, AgentInfo{}, ai, "a failed decode leaves the value alone")
		})
	}
}

// table is an in-memory Resolver, as a registry would be.
type table struct {
	mu    sync.Mutex
	infos map[uuid.UUID]AgentInfo
	err   error
	calls int
}

func (r *table) Resolve(_ context.Context, id uuid.UUID) (AgentInfo, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	if r.err != nil {
		return AgentInfo{}, r.err
	}
	ai, ok := r.infos[id]
	if !ok {
		return AgentInfo{}, fmt.Errorf("agent %s unknown", id)
	}
	return ai, nil
}

func TestCompactToken(t *testing.T) {
	passive := newConnector(t)
	src := buffers([]int{4096, 100}, 3)
	pop := expose(t, passive, KindRead, src)
	full := pop.Metadata()
	md := full.Compact()
	require.True(t, md.IsCompact())
	require.False(t, full.IsCompact())
	assert.Equal(t, passive.AgentInfo().ID(), md.Agent())
	assert.Less(t, md.EncodedLen(), full.EncodedLen()-40, "a compact token drops the endpoints")

	parsed, err := ParseMetadata(md.Text())
	require.NoError(t, err)
	require.True(t, parsed.IsCompact(), "compactness survives the text form")
	assert.Equal(t, md, parsed)

	t.Run("no resolver", func(t *testing.T) {
		_, err := newConnector(t, WithBackend("tcp")).BeginRead(t.Context(), parsed, descriptors(buffers([]int{4096, 100}, 0))...)
		require.ErrorIs(t, err, ErrNoBackend)
		assert.ErrorContains(t, err, "WithResolver")
	})
	t.Run("resolved", func(t *testing.T) {
		r := &table{infos: map[uuid.UUID]AgentInfo{passive.AgentInfo().ID(): passive.AgentInfo()}}
		active := newConnector(t, WithBackend("tcp"), WithResolver(r))
		dst := buffers([]int{4096, 100}, 0)
		op, err := active.BeginRead(t.Context(), parsed, descriptors(dst)...)
		require.NoError(t, err)
		require.NoError(t, op.Wait(guarded(t)))
		require.NoError(t, pop.Wait(guarded(t)))
		requireSame(t, src, dst)
		assert.Equal(t, "tcp", op.Backend())
		assert.Equal(t, 1, r.calls)

		// Full tokens never consult the resolver.
		op, err = active.BeginRead(t.Context(), full, descriptors(dst)...)
		require.NoError(t, err)
		require.NoError(t, op.Wait(guarded(t)))
		assert.Equal(t, 1, r.calls)
	})
	t.Run("departed", func(t *testing.T) {
		r := &table{err: fmt.Errorf("registry: %w", ErrRemoteLost)}
		_, err := newConnector(t, WithResolver(r)).BeginRead(t.Context(), parsed, descriptors(buffers([]int{4096, 100}, 0))...)
		require.ErrorIs(t, err, ErrRemoteLost)
		assert.ErrorContains(t, err, md.Agent().String())
	})
	t.Run("wrong agent", func(t *testing.T) {
		other := newConnector(t).AgentInfo()
		r := &table{infos: map[uuid.UUID]AgentInfo{md.Agent(): other}}
		_, err := newConnector(t, WithResolver(r)).BeginRead(t.Context(), parsed, descriptors(buffers([]int{4096, 100}, 0))...)
		require.ErrorIs(t, err, ErrInvalidMetadata)
		assert.ErrorContains(t, err, "returned agent "+other.ID().String())
	})
	t.Run("nil resolver", func(t *testing.T) {
		_, err := NewConnector(WithResolver(nil))
		require.ErrorIs(t, err, ErrInvalidOption)
	})
}

func TestPeerDeparted(t *testing.T) {
	passive, activeConn, stalled := stallPair(t)
	pop := expose(t, passive, KindRead, buffers([]int{1024}, 1))
	aop, err := begin(t.Context(), activeConn, pop.Metadata(), buffers([]int{1024}, 0))
	require.NoError(t, err)
	<-stalled

	activeConn.PeerDeparted(uuid.New()) // somebody else: nothing happens
	assert.Equal(t, StatusInProgress, aop.Status())

	activeConn.PeerDeparted(passive.AgentInfo().ID())
	err = aop.Wait(guarded(t))
	require.ErrorIs(t, err, ErrRemoteLost)
	assert.False(t, errors.Is(err, ErrCancelled), "a departure is a failure, not a cancellation: %v", err)
	var te *TransferError
	require.ErrorAs(t, err, &te)
	assert.Equal(t, passive.AgentInfo().ID(), te.Peer)
	assert.Contains(t, err.Error(), "departed")
	assert.Equal(t, StatusErrored, aop.Status())
	requireUnregistered(t, activeConn)

	// A peer declared gone by mistake is not refused afterwards.
	aop, err = begin(t.Context(), activeConn, pop.Metadata(), buffers([]int{1024}, 0))
	require.NoError(t, err)
	<-stalled
	aop.Cancel()
	require.ErrorIs(t, aop.Wait(guarded(t)), ErrCancelled)
}

// A passive operation a departed peer has used ends its Wait with
// ErrRemoteLost; one nobody has used yet keeps waiting.
func TestPeerDepartedPassive(t *testing.T) {
	passive, active := pair(t, "mem")
	used := expose(t, passive, KindWrite, buffers([]int{64}, 0))
	unused := expose(t, passive, KindWrite, buffers([]int{64}, 0))

	// The peer writes, but its completion notice is lost: the exposure is
	// bound to the peer and still waiting.
	notice(t, active, used.Metadata(), []byte{0xff})
	require.Equal(t, StatusInProgress, used.Status(), "mem delivers on the sender's goroutine")

	passive.PeerDeparted(active.AgentInfo().ID())
	err := used.Wait(guarded(t))
	require.ErrorIs(t, err, ErrRemoteLost)
	assert.Equal(t, StatusErrored, used.Status())
	assert.Equal(t, StatusInitialized, unused.Status())
}

func TestWithAgentID(t *testing.T) {
	id := uuid.New()
	c := newConnector(t, WithAgentID(id))
	assert.Equal(t, id, c.AgentInfo().ID())
	op := expose(t, c, KindRead, buffers([]int{8}, 1))
	assert.Equal(t, id, op.Metadata().Agent())

	_, err := NewConnector(WithAgentID(uuid.Nil))
	require.ErrorIs(t, err, ErrInvalidOption)
}
