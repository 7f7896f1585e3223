package connect_test

import (
	"context"
	"fmt"
	"log"

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
