// Command quickstart moves a KV-cache-like set of blocks between two goxfer
// connectors: one exposes its blocks and hands out a text token, the other
// uses the token to READ them, then the roles turn for a WRITE. The token is
// passed as a string, as it would travel over NATS between two services.
//
//	go run ./examples/quickstart                  # over the tcp backend
//	go run ./examples/quickstart -backend mem     # in-process copy
//	go run ./examples/quickstart -blocks 4096 -block-size 65536
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/goxfer/goxfer/connect"
)

func main() {
	backend := flag.String("backend", "tcp", "backend to force: tcp or mem")
	blocks := flag.Int("blocks", 1024, "blocks (descriptors) per operation")
	blockSize := flag.Int("block-size", 64<<10, "bytes per block")
	flag.Parse()
	if err := run(*backend, *blocks, *blockSize); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func run(backend string, blocks, blockSize int) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	prefill, err := connect.NewConnector(connect.WithBackend(backend))
	if err != nil {
		return err
	}
	defer prefill.Close()
	decode, err := connect.NewConnector(connect.WithBackend(backend))
	if err != nil {
		return err
	}
	defer decode.Close()

	src, srcDescs := pool(blocks, blockSize, 1)
	dst, dstDescs := pool(blocks, blockSize, 0)

	// READ: prefill exposes its blocks, decode reads them.
	readable, err := prefill.CreateReadable(ctx, srcDescs...)
	if err != nil {
		return err
	}
	defer readable.Close()
	token := readable.Metadata().Text() // the capability: hand it only to the reader
	fmt.Printf("token for %d blocks: %d characters\n", blocks, len(token))

	md, err := connect.ParseMetadata(token)
	if err != nil {
		return err
	}
	start := time.Now()
	read, err := decode.BeginRead(ctx, md, dstDescs...)
	if err != nil {
		return err
	}
	if err := read.Wait(ctx); err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if err := readable.Wait(ctx); err != nil {
		return fmt.Errorf("readable: %w", err)
	}
	report("READ", read.Backend(), blocks*blockSize, time.Since(start))
	if err := same(src, dst); err != nil {
		return err
	}

	// WRITE: decode exposes fresh blocks, prefill writes into them.
	fresh, freshDescs := pool(blocks, blockSize, 0)
	writable, err := decode.CreateWritable(ctx, freshDescs...)
	if err != nil {
		return err
	}
	defer writable.Close()
	md, err = connect.ParseMetadata(writable.Metadata().Text())
	if err != nil {
		return err
	}
	start = time.Now()
	write, err := prefill.BeginWrite(ctx, md, srcDescs...)
	if err != nil {
		return err
	}
	if err := write.Wait(ctx); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if err := writable.Wait(ctx); err != nil {
		return fmt.Errorf("writable: %w", err)
	}
	report("WRITE", write.Backend(), blocks*blockSize, time.Since(start))
	if err := same(src, fresh); err != nil {
		return err
	}
	fmt.Println("every byte verified")
	return nil
}

// pool allocates blocks of the given size, filled from seed (0: zeroes).
func pool(n, size int, seed byte) ([][]byte, []connect.Descriptor) {
	bufs := make([][]byte, n)
	descs := make([]connect.Descriptor, n)
	for i := range bufs {
		bufs[i] = make([]byte, size)
		for j := range bufs[i] { // also faults the pages in, as a long-lived KV pool would have them
			bufs[i][j] = (byte(i*31+j) ^ seed) & -seed
		}
		descs[i] = connect.NewDescriptor(bufs[i])
	}
	return bufs, descs
}

func same(want, got [][]byte) error {
	for i := range want {
		if !bytes.Equal(want[i], got[i]) {
			return fmt.Errorf("block %d differs after the transfer", i)
		}
	}
	return nil
}

func report(op, backend string, n int, d time.Duration) {
	fmt.Printf("%-5s %4d MiB via %-3s in %8v  %6.2f GB/s\n", op, n>>20, backend, d.Round(time.Microsecond), float64(n)/d.Seconds()/1e9)
}
