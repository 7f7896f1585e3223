package ucx_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backend/ucx"
)

func TestOptions(t *testing.T) {
	for _, c := range []struct {
		name string
		opt  ucx.Option
		ok   bool
	}{
		{"Transports", ucx.WithTransports("tcp,self"), true},
		{"TransportsEmpty", ucx.WithTransports(" "), false},
		{"TransportsSpace", ucx.WithTransports("tcp, self"), false},
		{"Config", ucx.WithConfig("UCX_RNDV_THRESH", "8k"), true},
		{"ConfigLower", ucx.WithConfig("rndv_thresh", "8k"), false},
		{"ConfigTLS", ucx.WithConfig("TLS", "posix,self"), true},
		{"Timeout", ucx.WithTimeout(time.Second), true},
		{"TimeoutShort", ucx.WithTimeout(time.Millisecond), false},
		{"Lease", ucx.WithLeaseSize(1 << 20), true},
		{"LeaseSmall", ucx.WithLeaseSize(1), false},
		{"InlineOff", ucx.WithInlineSize(0), true},
		{"Inline", ucx.WithInlineSize(4096), true},
		{"InlineBig", ucx.WithInlineSize(1 << 20), false},
		{"GetReads", ucx.WithGetReads(true), true},
		{"SysvOff", ucx.WithSysvBesidePosix(false), true},
		{"Nil", nil, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := ucx.CheckOptions(c.opt)
			if c.ok {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, agent.ErrInvalidOption)
			// The agent's constructor reports it, built in or not.
			_, err = agent.New(agent.WithBackends(ucx.New(c.opt)))
			require.ErrorIs(t, err, agent.ErrInvalidOption)
		})
	}
}
