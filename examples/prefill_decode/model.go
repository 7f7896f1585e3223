package main

import (
	"fmt"
	"math"
)

// Model is the shape of a transformer's KV cache, which fixes how a prompt's
// cache is cut into blocks. Both workers must agree on it: the decode
// worker checks the prefill worker's Model before its first request.
//
// A block holds one layer's keys (K) or values (V) for BlockTokens tokens of
// one sequence, every KV head: BlockTokens × KVHeads × HeadDim elements of
// DType. This is the paged layout of vLLM and Dynamo, where a KV hand-off
// moves a list of such blocks rather than one contiguous tensor.
type Model struct {
	Layers      int    `json:"layers"`
	KVHeads     int    `json:"kv_heads"`
	HeadDim     int    `json:"head_dim"`
	BlockTokens int    `json:"block_tokens"`
	DType       string `json:"dtype"`
}

// llama3_8B is the default Model: Llama-3-8B's attention (32 layers, 8 KV
// heads of 128 dimensions, grouped-query attention) in fp16, in blocks of 16
// tokens, so one block is 16 × 8 × 128 × 2 bytes = 32 KiB.
var llama3_8B = Model{Layers: 32, KVHeads: 8, HeadDim: 128, BlockTokens: 16, DType: "fp16"}

// dtypeSizes are the bytes per element of the supported element types.
var dtypeSizes = map[string]int{"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}

// Limits that keep a request, which is remote input to the prefill worker,
// from asking for absurd amounts of memory.
const (
	maxBlockBytes   = 64 << 20
	maxPromptTokens = 1 << 20
)

// Validate reports a Model no worker can serve.
func (m Model) Validate() error {
	if _, ok := dtypeSizes[m.DType]; !ok {
		return fmt.Errorf("dtype %q: want fp32, fp16, bf16 or fp8", m.DType)
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"layers", m.Layers}, {"kv-heads", m.KVHeads}, {"head-dim", m.HeadDim}, {"block-tokens", m.BlockTokens}} {
		if f.v < 1 || f.v > math.MaxInt32 {
			return fmt.Errorf("%s: want a positive count, found %d", f.name, f.v)
		}
	}
	if n := float64(m.BlockTokens) * float64(m.KVHeads) * float64(m.HeadDim) * float64(dtypeSizes[m.DType]); n > maxBlockBytes {
		return fmt.Errorf("a block of %d tokens × %d KV heads × %d dims × %s is %.0f bytes: want at most %d",
			m.BlockTokens, m.KVHeads, m.HeadDim, m.DType, n, maxBlockBytes)
	}
	return nil
}

// BlockBytes is the size of one block.
func (m Model) BlockBytes() int {
	return m.BlockTokens * m.KVHeads * m.HeadDim * dtypeSizes[m.DType]
}

// String describes the model in one line.
func (m Model) String() string {
	return fmt.Sprintf("%d layers × %d KV heads × %d dims, %s, %d tokens a block (%s a block)",
		m.Layers, m.KVHeads, m.HeadDim, m.DType, m.BlockTokens, sizeString(int64(m.BlockBytes())))
}

// Layout is where a prompt's KV cache lives: for every layer, its K blocks
// then its V blocks, BlocksPerSeq of each. Descriptor i of a hand-off is
// block Locate(i); both workers list blocks in this order, so the
// descriptors of the prefill worker's token line up with the decode
// worker's, index by index.
type Layout struct {
	Model
	PromptTokens int
	BlocksPerSeq int // blocks one layer's K (or V) takes: ceil(PromptTokens / BlockTokens)
}

// LayoutFor returns the layout of a prompt of promptTokens tokens, or an
// error if the prompt is out of bounds.
func (m Model) LayoutFor(promptTokens int) (Layout, error) {
	if promptTokens < 1 || promptTokens > maxPromptTokens {
		return Layout{}, fmt.Errorf("prompt of %d tokens: want 1 to %d", promptTokens, maxPromptTokens)
	}
	return Layout{Model: m, PromptTokens: promptTokens, BlocksPerSeq: (promptTokens + m.BlockTokens - 1) / m.BlockTokens}, nil
}

// Blocks is how many blocks, and so descriptors, the prompt's KV cache
// takes: K and V for every layer.
func (l Layout) Blocks() int { return l.Layers * 2 * l.BlocksPerSeq }

// Bytes is the size of the prompt's KV cache.
func (l Layout) Bytes() int64 { return int64(l.Blocks()) * int64(l.BlockBytes()) }

// BlockID names one block of a prompt's KV cache.
type BlockID struct {
	Layer int
	V     bool // the values; else the keys
	Block int  // index within the layer's K or V, from the prompt's start
}

// Locate returns which block descriptor i holds.
func (l Layout) Locate(i int) BlockID {
	seq := i / l.BlocksPerSeq
	return BlockID{Layer: seq / 2, V: seq%2 == 1, Block: i % l.BlocksPerSeq}
}

// String names the block as "layer 3 V block 7".
func (b BlockID) String() string {
	kv := "K"
	if b.V {
		kv = "V"
	}
	return fmt.Sprintf("layer %d %s block %d", b.Layer, kv, b.Block)
}

// sizeString formats a byte count in binary units: "32 KiB", "64.0 MiB".
func sizeString(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
