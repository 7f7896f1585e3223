package connect_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/goxfer/goxfer/connect"
)

// A prefill worker exposes a KV-cache block for reading; a decode worker
// reads it with the token. Both sides run in this process here, each with
// its own Connector, as two services would.
func Example_read() {
	ctx := context.Background()
	prefill, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer prefill.Close()
	decode, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer decode.Close()

	// Passive side: expose the block and hand out the token.
	block := []byte("key/value cache block 17")
	op, err := prefill.CreateReadable(ctx, connect.NewDescriptor(block))
	if err != nil {
		log.Fatal(err)
	}
	defer op.Close()
	token := op.Metadata().Text() // the capability: travels over NATS, HTTP, ...

	// Active side: read the block into local memory of the same size.
	md, err := connect.ParseMetadata(token)
	if err != nil {
		log.Fatal(err)
	}
	dst := make([]byte, md.Sizes()[0])
	rop, err := decode.BeginRead(ctx, md, connect.NewDescriptor(dst))
	if err != nil {
		log.Fatal(err)
	}
	if err := rop.Wait(ctx); err != nil {
		log.Fatal(err)
	}

	// The passive side learns that the peer is done with the block.
	if err := op.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s over %s: %q\n", rop.Status(), rop.Backend(), dst)
	fmt.Println("passive:", op.Status())
	// Output:
	// DONE over mem: "key/value cache block 17"
	// passive: DONE
}

// A decode worker exposes two empty blocks for writing; a prefill worker
// fills them. Any number of descriptors may go in one operation.
func Example_write() {
	ctx := context.Background()
	decode, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer decode.Close()
	prefill, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer prefill.Close()

	k, v := make([]byte, 5), make([]byte, 7)
	op, err := decode.CreateWritable(ctx, connect.NewDescriptor(k), connect.NewDescriptor(v))
	if err != nil {
		log.Fatal(err)
	}
	md := op.Metadata()
	fmt.Println(md.Kind(), md.Len(), md.Sizes())

	wop, err := prefill.BeginWrite(ctx, md, connect.NewDescriptor([]byte("keys!")), connect.NewDescriptor([]byte("values!")))
	if err != nil {
		log.Fatal(err)
	}
	if err := wop.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	if err := op.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	// After Close no peer can touch k and v any more.
	if err := op.Close(); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s %s\n", k, v)
	// Output:
	// WRITE 2 [5 7]
	// keys! values!
}

// A decode worker that already holds the first two blocks of a prompt
// (prefix caching) reads only the others, and of the last block only the
// bytes it needs: Select narrows the token to those spans, and the local
// descriptors mirror the narrowed sizes.
func ExampleMetadata_Select() {
	ctx := context.Background()
	prefill, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer prefill.Close()
	decode, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer decode.Close()

	blocks := [][]byte{[]byte("block-0"), []byte("block-1"), []byte("block-2"), []byte("block-3 and padding")}
	descs := make([]connect.Descriptor, len(blocks))
	for i, b := range blocks {
		descs[i] = connect.NewDescriptor(b)
	}
	op, err := prefill.CreateReadable(ctx, descs...)
	if err != nil {
		log.Fatal(err)
	}
	defer op.Close()

	// Blocks 0 and 1 are cached: read block 2 whole (a Length of 0 runs to
	// the descriptor's end) and the first 7 bytes of block 3.
	md, err := op.Metadata().Select(connect.Span{Index: 2}, connect.Span{Index: 3, Offset: 0, Length: 7})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(md.Len(), md.Sizes())
	local := make([]connect.Descriptor, md.Len())
	bufs := make([][]byte, md.Len())
	for i, n := range md.Sizes() {
		bufs[i] = make([]byte, n)
		local[i] = connect.NewDescriptor(bufs[i])
	}
	rop, err := decode.BeginRead(ctx, md, local...)
	if err != nil {
		log.Fatal(err)
	}
	if err := rop.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	if err := op.Wait(ctx); err != nil { // the passive side completes as with the whole token
		log.Fatal(err)
	}
	fmt.Printf("%s %s\n", bufs[0], bufs[1])

	_, err = op.Metadata().Select(connect.Span{Index: 3, Offset: 10, Length: 100})
	fmt.Println(errors.Is(err, connect.ErrInvalidSpan), err)
	// Output:
	// 2 [7 7]
	// block-2 block-3
	// true connect: invalid span: span 0: descriptor 3 has 19 bytes: want at most 9 from offset 10, found a length of 100
}

func ExampleParseDevice() {
	for _, s := range []string{"cpu", "cuda", "cuda:3", "tpu"} {
		d, err := connect.ParseDevice(s)
		fmt.Println(d, err)
	}
	// Output:
	// host <nil>
	// cuda:0 <nil>
	// cuda:3 <nil>
	// host connect: device "tpu": want "cpu", "host", "cuda" or "cuda:N"
}

// A KV pool exposed once and read by peers many times, each reading the
// layer it needs as soon as it is ready: every read is an event on the
// exposure, with the reader's note. The exposure expires if nobody uses
// it for a minute, and closes at the latest with its Connector.
func ExampleConnector_Expose() {
	ctx := context.Background()
	prefill, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer prefill.Close()
	decode, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer decode.Close()

	// Passive side: one descriptor per layer, exposed once.
	layers := [][]byte{[]byte("layer 0 kv"), []byte("layer 1 kv"), []byte("layer 2 kv")}
	descs := make([]connect.Descriptor, len(layers))
	for i, l := range layers {
		descs[i] = connect.NewDescriptor(l)
	}
	pool, err := prefill.Expose(ctx, connect.KindRead, descs, connect.WithExpiry(time.Minute))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	token := pool.Metadata()

	// Active side: read each layer with its own selection and a note.
	for i := range layers {
		part, err := token.Select(connect.Span{Index: i})
		if err != nil {
			log.Fatal(err)
		}
		dst := make([]byte, part.Sizes()[0])
		note := connect.ContextWithNote(ctx, fmt.Appendf(nil, "layer %d done", i))
		rop, err := decode.BeginRead(note, part, connect.NewDescriptor(dst))
		if err != nil {
			log.Fatal(err)
		}
		if err := rop.Wait(ctx); err != nil {
			log.Fatal(err)
		}
		fmt.Printf("read %q\n", dst)
	}

	// The passive side hears of each read, from whom and with what note.
	for range layers {
		ev := <-pool.Events()
		fmt.Printf("event: err=%v note=%q from decode: %t\n", ev.Err, ev.Note, ev.Peer == decode.AgentInfo().ID())
	}
	fmt.Println("dropped:", pool.Dropped())
	// Output:
	// read "layer 0 kv"
	// read "layer 1 kv"
	// read "layer 2 kv"
	// event: err=<nil> note="layer 0 done" from decode: true
	// event: err=<nil> note="layer 1 done" from decode: true
	// event: err=<nil> note="layer 2 done" from decode: true
	// dropped: 0
}

// A reader that will not use a token says so, and the exposing side stops
// waiting at once instead of at its deadline.
func ExampleConnector_Release() {
	ctx := context.Background()
	prefill, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer prefill.Close()
	decode, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer decode.Close()

	op, err := prefill.CreateReadable(ctx, connect.NewDescriptor([]byte("block the reader has already")))
	if err != nil {
		log.Fatal(err)
	}
	defer op.Close()

	if err := decode.Release(ctx, op.Metadata()); err != nil {
		log.Fatal(err)
	}
	err = op.Wait(ctx)
	fmt.Println(errors.Is(err, connect.ErrReleased), op.Status())
	// Output:
	// true STOP
}

// BeginRead with a deadline: the decode side reads several blocks of a
// token into buffers of the sizes the token names, and waits with a
// context that bounds the whole transfer.
func ExampleConnector_BeginRead() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	prefill, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer prefill.Close()
	decode, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer decode.Close()

	op, err := prefill.CreateReadable(ctx, connect.NewDescriptor([]byte("layer 0")), connect.NewDescriptor([]byte("layer 1!")))
	if err != nil {
		log.Fatal(err)
	}
	defer op.Close()
	md, err := connect.ParseMetadata(op.Metadata().Text())
	if err != nil {
		log.Fatal(err)
	}

	var descs []connect.Descriptor
	var bufs [][]byte
	for _, n := range md.Sizes() {
		b := make([]byte, n)
		bufs = append(bufs, b)
		descs = append(descs, connect.NewDescriptor(b))
	}
	rop, err := decode.BeginRead(ctx, md, descs...)
	if err != nil {
		log.Fatal(err)
	}
	if err := rop.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%d descriptors, %q %q\n", md.Len(), bufs[0], bufs[1])
	// Output:
	// 2 descriptors, "layer 0" "layer 1!"
}

// A transfer's failure as a *TransferError: which side, which peer, over
// which backend, and the cause, which matches the package's sentinels.
// Here the passive side closes its operation before the peer reads, so
// the read is refused.
func ExampleTransferError() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	prefill, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer prefill.Close()
	decode, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer decode.Close()

	op, err := prefill.CreateReadable(ctx, connect.NewDescriptor(make([]byte, 64)))
	if err != nil {
		log.Fatal(err)
	}
	md := op.Metadata()
	op.Close() // the token is void from here on

	rop, err := decode.BeginRead(ctx, md, connect.NewDescriptor(make([]byte, 64)))
	if err == nil {
		err = rop.Wait(ctx)
	}
	var te *connect.TransferError
	if errors.As(err, &te) {
		fmt.Println("op:", te.Op)
		fmt.Println("peer is the token's agent:", te.Peer == md.Agent())
		fmt.Println("access denied:", errors.Is(err, connect.ErrAccessDenied))
	}
	// Output:
	// op: read
	// peer is the token's agent: true
	// access denied: true
}
