package nats_test

import (
	"context"
	"fmt"
	"log"

	"github.com/goxfer/goxfer/connect"
	gxnats "github.com/goxfer/goxfer/transport/nats"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// A prefill worker serves KV blocks on a subject; a decode worker requests
// one, gets its token in the reply and reads the block. Both run in this
// process here, each with its own NATS connection and Connector, as two
// services would.
func Example_requestReply() {
	ctx := context.Background()
	srv, err := natsserver.Start(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer srv.Shutdown()

	// Prefill worker.
	prefillNC, err := srv.Connect()
	if err != nil {
		log.Fatal(err)
	}
	defer prefillNC.Close()
	prefill, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer prefill.Close()
	block := []byte("KV block for prompt 17")
	svc, err := gxnats.Serve(prefillNC, "prefill.kv", func(ctx context.Context, req *gxnats.ServiceRequest) (*gxnats.Reply, error) {
		op, err := prefill.CreateReadable(ctx, connect.NewDescriptor(block))
		if err != nil {
			return nil, err
		}
		go func() { // the block stays exposed until the reader is done
			_ = op.Wait(context.Background())
			_ = op.Close()
		}()
		return &gxnats.Reply{Metadata: op.Metadata(), Data: []byte("layer 0")}, nil
	})
	if err != nil {
		log.Fatal(err)
	}
	defer svc.Close()

	// Decode worker.
	decodeNC, err := srv.Connect()
	if err != nil {
		log.Fatal(err)
	}
	defer decodeNC.Close()
	decode, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer decode.Close()
	rep, err := gxnats.Request(ctx, decodeNC, "prefill.kv", []byte("prompt 17"))
	if err != nil {
		log.Fatal(err)
	}
	dst := make([]byte, rep.Metadata.Sizes()[0])
	rop, err := decode.BeginRead(ctx, rep.Metadata, connect.NewDescriptor(dst))
	if err != nil {
		log.Fatal(err)
	}
	if err := rop.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s: %q\n", rep.Data, dst)
	// Output:
	// layer 0: "KV block for prompt 17"
}

// A decode worker offers a writable KV slot to the prefill pool; a prefill
// worker takes the offer and fills the slot.
func Example_offer() {
	ctx := context.Background()
	srv, err := natsserver.Start(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer srv.Shutdown()
	nc, err := srv.Connect()
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	conn, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()

	// Prefill pool: take offers in a queue group.
	offers, err := gxnats.Subscribe(nc, "kv.slots", gxnats.WithQueue("prefill"))
	if err != nil {
		log.Fatal(err)
	}
	defer offers.Close()

	// Decode worker: offer a slot.
	slot := make([]byte, 11)
	op, err := conn.CreateWritable(ctx, connect.NewDescriptor(slot))
	if err != nil {
		log.Fatal(err)
	}
	defer op.Close()
	if err := gxnats.Publish(ctx, nc, "kv.slots", op.Metadata(), []byte("request 7")); err != nil {
		log.Fatal(err)
	}

	// Prefill worker: fill it.
	offer, err := offers.Next(ctx)
	if err != nil {
		log.Fatal(err)
	}
	wop, err := conn.BeginWrite(ctx, offer.Metadata, connect.NewDescriptor([]byte("fresh block")))
	if err != nil {
		log.Fatal(err)
	}
	if err := wop.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	if err := op.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s: %q\n", offer.Data, slot)
	// Output:
	// request 7: "fresh block"
}

// Connectors join a presence registry; tokens may then be compact (name
// the agent without its endpoints), and operations with a peer that stops
// heartbeating fail with connect.ErrRemoteLost within about two
// heartbeats.
func ExampleRegistry() {
	ctx := context.Background()
	srv, err := natsserver.Start(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer srv.Shutdown()
	nc, err := srv.Connect()
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	reg, err := gxnats.OpenRegistry(ctx, nc)
	if err != nil {
		log.Fatal(err)
	}
	defer reg.Close()

	prefill, err := connect.NewConnector()
	if err != nil {
		log.Fatal(err)
	}
	defer prefill.Close()
	member, err := reg.Join(ctx, prefill)
	if err != nil {
		log.Fatal(err)
	}
	defer member.Close() // before prefill.Close: deferred calls run last first

	decode, err := connect.NewConnector(connect.WithResolver(reg))
	if err != nil {
		log.Fatal(err)
	}
	defer decode.Close()

	op, err := prefill.CreateReadable(ctx, connect.NewDescriptor([]byte("block")))
	if err != nil {
		log.Fatal(err)
	}
	defer op.Close()
	token := op.Metadata().Compact() // what a Reply or an offer would carry

	dst := make([]byte, 5)
	rop, err := decode.BeginRead(ctx, token, connect.NewDescriptor(dst))
	if err != nil {
		log.Fatal(err)
	}
	if err := rop.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("agents present: %d; read %q with a compact token\n", len(reg.Agents()), dst)
	// Output:
	// agents present: 1; read "block" with a compact token
}
