package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The control rows run interleaved with the ping-pong when it runs (the
// default), and apart from it without the baselines. It asserts what is
// measured against what, never how fast.
func TestControlRowsInterleaved(t *testing.T) {
	for _, tc := range []struct {
		name        string
		args        []string
		interleaved bool
	}{
		{"with the ping-pong", nil, true},
		{"without", []string{"-interleave=false"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			jsonPath := filepath.Join(t.TempDir(), "r.json")
			args := append([]string{"-backends", "tcp", "-blocks", "4K", "-ops", "read", "-iters", "4", "-warmup", "1",
				"-latency-iters", "40", "-ucx", "off", "-progress", "off", "-o", jsonPath, "-timeout", "20s"}, tc.args...)
			code, stdout, stderr := bench(t, args...)
			require.Equal(t, 0, code, "stderr:\n%s", stderr)
			var doc struct {
				Results []Result `json:"results"`
			}
			b, err := os.ReadFile(jsonPath)
			require.NoError(t, err)
			require.NoError(t, json.Unmarshal(b, &doc))
			rows := 0
			for _, r := range doc.Results {
				if r.Kind != "control" || r.Op == "" {
					continue // create+token is the sweep's, not timed here
				}
				rows++
				assert.Positive(t, r.P50, r.Name)
				if !tc.interleaved {
					assert.Zero(t, r.PingPairs, r.Name)
					assert.NotContains(t, r.Note, "interleaved", r.Name)
					continue
				}
				// 40 calls in batches of 2: 20 pairs.
				assert.Equal(t, 20, r.PingPairs, r.Name)
				assert.Positive(t, r.PingP50, r.Name)
				assert.Positive(t, r.PingRatio, r.Name)
				assert.Contains(t, r.Note, "interleaved with the 4 KiB TCP ping-pong, 20 pairs of batches", r.Name)
				assert.Regexp(t, regexp.QuoteMeta(r.Name)+` +\S+ +1 +[0-9.]+ +[0-9.]+ +`+regexp.QuoteMeta(fmtF(r.PingRatio, 2))+`  `, stdout, "the table's ×ping column")
			}
			assert.Equal(t, 2, rows, "nats-token and tcp REQ+READ")
		})
	}
}
