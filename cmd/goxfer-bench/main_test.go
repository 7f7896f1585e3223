package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"image/png"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// asMainEnv makes the test binary act as the command: the initiator under
// test re-executes it (os.Executable) to start its target process.
const asMainEnv = "GOXFER_BENCH_AS_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(asMainEnv) == "1" {
		os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
	}
	_ = os.Setenv(asMainEnv, "1")
	goleak.VerifyTestMain(m)
}

// bench runs the command in this process, as the initiator.
func bench(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	code = run(ctx, args, &out, &errb)
	return code, out.String(), errb.String()
}

// TestSmoke runs the real flow: a target re-executed as a child process,
// coordinated over an embedded NATS server, every built backend, READ and
// WRITE with every byte checked, the baselines, and every output format.
// It asserts that the tool works, never how fast.
func TestSmoke(t *testing.T) {
	dir := t.TempDir()
	csvPath, jsonPath := filepath.Join(dir, "r.csv"), filepath.Join(dir, "r.json")
	svgPath, pngPath := filepath.Join(dir, "bw.svg"), filepath.Join(dir, "bw.png")
	code, stdout, stderr := bench(t, "-blocks", "4K,64K", "-descs", "1,3", "-inflight", "1,3", "-iters", "6", "-warmup", "1",
		"-check", "-latency-iters", "20", "-ucx", "off", "-o", csvPath+","+jsonPath, "-chart", svgPath, "-timeout", "20s")
	require.Equal(t, 0, code, "stderr:\n%s", stderr)
	assert.Contains(t, stdout, "GB/s")
	assert.Contains(t, stdout, "raw-tcp-pingpong")
	assert.Contains(t, stderr, "[1/", "one progress line per point when stderr is not a terminal")

	f, err := os.Open(csvPath)
	require.NoError(t, err)
	defer f.Close()
	rows, err := csv.NewReader(f).ReadAll()
	require.NoError(t, err)
	require.Equal(t, csvHeader, rows[0])
	col := map[string]int{}
	for i, h := range rows[0] {
		col[h] = i
	}
	seen := map[string]int{}
	for _, row := range rows[1:] {
		if row[col["kind"]] != "goxfer" {
			continue
		}
		seen[row[col["name"]]]++
		gbps, err := strconv.ParseFloat(row[col["gbps"]], 64)
		require.NoError(t, err)
		assert.Positive(t, gbps, row)
		assert.Equal(t, "true", row[col["checked"]], row)
		assert.Contains(t, row[col["note"]], "checked", row)
	}
	for _, b := range builtNames() {
		// 2 operations × 2 blocks × 2 descriptor counts × 2 depths
		assert.Equal(t, 16, seen[b], "rows for backend %s", b)
	}

	var doc struct {
		Run     runInfo  `json:"run"`
		Results []Result `json:"results"`
	}
	b, err := os.ReadFile(jsonPath)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &doc))
	assert.True(t, doc.Run.Check)
	assert.Equal(t, len(rows)-1, len(doc.Results))
	kinds := map[string]bool{}
	for _, r := range doc.Results {
		kinds[r.Kind+"/"+r.Name] = true
		if r.Kind == "goxfer" && r.Name == "tcp" {
			assert.NotEmpty(t, r.Baseline, "tcp rows have a baseline")
			assert.Positive(t, r.Ratio)
		}
	}
	for _, k := range []string{"baseline/" + baseMemcpy, "baseline/" + baseTCP1, "baseline/" + baseTCP4, "baseline/" + basePingPong, "control/nats-token"} {
		assert.True(t, kinds[k], "missing %s", k)
	}

	svg, err := os.ReadFile(svgPath)
	require.NoError(t, err)
	assert.Contains(t, string(svg), "<svg")
	assert.Contains(t, string(svg), "</svg>")

	// PNG from the same results, without measuring again.
	require.NoError(t, drawChart(pngPath, doc.Results, doc.Run))
	pf, err := os.Open(pngPath)
	require.NoError(t, err)
	defer pf.Close()
	cfg, err := png.DecodeConfig(pf)
	require.NoError(t, err)
	assert.Greater(t, cfg.Width, 100)
}

// TestPresetShapes checks the shapes of the presets: the KV hand-off and a
// model's prompt, each beside one region of the same bytes.
func TestPresetShapes(t *testing.T) {
	cfg, err := parseFlags([]string{"-preset", "kv"}, &bytes.Buffer{})
	require.NoError(t, err)
	require.Len(t, cfg.shapes, 2)
	assert.Equal(t, shape{Block: 64 << 10, Descs: 4096, Label: "KV hand-off"}, cfg.shapes[1])
	assert.Equal(t, cfg.shapes[0].bytes(), cfg.shapes[1].bytes())

	cfg, err = parseFlags([]string{"-preset", "model", "-model", "llama3-8b", "-tokens", "2048"}, &bytes.Buffer{})
	require.NoError(t, err)
	assert.Equal(t, 64<<10, cfg.shapes[1].Block)
	assert.Equal(t, 4096, cfg.shapes[1].Descs)
}

// TestManyDescriptors moves 1024 descriptors per operation, every byte
// checked, the way a KV hand-off does.
func TestManyDescriptors(t *testing.T) {
	code, stdout, stderr := bench(t, "-backends", "tcp", "-ops", "read,write", "-blocks", "4K", "-descs", "1024", "-iters", "3", "-warmup", "1",
		"-check", "-baselines=false", "-control=false", "-ucx", "off", "-progress", "off")
	require.Equal(t, 0, code, "stderr:\n%s", stderr)
	assert.Contains(t, stdout, "1024")
}

func TestBadInput(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"unknown backend", []string{"-backends", "tcp,foo"}, 2, `unknown backend "foo": built backends are ` + strings.Join(builtNames(), ", ")},
		{"unbuilt backend", []string{"-backends", "ucx"}, 2, `backend "ucx" is not built into this binary (ucx needs cgo and -tags ucx): built backends are ` + strings.Join(builtNames(), ", ")},
		{"too large", []string{"-blocks", "64M", "-descs", "1000000", "-inflight", "4"}, 2, "does not fit in memory: MemAvailable is"},
		{"bad size", []string{"-blocks", "4Q"}, 2, `block size "4Q"`},
		{"bad output", []string{"-o", "results.txt"}, 2, "want a .csv or .json file"},
		{"bad chart", []string{"-chart", "bw.pdf"}, 2, "want a .svg or .png file"},
		{"bad role", []string{"-role", "observer"}, 2, "want both, initiator or target"},
		{"target without server", []string{"-role", "target"}, 1, "-role target needs -nats URL"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "too large" && memAvailable() == 0 {
				t.Skip("MemAvailable unknown here")
			}
			if tc.name == "unbuilt backend" && slices.Contains(builtNames(), "ucx") {
				t.Skip("ucx is built in")
			}
			code, _, stderr := bench(t, tc.args...)
			assert.Equal(t, tc.code, code)
			assert.Contains(t, stderr, tc.want)
		})
	}
}

// TestTargetNeverShowsUp: an initiator whose target never joins fails with
// a timeout error naming the subject, instead of hanging.
func TestTargetNeverShowsUp(t *testing.T) {
	start := time.Now()
	code, _, stderr := bench(t, "-role", "initiator", "-backends", "tcp", "-timeout", "1s", "-session", "nobody", "-ucx", "off")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "timeout: the target did not show up within 1s")
	assert.Contains(t, stderr, `"goxfer.bench.nobody.proc.hello"`)
	assert.Less(t, time.Since(start), 15*time.Second)
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int{"4096": 4096, "4K": 4 << 10, "4KiB": 4 << 10, "64k": 64 << 10, "1M": 1 << 20, "64MiB": 64 << 20, "1G": 1 << 30, "1.5K": 1536} {
		got, err := parseSize(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "K", "0", "-4K", "1.3", "4X"} {
		_, err := parseSize(in)
		assert.Error(t, err, in)
	}
	bs, err := parseBlocks("4K-64M", 4)
	require.NoError(t, err)
	assert.Equal(t, []int{4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20}, bs)
}

func TestPattern(t *testing.T) {
	for _, n := range []int{1, 7, 8, 4096, 4099} {
		buf := make([]byte, n)
		fill(buf, 42)
		require.NoError(t, verify(buf, 42))
		assert.Error(t, verify(buf, 43), "another seed")
		buf[n-1] ^= 1
		err := verify(buf, 42)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "byte "+strconv.Itoa(n-1))
	}
}

func TestParsePerftest(t *testing.T) {
	out := []byte("iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n" +
		"[thread 0] 945,1145.356,1056.324,1056.324,59.17,59.17,947,947\n" +
		"1000,1147.394,1195.656,1063.987,52.27,58.74,836,940\n")
	r, err := parsePerftest(out, ucxRun{op: dirRead, tls: "tcp,self", size: 65536, iters: 1000})
	require.NoError(t, err)
	assert.Equal(t, 1000, r.Iters)
	assert.InDelta(t, 1147.394, r.P50, 1e-9)
	assert.InDelta(t, 58.74*1048576/1e9, r.GBps, 1e-9)
	assert.InDelta(t, 940, r.OpsPerSec, 1e-9)
	_, err = parsePerftest([]byte("[1700000000.1] ucp_worker.c: no transport\n"), ucxRun{})
	assert.Error(t, err)
}

func TestDirection(t *testing.T) {
	for in, want := range map[string]direction{"read": dirRead, " WRITE": dirWrite, "Read": dirRead} {
		d, err := parseDirection(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, d, in)
	}
	_, err := parseDirection("copy")
	assert.ErrorContains(t, err, `unknown operation "copy"`)
	assert.Equal(t, "READ", dirRead.String())
	assert.Equal(t, "WRITE", dirWrite.String())

	// The protocol's "op" stays the string a target of another build expects.
	b, err := json.Marshal(roundReq{Op: dirWrite})
	require.NoError(t, err)
	assert.Contains(t, string(b), `"op":"WRITE"`)
	var req roundReq
	require.NoError(t, json.Unmarshal([]byte(`{"op":"READ"}`), &req))
	assert.Equal(t, dirRead, req.Op)
	assert.Error(t, json.Unmarshal([]byte(`{"op":"COPY"}`), &req))
	_, err = json.Marshal(roundReq{})
	assert.Error(t, err, "no direction")
}
