package connect

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The token sizes the docs state are measured: a token of one host
// descriptor from a Connector with the default backends, full and compact,
// what each further host block under 2 MiB adds, and what the endpoints
// weigh (full minus compact). Every figure found in the docs must match the
// measurement: "about" figures within 5 bytes (endpoints vary with the
// port and socket names), the compact size within 2, the per-block ones
// exactly. A doc page that no longer states a figure where this test looks
// for one fails too: reword both together.
func TestDocsTokenSizes(t *testing.T) {
	ctx := guarded(t)
	c := newConnector(t)
	one := func(n int) Metadata {
		bufs := make([][]byte, n)
		for i := range bufs {
			bufs[i] = make([]byte, 64<<10)
		}
		op, err := c.CreateReadable(ctx, descriptors(bufs)...)
		require.NoError(t, err)
		t.Cleanup(func() { _ = op.Close() })
		return op.Metadata()
	}
	md1, md2 := one(1), one(2)
	full, compact := md1.EncodedLen(), md1.Compact().EncodedLen()
	perHost := md2.EncodedLen() - full
	endpoints := full - compact
	// Most a descriptor can add: 8 bytes of address, a length up to 2^63 in
	// a uvarint, where it lives (device << 1 | kind) in a uvarint.
	const perMax = 8 + 10 + 5
	t.Logf("token, one descriptor: %d B full, %d B compact; +%d B a host block; endpoints %d B", full, compact, perHost, endpoints)

	type figure struct {
		name  string
		want  int
		slack int
	}
	for _, tc := range []struct {
		file string
		re   string
		figs []figure
	}{
		{"concepts.md", `about (\d+) bytes of binary \((\d+) when\s+compact\), and each further descriptor adds at most (\d+) \((\d+) for a host block`,
			[]figure{{"full", full, 5}, {"compact", compact, 2}, {"per descriptor", perMax, 0}, {"per host block", perHost, 0}}},
		{"concepts.md", `endpoints, about (\d+) bytes\)`, []figure{{"endpoints", endpoints, 5}}},
		{"getting-started.md", `~(\d+) B \+ up to (\d+) B per block`, []figure{{"full", full, 5}, {"per descriptor", perMax, 0}}},
		{"migrating-from-dynamo.md", `About (\d+) bytes for one descriptor with the default backends \((\d+) compact\), at most (\d+) more per descriptor`,
			[]figure{{"full", full, 5}, {"compact", compact, 2}, {"per descriptor", perMax, 0}}},
		{"migrating-from-dynamo.md", `drops the endpoints \(about (\d+) bytes\)`, []figure{{"endpoints", endpoints, 5}}},
		{"nats.md", `\(about (\d+) bytes\); a Connector built with`, []figure{{"endpoints", endpoints, 5}}},
		{"nats.md", `A token takes about (\d+) bytes \((\d+) compact\) plus up to (\d+) per descriptor`,
			[]figure{{"full", full, 5}, {"compact", compact, 2}, {"per descriptor", perMax, 0}}},
		{"troubleshooting.md", `saves about (\d+) bytes`, []figure{{"endpoints", endpoints, 5}}},
	} {
		b, err := os.ReadFile(filepath.Join("..", "docs", tc.file))
		require.NoError(t, err)
		m := regexp.MustCompile(tc.re).FindSubmatch(b)
		require.NotNil(t, m, "docs/%s no longer says %q", tc.file, tc.re)
		for i, f := range tc.figs {
			got, err := strconv.Atoi(string(m[i+1]))
			require.NoError(t, err)
			assert.InDelta(t, f.want, got, float64(f.slack), "docs/%s states %d bytes for the token's %s; measured %d", tc.file, got, f.name, f.want)
		}
	}
}
