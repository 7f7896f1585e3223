// Command goxfer-bench measures goxfer's backends the way NIXL's nixlbench
// measures NIXL's, with the baselines that bound them measured in the same
// run: raw TCP over 1 and 4 connections and a 4 KiB TCP ping-pong, Go copy,
// raw process_vm_readv/writev between the two processes, and UCX's own
// ucx_perftest when it is installed.
//
// The initiator and the target are separate processes (the target is this
// binary re-executed with -role target), coordinated over NATS: an embedded
// server by default, or -nats URL. Backends that reach only their own
// process (mem) run their target inside the initiator's process, and say
// so. Across two hosts, start the target on one and the initiator on the
// other with the same -nats and -session:
//
//	goxfer-bench -role target -nats nats://hostA:4222 -session s1 -listen 10.0.0.2:0
//	goxfer-bench -role initiator -nats nats://hostA:4222 -session s1 -backends tcp
//
// Usage:
//
//	goxfer-bench                                  # READ and WRITE, 4 KiB to 64 MiB, every built backend
//	goxfer-bench -blocks 4K-64M -step 2 -inflight 1,4 -descs 1,16
//	goxfer-bench -preset kv                       # 4096 × 64 KiB in one operation, beside 1 × 256 MiB
//	goxfer-bench -preset model -model llama3-70b -tokens 4096
//	goxfer-bench -check                           # verify every byte of every transfer
//	goxfer-bench -runs 3 -o out.csv,out.json -chart bw.png
//	goxfer-bench -backends tcp -blocks 4K,1M,64M -initiator-mem vram -target-mem vram
//	goxfer-bench -backends tcp -preset kv -initiator-mem vram -target-mem vram  # or -shapes 64Kx4096,256Mx1
//	goxfer-bench -backends cma -blocks 1M,64M -initiator-mem vram -target-mem vram  # cma+ipc; -device-ipc=false: staged
//	goxfer-bench -backends cma -blocks 4K,64M,256M -initiator-mem shm -target-mem shm  # cma+shm, beside Go copy
//	goxfer-bench -backends cma -preset kv -initiator-mem shm -target-mem shm
//	goxfer-bench -backends cma -shapes 64Kx4096 -cpuprofile cpu.prof  # the target's profile: cpu.prof.target
//	goxfer-bench -backends tcp -blocks 4K,64K -tcp-latency 50us  # tcp's latency mode on both sides
//
// GPU memory. -initiator-mem and -target-mem (dram, vram; nixlbench's
// segment types) place the initiator's local buffers and the target's
// exposed buffers in GPU memory (-gpu N), allocated in each process through
// the device driver (agent/devmem: CUDA, or the simulator with
// GOXFER_DEVICE=sim) and freed at the end; -check fills and verifies them
// through the driver's copies, every byte. With vram on either side each
// point is also measured dram/dram, beside pinned cuMemcpy D2H and H2D of
// the operation's bytes and of one staging chunk (-staging), so that every
// VRAM row carries, from the same run: the path the bytes took
// ("tcp+staging"), GB/s over the DRAM row, and the rate of its staging
// copies over pinned cuMemcpy. On one host cma maps the target's GPU
// memory and copies on the GPU ("cma+ipc"; -device-ipc=false stages it
// instead): its rows are compared with cuMemcpy of the same bytes in one
// process (D2D with vram on both sides, measured then), and the meter
// counts their device-to-device copies. Rows of several descriptors carry
// their ratio to one descriptor of the same bytes (the KV hand-off against
// one region).
//
// Shared host memory. -initiator-mem shm and -target-mem shm place a
// side's buffers in shared-memory segments (agent/shm's Alloc, what
// connect.Connector.AllocHost returns), allocated in each process and
// freed at the end, once the operations and exposures over them are
// closed. Where the target's exposed memory is shared, cma maps its
// segment in the initiator and copies with memmove, no lease round trip
// ("cma+shm"): such rows are compared with Go copy of the same bytes in
// one process, and, as every point with shm on either side is measured
// dram/dram too, with the same backend's Go heap row (×DRAM).
//
// Small operations. Points of at most 64 KiB with one operation in
// flight run their measured operations in batches alternating with
// batches of the raw 4 KiB TCP ping-pong to the target process
// (-interleave, on by default with -baselines): a ping-pong measured
// apart varies several-fold between runs on a busy machine. Such a row
// reports the ping-pong's p50 over the point and the median over the pairs
// of batches of the batch's p50 over the ping-pong's, to the active Wait
// and to the passive one ("×ping"). GB/s then covers the batches' own
// time, without the ping-pongs between them.
// On the simulator every such row, and the run, says SIMULATED GPU: its
// figures say nothing about a GPU. Without a driver, asking for vram fails
// before anything starts, saying what is missing.
//
// What a figure includes. For each point the target allocates one buffer
// per operation in flight and creates one passive operation per iteration
// (a passive operation completes once), then hands the tokens to the
// initiator in a few NATS messages before the initiator's clock starts. The
// initiator then runs BeginRead/BeginWrite and Wait with -inflight
// operations in flight: GB/s and ops/s cover the measured operations from
// the first Begin to the last completion; p50/p99 are from Begin to the
// active Wait's return (READ: the bytes landed; WRITE: acknowledged by the
// target). "done" latencies run from Begin to the moment the target's
// passive Wait returned, on the shared CLOCK_MONOTONIC (same host only): the
// completion notification included. Handing out one token per operation is
// measured apart, in the control-plane rows: CreateReadable plus Metadata,
// a NATS request/reply that makes and carries a token, and a 4 KiB READ
// that fetches its token first.
//
// Outputs: a table on standard output, -o files (.csv, .json), -chart
// (.png, .svg: GB/s against bytes per operation, one line per backend and
// dashed baselines), and progress on standard error (a bar on a terminal,
// one line per point otherwise).
//
// Bad input fails before anything starts: an unknown or unbuilt backend
// names the built ones, sizes that do not fit in MemAvailable name both
// numbers, and a target that never shows up is a timeout error after
// -timeout (default 30 s).
package main
