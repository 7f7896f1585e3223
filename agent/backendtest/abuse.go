package backendtest

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
)

// abuse is a transfer the passive agent must refuse: tamper turns a valid
// request for segLen bytes inside region into an invalid one.
type abuse struct {
	name   string
	expose agent.Access
	op     agent.Op
	tamper func(r *agent.Request, e *agent.Exposure, region agent.Region)
}

const (
	abuseRegionLen = 64 << 10
	abuseSegLen    = 4 << 10
)

func abuses() []abuse {
	var cs []abuse
	for _, op := range ops {
		acc := op.Access()
		at := func(addr func(g agent.Region) uint64) func(*agent.Request, *agent.Exposure, agent.Region) {
			return func(r *agent.Request, _ *agent.Exposure, g agent.Region) { r.Segments[0].Remote.Addr = addr(g) }
		}
		cs = append(cs,
			abuse{"ForgedKey", acc, op, func(r *agent.Request, _ *agent.Exposure, _ agent.Region) { r.Key = agent.NewKey() }},
			abuse{"ZeroKey", acc, op, func(r *agent.Request, _ *agent.Exposure, _ agent.Region) { r.Key = agent.Key{} }},
			abuse{"FlippedKeyBit", acc, op, func(r *agent.Request, _ *agent.Exposure, _ agent.Region) { r.Key[15] ^= 0x80 }},
			abuse{"PartlyBefore", acc, op, at(func(g agent.Region) uint64 { return g.Addr - 100 })},
			abuse{"PartlyAfter", acc, op, at(func(g agent.Region) uint64 { return g.End() - 100 })},
			abuse{"JustAfter", acc, op, at(func(g agent.Region) uint64 { return g.End() })},
			abuse{"FullyBefore", acc, op, at(func(g agent.Region) uint64 { return g.Addr - 1<<20 })},
			abuse{"FullyAfter", acc, op, at(func(g agent.Region) uint64 { return g.End() + 1<<20 })},
			abuse{"AddressOverflow", acc, op, at(func(agent.Region) uint64 { return math.MaxUint64 - 100 })},
			abuse{"AfterRevoke", acc, op, func(_ *agent.Request, e *agent.Exposure, _ agent.Region) { e.Revoke() }},
		)
	}
	cs = append(cs,
		abuse{"ReadOfWriteExposure", agent.AccessWrite, agent.OpRead, func(*agent.Request, *agent.Exposure, agent.Region) {}},
		abuse{"WriteOfReadExposure", agent.AccessRead, agent.OpWrite, func(*agent.Request, *agent.Exposure, agent.Region) {}},
	)
	return cs
}

// testAbuse checks that every refused access fails with ErrAccessDenied, is
// counted by the passive agent, and touches no byte on either side.
func testAbuse(t *testing.T, cfg Config) {
	a, p := newPair(t, cfg)
	for _, c := range abuses() {
		t.Run(fmt.Sprintf("%s/%v", c.name, c.op), func(t *testing.T) {
			pb, pSeed := side(t, p, []int{abuseRegionLen})
			ab, aSeed := side(t, a, []int{abuseSegLen})
			e := expose(t, p, c.expose, pb)
			region := pb.locals[0].Region
			r := agent.Request{Op: c.op, Peer: p.Info(), Key: e.Key(), Segments: []agent.Segment{{
				Local:  ab.locals[0],
				Remote: agent.Region{Addr: region.Addr + 8<<10, Len: abuseSegLen},
			}}}
			c.tamper(&r, e, region)
			before := p.Stats().Refused
			require.ErrorIs(t, postWait(t, a, r), agent.ErrAccessDenied)
			require.NoError(t, pb.Check(pSeed), "passive memory after a refused %v", c.op)
			require.NoError(t, ab.Check(aSeed), "active memory after a refused %v", c.op)
			assert.Greater(t, p.Stats().Refused, before, "the passive agent counts the refusal")
			noEvent(t, e)
		})
	}
	// A refusal must not poison the connection: a valid transfer still works.
	t.Run("ValidAfterAbuse", func(t *testing.T) {
		for _, op := range ops {
			transfer(t, a, p, op, []int{abuseSegLen, 1}, []byte("still fine"))
		}
	})
}
