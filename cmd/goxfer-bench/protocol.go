package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/connect"
)

// The initiator drives the target with NATS requests on subjects under
// goxfer.bench.<session>.<target>: hello, round, tokens, finish, quit; the
// target answers each with JSON (tokens: binary). In check mode the target
// publishes one ack per verified WRITE on <round subject>.ack.
//
// A round is one measured point. The target allocates the point's buffers
// (one slot per operation in flight), fills them, creates one passive
// operation per iteration (fresh ones: a passive operation completes once),
// and hands the tokens out in pages before the initiator's clock starts. So
// the measured span holds only BeginRead/BeginWrite, the data path and the
// active Wait; what handing out a token per operation costs is measured on
// its own (the control rows).

func subject(session, target, verb string) string {
	return "goxfer.bench." + session + "." + target + "." + verb
}

// hello is the target's answer to "hello".
type hello struct {
	PID        int      `json:"pid"`
	BootID     string   `json:"boot_id"`
	Host       string   `json:"host"`
	Backends   []string `json:"backends"`
	Raw        string   `json:"raw"`  // raw TCP stream server
	Ping       string   `json:"ping"` // raw TCP ping-pong server
	GOMAXPROCS int      `json:"gomaxprocs"`
	MemAvail   uint64   `json:"mem_available"`
	Token1     string   `json:"token1"` // subject of the one-token-per-request service
	// TCPSpin is the target's -tcp-latency: its tcp readers' spin in
	// latency mode, 0 when off.
	TCPSpin time.Duration `json:"tcp_spin,omitempty"`
	// Device is the target's device driver ("cuda", "sim"), when the hello
	// asked about GPU memory; DeviceErr why it cannot allocate any.
	Device    string `json:"device,omitempty"`
	DeviceErr string `json:"device_err,omitempty"`
}

// helloReq is the initiator's "hello": with Device set, the target also
// checks that it can allocate GPU memory on GPU GPU.
type helloReq struct {
	Device bool `json:"device,omitempty"`
	GPU    int  `json:"gpu,omitempty"`
}

// roundReq asks the target to prepare one point.
type roundReq struct {
	ID       uint64    `json:"id"`
	Op       direction `json:"op"` // READ or WRITE, as text
	Block    int       `json:"block"`
	Descs    int       `json:"descs"`
	Slots    int       `json:"slots"`
	Ops      int       `json:"ops"` // passive operations to create; 0 for a baseline round
	Check    bool      `json:"check"`
	Seed     uint64    `json:"seed"`
	RawBuf   bool      `json:"raw_buf"`         // the raw TCP server serves from slot 0
	WaitMsec int64     `json:"wait_ms"`         // how long finish waits for passive completions
	Alloc    string    `json:"alloc,omitempty"` // the backend whose allocator holds the slots; "": Go heap
	Mem      memKind   `json:"mem,omitempty"`   // where the slots live: dram (omitted) or vram
	GPU      int       `json:"gpu,omitempty"`   // the GPU of vram slots
}

// roundReady is the target's answer to "round".
type roundReady struct {
	Tokens   int      `json:"tokens"`
	Pages    int      `json:"pages"`
	Slots    []uint64 `json:"slots"`         // slot addresses in the target, for process_vm_readv
	CreateNs int64    `json:"create_ns"`     // CreateReadable/Writable + Metadata, all operations
	TokenLen int      `json:"token_len"`     // binary token size of one operation
	Mem      memKind  `json:"mem,omitempty"` // where the slots are: a target that ignored roundReq.Mem says dram
	Err      string   `json:"err,omitempty"`
}

// finishReq ends a round.
type finishReq struct {
	ID uint64 `json:"id"`
}

// roundResult is the target's answer to "finish".
type roundResult struct {
	// Done holds, per operation, the target's CLOCK_MONOTONIC in ns when
	// the passive Wait returned (0: it did not).
	Done     []int64  `json:"done"`
	Failed   int      `json:"failed"`
	Errors   []string `json:"errors,omitempty"` // the first few
	Verified int64    `json:"verified"`         // bytes verified at the target (WRITE -check)
	// Stage is what the target's connector staged between GPU memory and
	// host memory during the round.
	Stage stageStats `json:"stage"`
	Err   string     `json:"err,omitempty"`
}

// ack reports one verified WRITE in check mode.
type ack struct {
	I   int    `json:"i"`
	Err string `json:"err,omitempty"`
}

// call sends a JSON request and decodes the JSON answer.
func call(ctx context.Context, nc *nats.Conn, subj string, req, resp any) error {
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	msg, err := nc.RequestWithContext(ctx, subj, b)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("request %s: no answer: %w", subj, err)
		}
		return fmt.Errorf("request %s: %w", subj, err)
	}
	if err := json.Unmarshal(msg.Data, resp); err != nil {
		return fmt.Errorf("request %s: bad answer: %w", subj, err)
	}
	return nil
}

// respond answers msg with v as JSON, best effort.
func respond(msg *nats.Msg, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		b, _ = json.Marshal(map[string]string{"err": err.Error()})
	}
	_ = msg.Respond(b)
}

// encodeTokens packs binary tokens into pages of at most max bytes each.
func encodeTokens(mds []connect.Metadata, max int) ([][]byte, error) {
	var pages [][]byte
	var cur []byte
	for i, md := range mds {
		b, err := md.MarshalBinary()
		if err != nil {
			return nil, err
		}
		need := binary.MaxVarintLen64 + len(b)
		if need > max {
			return nil, fmt.Errorf("token %d is %d bytes, more than the NATS max payload of %d: use fewer descriptors per operation or a server with a larger max_payload", i, len(b), max)
		}
		if len(cur)+need > max {
			pages = append(pages, cur)
			cur = nil
		}
		cur = binary.AppendUvarint(cur, uint64(len(b)))
		cur = append(cur, b...)
	}
	if len(cur) > 0 {
		pages = append(pages, cur)
	}
	return pages, nil
}

// decodeTokens appends the tokens of one page to mds.
func decodeTokens(page []byte, mds []connect.Metadata) ([]connect.Metadata, error) {
	for len(page) > 0 {
		n, k := binary.Uvarint(page)
		if k <= 0 || n > uint64(len(page)-k) {
			return mds, fmt.Errorf("%w: bad token page", connect.ErrInvalidMetadata)
		}
		var md connect.Metadata
		if err := md.UnmarshalBinary(page[k : k+int(n)]); err != nil {
			return mds, err
		}
		mds = append(mds, md)
		page = page[k+int(n):]
	}
	return mds, nil
}

func millis(d time.Duration) int64 { return d.Milliseconds() }
