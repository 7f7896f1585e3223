package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/connect"
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

// benchChild runs the command as a child process (this test binary acting
// as main) with env added to the environment: the device driver is chosen
// once per process (devmem.Default), so every choice gets its own.
func benchChild(t *testing.T, env []string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], args...)
	cmd.Env = append(os.Environ(), asMainEnv+"=1")
	cmd.Env = append(cmd.Env, env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		t.Fatalf("run %v: %v", args, err)
	}
	return code, out.String(), errb.String()
}

func readResults(t *testing.T, path string) (runInfo, []Result) {
	t.Helper()
	var doc struct {
		Run     runInfo  `json:"run"`
		Results []Result `json:"results"`
	}
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &doc))
	return doc.Run, doc.Results
}

// TestGPUMemory runs -initiator-mem and -target-mem on the simulated device
// (GOXFER_DEVICE=sim in the child's environment), with VRAM on either side
// and both, every byte checked: each VRAM row reports its path, is labelled
// simulated, and carries its ratios to the DRAM row and the pinned copies
// measured in the same run.
func TestGPUMemory(t *testing.T) {
	for _, tc := range []struct{ init, target string }{{"vram", "dram"}, {"dram", "vram"}, {"vram", "vram"}} {
		t.Run(tc.init+"/"+tc.target, func(t *testing.T) {
			jsonPath, csvPath := filepath.Join(t.TempDir(), "r.json"), filepath.Join(t.TempDir(), "r.csv")
			code, stdout, stderr := benchChild(t, []string{"GOXFER_DEVICE=sim"}, "-backends", "tcp,mem", "-blocks", "4K,1M", "-descs", "1,3",
				"-inflight", "1,2", "-iters", "4", "-warmup", "1", "-check", "-ucx", "off", "-control=false", "-latency-iters", "20",
				"-progress", "off", "-initiator-mem", tc.init, "-target-mem", tc.target, "-o", jsonPath+","+csvPath, "-timeout", "20s")
			require.Equal(t, 0, code, "stderr:\n%s", stderr)
			assert.Contains(t, stdout, "SIMULATED GPU")
			assert.Contains(t, stdout, "ratios from this run")

			run, rs := readResults(t, jsonPath)
			assert.Equal(t, "sim", run.Device)
			assert.Equal(t, tc.init, run.InitiatorMem)
			assert.Equal(t, tc.target, run.TargetMem)
			copies := map[string]bool{}
			vramRows, dramRows := 0, 0
			for _, r := range rs {
				if r.Kind == "baseline" && r.Name == baseCopy {
					copies[r.Op+" "+strconv.FormatInt(r.Bytes, 10)] = true
					assert.Equal(t, "sim", r.Device)
					assert.Positive(t, r.GBps)
				}
				if r.Kind != "goxfer" {
					continue
				}
				// Every byte of the 5 operations (1 warm-up): READ checked at
				// the initiator, WRITE at the target.
				assert.Contains(t, r.Note, fmt.Sprintf("checked %s", fmtSize(float64(5*r.Bytes))), r)
				if r.InitiatorMem == "dram" && r.TargetMem == "dram" {
					dramRows++
					assert.Equal(t, r.Name, r.Path, "a DRAM row moves its bytes directly")
					assert.Empty(t, r.Device)
					continue
				}
				vramRows++
				assert.Equal(t, tc.init, r.InitiatorMem)
				assert.Equal(t, tc.target, r.TargetMem)
				assert.Equal(t, r.Name+"+staging", r.Path, r)
				assert.Equal(t, "sim", r.Device)
				assert.Contains(t, r.Note, "SIMULATED GPU")
				assert.Positive(t, r.DRAMRatio, "ratio to the DRAM row: %+v", r)
				assert.InDelta(t, r.GBps/r.DRAMGBps, r.DRAMRatio, 1e-9)
				assert.Equal(t, min(int(r.Bytes), 4<<20), r.StageChunk)
				// Which side stages what: READ lands in the initiator (H2D)
				// from the target (D2H); WRITE the other way round.
				d2h := tc.target == "vram" && r.Op == "READ" || tc.init == "vram" && r.Op == "WRITE"
				h2d := tc.init == "vram" && r.Op == "READ" || tc.target == "vram" && r.Op == "WRITE"
				if d2h {
					assert.Positive(t, r.StageD2HRatio, "D2H staging over pinned copies: %+v", r)
				} else {
					assert.Zero(t, r.StageD2HGBps, r)
				}
				if h2d {
					assert.Positive(t, r.StageH2DRatio, "H2D staging over pinned copies: %+v", r)
				} else {
					assert.Zero(t, r.StageH2DGBps, r)
				}
				if r.Descs > 1 {
					assert.Zero(t, r.OneRegionRatio, "no row of one descriptor has the same bytes here")
				}
			}
			// 2 backends × 2 operations × 2 blocks × 2 descriptor counts × 2 depths
			assert.Equal(t, 32, vramRows)
			assert.Equal(t, 32, dramRows)
			for _, n := range []int{4 << 10, 12 << 10, 1 << 20, 3 << 20} {
				for _, op := range []string{"D2H", "H2D"} {
					assert.True(t, copies[op+" "+strconv.Itoa(n)], "pinned %s baseline of %d bytes", op, n)
				}
			}

			f, err := os.Open(csvPath)
			require.NoError(t, err)
			defer f.Close()
			rows, err := csv.NewReader(f).ReadAll()
			require.NoError(t, err)
			require.Equal(t, csvHeader, rows[0])
			assert.Len(t, rows, len(rs)+1)
		})
	}
}

// TestDeviceIPC runs cma with GPU memory on the simulated device, every
// byte checked: GPU memory of the target (either side's memory the
// initiator's) moves by cma's same-host device path, "cma+ipc", each row
// beside the in-process cuMemcpy of the copy it makes, of the same bytes,
// and the meter sees that copy; the initiator's GPU memory facing the
// target's host memory is staged, and so is everything with -device-ipc=false.
func TestDeviceIPC(t *testing.T) {
	for _, tc := range []struct {
		init, target string
		ipc          bool
		path         string
	}{
		{"vram", "vram", true, "cma+ipc"},
		{"dram", "vram", true, "cma+ipc"},
		{"vram", "dram", true, "cma+staging"},
		{"vram", "vram", false, "cma+staging"},
	} {
		t.Run(fmt.Sprintf("%s/%s ipc=%v", tc.init, tc.target, tc.ipc), func(t *testing.T) {
			jsonPath := filepath.Join(t.TempDir(), "r.json")
			code, stdout, stderr := benchChild(t, []string{"GOXFER_DEVICE=sim"}, "-backends", "cma", "-blocks", "4K,1M", "-descs", "1,3",
				"-inflight", "1,2", "-iters", "4", "-warmup", "1", "-check", "-ucx", "off", "-control=false", "-latency-iters", "20",
				"-progress", "off", "-initiator-mem", tc.init, "-target-mem", tc.target, "-device-ipc="+strconv.FormatBool(tc.ipc),
				"-o", jsonPath, "-timeout", "20s")
			require.Equal(t, 0, code, "stderr:\n%s", stderr)
			assert.Contains(t, stdout, "SIMULATED GPU")
			assert.Equal(t, tc.path == "cma+ipc", strings.Contains(stdout, "path cma+ipc:"), "the table explains cma+ipc where it has such rows")

			run, rs := readResults(t, jsonPath)
			assert.Equal(t, "sim", run.Device)
			assert.Equal(t, map[bool]string{true: "on", false: "off"}[tc.ipc], run.DeviceIPC)
			copies := map[string]bool{}
			for _, r := range rs {
				if r.Kind == "baseline" && r.Name == baseCopy {
					copies[r.Op+" "+strconv.FormatInt(r.Bytes, 10)] = true
					assert.Positive(t, r.GBps, r)
				}
			}
			bothVRAM := tc.init == "vram" && tc.target == "vram"
			for _, n := range []int{4 << 10, 12 << 10, 1 << 20, 3 << 20} {
				for _, op := range []string{"D2H", "H2D", "D2D"} {
					assert.Equal(t, op != "D2D" || bothVRAM, copies[op+" "+strconv.Itoa(n)], "cuMemcpy %s of %d bytes", op, n)
				}
			}
			vramRows := 0
			for _, r := range rs {
				if r.Kind != "goxfer" {
					continue
				}
				assert.True(t, r.Checked, r)
				assert.Contains(t, r.Note, fmt.Sprintf("checked %s", fmtSize(float64(5*r.Bytes))), "every byte of the 5 operations: %+v", r)
				if r.InitiatorMem == "dram" && r.TargetMem == "dram" {
					assert.Equal(t, heapPath(r), r.Path, r)
					continue
				}
				vramRows++
				assert.Equal(t, tc.path, r.Path, r)
				assert.Contains(t, r.Note, "SIMULATED GPU")
				assert.Positive(t, r.DRAMRatio, r)
				if tc.path == "cma+staging" {
					assert.Equal(t, basePVM, r.Baseline, "a staged row keeps cma's baseline: %+v", r)
					assert.Zero(t, r.StageD2DGBps, "staging copies no device to device: %+v", r)
					assert.Contains(t, r.Note, "staged ")
					assert.Equal(t, min(int(r.Bytes), 4<<20), r.StageChunk)
					continue
				}
				// The copy the IPC path makes, from the exposing side's memory
				// to the copier's: READ target to initiator, WRITE the other way.
				want := map[string]string{"vram/vram": "D2D", "dram/vram READ": "D2H", "dram/vram WRITE": "H2D"}
				op := want[tc.init+"/"+tc.target]
				if op == "" {
					op = want[tc.init+"/"+tc.target+" "+r.Op]
				}
				require.NotEmpty(t, op)
				assert.Equal(t, op, deviceCopy(r))
				assert.Equal(t, baseCopy+" "+op, r.Baseline, r)
				assert.Positive(t, r.BaseGBps, r)
				assert.InDelta(t, r.GBps/r.BaseGBps, r.Ratio, 1e-9)
				assert.Contains(t, r.Note, "copied "+op+" ", "the meter saw the IPC copies: %+v", r)
				assert.Equal(t, int(r.Bytes), r.StageChunk, "one device window holds the whole operation")
				stage := map[string]float64{"D2H": r.StageD2HRatio, "H2D": r.StageH2DRatio, "D2D": r.StageD2DRatio}
				for dir, ratio := range stage {
					if dir == op {
						assert.Positive(t, ratio, "%s copies over cuMemcpy %s: %+v", dir, dir, r)
					} else {
						assert.Zero(t, ratio, "no %s copies: %+v", dir, r)
					}
				}
			}
			// 2 operations × 2 blocks × 2 descriptor counts × 2 depths
			assert.Equal(t, 16, vramRows)
		})
	}
}

// TestKVShapeVRAM: the KV hand-off shape against one region of the same
// bytes, both in simulated GPU memory, gives the ratio of the two.
func TestKVShapeVRAM(t *testing.T) {
	jsonPath := filepath.Join(t.TempDir(), "r.json")
	code, _, stderr := benchChild(t, []string{"GOXFER_DEVICE=sim"}, "-backends", "tcp", "-shapes", "4Mx1,64Kx64", "-ops", "read",
		"-iters", "4", "-warmup", "1", "-check", "-ucx", "off", "-control=false", "-baselines=false", "-progress", "off",
		"-initiator-mem", "vram", "-target-mem", "vram", "-o", jsonPath)
	require.Equal(t, 0, code, "stderr:\n%s", stderr)
	_, rs := readResults(t, jsonPath)
	var kv []Result
	for _, r := range rs {
		if r.Kind == "goxfer" && r.Descs == 64 {
			kv = append(kv, r)
		}
	}
	require.Len(t, kv, 2, "dram/dram and vram/vram")
	for _, r := range kv {
		assert.Positive(t, r.OneRegionRatio, r)
		assert.InDelta(t, r.GBps/r.OneRegionGBps, r.OneRegionRatio, 1e-9)
	}
}

// TestSharedMemory runs cma with shared host memory (shm.Alloc) on either
// side and both, every byte checked: where the target's exposed memory is
// shared, the initiator maps it and copies with memmove ("cma+shm"), each
// row beside Go copy of the same bytes and the same backend's Go heap row;
// the initiator's shared memory facing the target's Go heap takes cma's
// system calls. Points of 4 KiB one at a time run interleaved with the
// 4 KiB TCP ping-pong and carry the ratios to it.
func TestSharedMemory(t *testing.T) {
	for _, tc := range []struct{ init, target, path string }{
		{"shm", "shm", "cma+shm"},
		{"dram", "shm", "cma+shm"},
		{"shm", "dram", "cma"},
	} {
		t.Run(tc.init+"/"+tc.target, func(t *testing.T) {
			jsonPath := filepath.Join(t.TempDir(), "r.json")
			code, stdout, stderr := bench(t, "-backends", "cma", "-blocks", "4K,1M", "-descs", "1,3", "-inflight", "1,2",
				"-iters", "4", "-warmup", "1", "-check", "-ucx", "off", "-control=false", "-latency-iters", "20",
				"-progress", "off", "-initiator-mem", tc.init, "-target-mem", tc.target, "-o", jsonPath, "-timeout", "20s")
			require.Equal(t, 0, code, "stderr:\n%s", stderr)
			assert.Equal(t, tc.path == "cma+shm", strings.Contains(stdout, "path cma+shm:"), "the table explains cma+shm where it has such rows")
			assert.Contains(t, stdout, "against the raw 4 KiB TCP ping-pong")

			run, rs := readResults(t, jsonPath)
			assert.Equal(t, tc.init, run.InitiatorMem)
			assert.Equal(t, tc.target, run.TargetMem)
			assert.Empty(t, run.Device, "no GPU involved")
			shmRows, dramRows := 0, 0
			for _, r := range rs {
				if r.Kind != "goxfer" {
					continue
				}
				assert.True(t, r.Checked, r)
				assert.Contains(t, r.Note, fmt.Sprintf("checked %s", fmtSize(float64(5*r.Bytes))), "every byte of the 5 operations: %+v", r)
				if r.Bytes <= interleaveMax && r.Inflight == 1 {
					// 4 measured operations: batches of 1, 4 pairs.
					assert.Equal(t, 4, r.PingPairs, r)
					assert.Positive(t, r.PingP50, r)
					assert.Positive(t, r.PingRatio, r)
					assert.Positive(t, r.DonePingRatio, "the target runs on this host: %+v", r)
				} else {
					assert.Zero(t, r.PingPairs, "only small points one at a time are interleaved: %+v", r)
				}
				if r.InitiatorMem == "dram" && r.TargetMem == "dram" {
					dramRows++
					assert.Equal(t, heapPath(r), r.Path, "Go heap memory keeps cma's system calls: %+v", r)
					assert.Equal(t, basePVM, r.Baseline)
					continue
				}
				shmRows++
				assert.Equal(t, tc.init, r.InitiatorMem)
				assert.Equal(t, tc.target, r.TargetMem)
				if tc.target == "dram" {
					assert.Equal(t, heapPath(r), r.Path, r)
				} else {
					assert.Equal(t, tc.path, r.Path, r)
				}
				assert.Empty(t, r.Device)
				assert.Positive(t, r.DRAMRatio, "ratio to the Go heap row: %+v", r)
				assert.InDelta(t, r.GBps/r.DRAMGBps, r.DRAMRatio, 1e-9)
				want := basePVM
				if tc.path == "cma+shm" {
					want = baseMemcpy // the copy is a memmove in the initiator
				}
				assert.Equal(t, want, r.Baseline, r)
				assert.InDelta(t, r.GBps/r.BaseGBps, r.Ratio, 1e-9)
			}
			// 2 operations × 2 blocks × 2 descriptor counts × 2 depths
			assert.Equal(t, 16, shmRows)
			assert.Equal(t, 16, dramRows)
		})
	}
}

// TestPingRatios: each pair of batches gives its own ratio of p50s, and the
// row the median of them; "done" only where every operation has one.
func TestPingRatios(t *testing.T) {
	us := func(vs ...int) []time.Duration {
		out := make([]time.Duration, len(vs))
		for i, v := range vs {
			out[i] = time.Duration(v) * time.Microsecond
		}
		return out
	}
	batches := []pingBatch{
		{lo: 0, hi: 3, pings: us(10, 10, 10)},    // p50 20 over 10: 2
		{lo: 3, hi: 6, pings: us(100, 100, 100)}, // the ping-pong slowed: 40 over 100: 0.4
		{lo: 6, hi: 9, pings: us(20, 20, 20)},    // 20 over 20: 1
	}
	lat := us(10, 20, 30, 40, 40, 40, 10, 20, 30)
	done := us(20, 40, 60, 80, 80, 80, 20, 40, 60)
	var r Result
	setPingRatios(&r, batches, lat, done)
	assert.Equal(t, 3, r.PingPairs)
	assert.InDelta(t, 1.0, r.PingRatio, 1e-12, "the median of 2, 0.4 and 1")
	assert.InDelta(t, 2.0, r.DonePingRatio, 1e-12, "the median of 4, 0.8 and 2")
	assert.InDelta(t, 20.0, r.PingP50, 1e-12)

	done[4] = 0 // one passive Wait did not return
	r = Result{}
	setPingRatios(&r, batches, lat, done)
	assert.InDelta(t, 1.0, r.PingRatio, 1e-12)
	assert.Zero(t, r.DonePingRatio, "not every pair has a done figure")
	r = Result{}
	setPingRatios(&r, nil, lat, done)
	assert.Zero(t, r.PingPairs)
}

// TestVRAMWithoutDriver: asking for GPU memory where no driver can be had
// fails before anything starts, saying what is missing.
func TestVRAMWithoutDriver(t *testing.T) {
	code, _, stderr := benchChild(t, []string{"GOXFER_DEVICE=bogus"}, "-backends", "tcp", "-blocks", "4K", "-ucx", "off", "-target-mem", "vram")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, `GPU memory needs a device driver: devmem: GOXFER_DEVICE="bogus"`)
	assert.NotContains(t, stderr, "panic")

	if d := devmem.CUDA(); d != nil {
		if n, err := d.Devices(); err == nil && n > 0 {
			t.Skip("a CUDA driver with GPUs is here")
		}
	}
	code, _, stderr = benchChild(t, []string{"GOXFER_DEVICE="}, "-backends", "tcp", "-blocks", "4K", "-ucx", "off", "-initiator-mem", "vram")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "GPU memory needs a device driver")
	assert.Contains(t, stderr, "set GOXFER_DEVICE=sim")
	assert.NotContains(t, stderr, "panic")

	code, _, stderr = benchChild(t, []string{"GOXFER_DEVICE=sim"}, "-backends", "tcp", "-blocks", "4K", "-ucx", "off", "-target-mem", "vram", "-gpu", "7")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "-gpu 7: the sim driver sees 2 GPU(s)")
}

// TestRegion fills, checks and poisons simulated GPU memory through its
// copies: every byte is compared, and a wrong byte past the first piece is
// named by its offset.
func TestRegion(t *testing.T) {
	sim := devmem.NewSim(1)
	size := scratchMax + 13
	r, err := newRegion(memVRAM, sim, 0, size, nil)
	require.NoError(t, err)
	defer func() { require.NoError(t, r.release()) }()
	require.NoError(t, r.fill(7))
	require.NoError(t, r.verify(7))
	assert.ErrorContains(t, r.verify(8), "byte 0:")

	// Flip one byte in the tail, beyond the first piece.
	off := scratchMax + 11
	b := make([]byte, 1)
	require.NoError(t, devmem.CopyToHost(sim, 0, b, r.ptr+uintptr(off)))
	b[0] ^= 0x40
	require.NoError(t, devmem.CopyToDevice(sim, 0, r.ptr+uintptr(off), b))
	assert.ErrorContains(t, r.verify(7), fmt.Sprintf("byte %d:", off))

	require.NoError(t, r.poison())
	assert.ErrorContains(t, r.verify(7), "byte 0:")
	host := make([]byte, size)
	require.NoError(t, devmem.CopyToHost(sim, 0, host, r.ptr))
	assert.Equal(t, bytes.Repeat([]byte{0xA5}, size), host, "poison reaches every byte")

	ds := r.descriptors(1<<20, 4)
	require.Len(t, ds, 4)
	assert.Equal(t, connect.CUDA(0), ds[3].Device())
	assert.Nil(t, ds[3].Bytes(), "GPU memory has no host bytes")
	assert.Zero(t, r.addr())
}

// TestMeter: the metered driver counts each batch of copies up to its Sync,
// by direction.
func TestMeter(t *testing.T) {
	sim := devmem.NewSim(1)
	var m meter
	d := meteredDriver{Driver: sim, m: &m}
	p, err := sim.Alloc(0, 1<<20)
	require.NoError(t, err)
	defer func() { require.NoError(t, sim.Free(p)) }()
	st, err := d.NewStream(0)
	require.NoError(t, err)
	host := make([]byte, 1<<20)
	require.NoError(t, st.ToHost(host[:4096], p))
	require.NoError(t, st.ToHost(host[4096:8192], p))
	require.NoError(t, st.Sync())
	require.NoError(t, st.Sync(), "an empty batch counts nothing")
	require.NoError(t, st.ToDevice(p, host))
	require.NoError(t, st.ToHost(host[:1<<19], p))
	require.NoError(t, st.Close())
	s := m.read()
	assert.Equal(t, int64(8192+1<<19), s.D2H.Bytes)
	assert.Equal(t, int64(2), s.D2H.Batches)
	assert.Equal(t, int64(1<<20), s.H2D.Bytes)
	assert.Equal(t, int64(1), s.H2D.Batches)
	assert.Positive(t, s.D2H.Ns)
	assert.Positive(t, s.H2D.Ns)
	assert.Positive(t, s.D2H.gbps())
	assert.Zero(t, s.D2D, "no device-to-device copy yet")

	// Device to device (cma's same-host device path), through the driver
	// the connectors get: it stays a Sharer, or cma would stage.
	md := metered(sim, &m)
	_, ok := md.(devmem.Sharer)
	require.True(t, ok, "the metered simulator still shares memory")
	assert.True(t, md == metered(sim, &m), "equal drivers for one meter: cma's mapping cache is keyed by driver")
	_, ok = metered(meteredDriver{Driver: sim}, &m).(devmem.Sharer)
	assert.False(t, ok, "a driver that cannot share is not made one")
	q, err := sim.Alloc(0, 1<<20)
	require.NoError(t, err)
	defer func() { require.NoError(t, sim.Free(q)) }()
	fill(host, 3)
	require.NoError(t, devmem.CopyToDevice(sim, 0, p, host))
	st, err = md.NewStream(0)
	require.NoError(t, err)
	require.NoError(t, st.Copy(q, p, 1<<19))
	require.NoError(t, st.Copy(q+1<<19, p+1<<19, 1<<19))
	require.NoError(t, st.Sync())
	require.NoError(t, st.Close())
	got := make([]byte, 1<<20)
	require.NoError(t, devmem.CopyToHost(sim, 0, got, q))
	require.NoError(t, verify(got, 3), "the metered copy moved every byte")
	s = m.read()
	assert.Equal(t, copyStat{1 << 20, s.D2D.Ns, 1}, s.D2D)
	assert.Positive(t, s.D2D.Ns)
	assert.Equal(t, int64(2), s.D2H.Batches, "the other directions are untouched")
}

// TestGPURatios: the ratios of a VRAM row come from the rows of the same
// run that match it.
func TestGPURatios(t *testing.T) {
	rs := []Result{
		{Kind: "goxfer", Name: "tcp", Op: "READ", Block: 64 << 20, Descs: 1, Bytes: 64 << 20, Inflight: 1, GBps: 4, InitiatorMem: "dram", TargetMem: "dram"},
		{Kind: "goxfer", Name: "tcp", Op: "READ", Block: 64 << 20, Descs: 1, Bytes: 64 << 20, Inflight: 1, GBps: 3.6, InitiatorMem: "vram", TargetMem: "vram",
			StageChunk: 4 << 20, StageD2HGBps: 9, StageH2DGBps: 10},
		{Kind: "goxfer", Name: "tcp", Op: "READ", Block: 16 << 10, Descs: 4096, Bytes: 64 << 20, Inflight: 1, GBps: 2.7, InitiatorMem: "vram", TargetMem: "vram"},
		{Kind: "goxfer", Name: "tcp", Op: "WRITE", Block: 64 << 20, Descs: 1, Bytes: 64 << 20, Inflight: 1, GBps: 1, InitiatorMem: "dram", TargetMem: "dram"},
		{Kind: "baseline", Name: baseCopy, Op: "D2H", Block: 4 << 20, Descs: 1, Bytes: 4 << 20, GBps: 10},
		{Kind: "baseline", Name: baseCopy, Op: "H2D", Block: 4 << 20, Descs: 1, Bytes: 4 << 20, GBps: 20},
		{Kind: "baseline", Name: baseCopy, Op: "D2H", Block: 64 << 20, Descs: 1, Bytes: 64 << 20, GBps: 99},
	}
	ipc := []Result{
		{Kind: "goxfer", Name: "cma", Op: "READ", Block: 64 << 20, Descs: 1, Bytes: 64 << 20, Inflight: 1, GBps: 45, InitiatorMem: "vram", TargetMem: "vram",
			Path: "cma+ipc", StageChunk: 64 << 20, StageD2DGBps: 80},
		{Kind: "goxfer", Name: "cma", Op: "WRITE", Block: 64 << 20, Descs: 1, Bytes: 64 << 20, Inflight: 1, GBps: 9, InitiatorMem: "dram", TargetMem: "vram",
			Path: "cma+ipc", StageChunk: 64 << 20, StageH2DGBps: 18},
		{Kind: "goxfer", Name: "cma", Op: "READ", Block: 64 << 20, Descs: 1, Bytes: 64 << 20, Inflight: 1, GBps: 5, InitiatorMem: "vram", TargetMem: "vram",
			Path: "cma+staging"},
		{Kind: "baseline", Name: basePVM, Op: "READ", Block: 64 << 20, Descs: 1, Bytes: 64 << 20, GBps: 10},
		{Kind: "baseline", Name: baseCopy, Op: "D2D", Block: 64 << 20, Descs: 1, Bytes: 64 << 20, GBps: 50},
		{Kind: "baseline", Name: baseCopy, Op: "H2D", Block: 64 << 20, Descs: 1, Bytes: 64 << 20, GBps: 20},
	}
	rs = append(rs, ipc...)
	setRatios(rs)
	d2d, h2d, staged := rs[7], rs[8], rs[9]
	assert.Equal(t, baseCopy+" D2D", d2d.Baseline, "an IPC row between GPUs against a device-to-device copy")
	assert.InDelta(t, 0.9, d2d.Ratio, 1e-12)
	assert.InDelta(t, 1.6, d2d.StageD2DRatio, 1e-12)
	assert.Zero(t, d2d.CopyD2HGBps, "no D2H copies to compare")
	assert.Equal(t, baseCopy+" H2D", h2d.Baseline, "a WRITE from host memory into the peer's GPU memory")
	assert.InDelta(t, 0.45, h2d.Ratio, 1e-12)
	assert.InDelta(t, 0.9, h2d.StageH2DRatio, 1e-12)
	assert.Equal(t, basePVM, staged.Baseline, "a staged row keeps its backend's baseline")
	assert.InDelta(t, 0.5, staged.Ratio, 1e-12)
	v := rs[1]
	assert.InDelta(t, 4, v.DRAMGBps, 1e-12)
	assert.InDelta(t, 0.9, v.DRAMRatio, 1e-12)
	assert.InDelta(t, 10, v.CopyD2HGBps, 1e-12, "the copy of one staging chunk, not of the whole operation")
	assert.InDelta(t, 0.9, v.StageD2HRatio, 1e-12)
	assert.InDelta(t, 0.5, v.StageH2DRatio, 1e-12)
	kv := rs[2]
	assert.InDelta(t, 3.6, kv.OneRegionGBps, 1e-12, "one region in the same memory")
	assert.InDelta(t, 0.75, kv.OneRegionRatio, 1e-12)
	assert.Zero(t, kv.DRAMRatio, "no DRAM row of that shape")
	assert.Zero(t, rs[0].DRAMRatio, "a DRAM row has no DRAM ratio")
}

func TestGPUFlags(t *testing.T) {
	cfg, err := parseFlags([]string{"-shapes", "64Kx4096,256Mx1,1M", "-initiator-mem", "VRAM", "-gpu", "1", "-staging", "8M,128M"}, &bytes.Buffer{})
	require.NoError(t, err)
	assert.Equal(t, []shape{{Block: 64 << 10, Descs: 4096}, {Block: 256 << 20, Descs: 1}, {Block: 1 << 20, Descs: 1}}, cfg.shapes)
	assert.Equal(t, mems{memVRAM, memDRAM}, cfg.mem)
	assert.Equal(t, 1, cfg.gpu)
	assert.Equal(t, [2]int{8 << 20, 128 << 20}, [2]int{cfg.stageChunk, cfg.stagePool})
	assert.True(t, cfg.deviceIPC, "cma's device path is on by default")
	cfg, err = parseFlags([]string{"-initiator-mem", "vram", "-device-ipc=false"}, &bytes.Buffer{})
	require.NoError(t, err)
	assert.False(t, cfg.deviceIPC)

	b, err := json.Marshal(roundReq{Op: dirRead, Mem: memVRAM})
	require.NoError(t, err)
	assert.Contains(t, string(b), `"mem":"vram"`)
	b, err = json.Marshal(roundReq{Op: dirRead})
	require.NoError(t, err)
	assert.NotContains(t, string(b), `"mem"`, "DRAM rounds read as before")

	for _, tc := range []struct{ args []string }{
		{[]string{"-initiator-mem", "hbm"}},
		{[]string{"-target-mem", "gpu"}},
		{[]string{"-shapes", "64Kx0"}},
		{[]string{"-shapes", "64Kx4096", "-preset", "kv"}},
		{[]string{"-staging", "4M"}},
		{[]string{"-gpu", "-1"}},
	} {
		_, err := parseFlags(tc.args, &bytes.Buffer{})
		assert.Error(t, err, "%v", tc.args)
	}
	_, err = parseFlags([]string{"-initiator-mem", "hbm"}, &bytes.Buffer{})
	assert.ErrorContains(t, err, `-initiator-mem: unknown memory "hbm": want dram, vram or shm`)
	cfg, err = parseFlags([]string{"-initiator-mem", "shm", "-target-mem", "SHM"}, &bytes.Buffer{})
	require.NoError(t, err)
	assert.Equal(t, mems{memSHM, memSHM}, cfg.mem)
	assert.False(t, cfg.mem.vram())
	b, err = json.Marshal(roundReq{Op: dirRead, Mem: memSHM})
	require.NoError(t, err)
	assert.Contains(t, string(b), `"mem":"shm"`)
}

// heapPath is the path of a cma row whose target memory is on the Go heap
// (the initiator's on the heap or in shared memory):
// an operation of one descriptor of at most 1 MiB is copied inside cma's
// lease table without a lease round trip (cma+table), others under leases.
func heapPath(r Result) string {
	if r.Descs == 1 && r.Bytes <= 1<<20 {
		return "cma+table"
	}
	return "cma"
}

// TestTCPLatencyFlag: -tcp-latency turns on tcp's latency mode on both
// sides; a run with it moves every byte right, and says so in the table
// and the JSON. Out-of-range spins are refused.
func TestTCPLatencyFlag(t *testing.T) {
	cfg, err := parseFlags(nil, &bytes.Buffer{})
	require.NoError(t, err)
	assert.Zero(t, cfg.tcpSpin, "latency mode is off by default")
	for bad, msg := range map[string]string{"-1us": "-tcp-latency -1µs: want 0 (off) up to 10ms", "11ms": "-tcp-latency 11ms: want 0 (off) up to 10ms"} {
		_, err := parseFlags([]string{"-tcp-latency", bad}, &bytes.Buffer{})
		assert.EqualError(t, err, msg, bad)
	}

	jsonPath := filepath.Join(t.TempDir(), "r.json")
	code, stdout, stderr := benchChild(t, nil, "-backends", "tcp", "-blocks", "4K,1M", "-iters", "8", "-warmup", "1", "-check",
		"-ucx", "off", "-control=false", "-latency-iters", "20", "-progress", "off", "-tcp-latency", "20us", "-o", jsonPath, "-timeout", "20s")
	require.Equal(t, 0, code, "stderr:\n%s", stderr)
	assert.Contains(t, stdout, "tcp latency mode (-tcp-latency: readers poll this long after a frame before they block): 20µs\n")
	run, rs := readResults(t, jsonPath)
	assert.Equal(t, "20µs", run.TCPLatency, "the spawned target's hello says it is in latency mode too")
	n := 0
	for _, r := range rs {
		if r.Kind == "goxfer" {
			n++
			assert.Equal(t, "tcp", r.Path, r)
		}
	}
	assert.Equal(t, 4, n, "READ and WRITE of 4 KiB and 1 MiB")
}
