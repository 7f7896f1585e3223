package promconnect_test

import (
	"context"
	"fmt"
	"log"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/metrics/promconnect"
)

// A Connector whose operations and counters a registry exports: the
// Collector's Observe goes to the Connector, then the Collector is
// registered with it. Serve reg with promhttp.HandlerFor.
func Example() {
	m, err := promconnect.New()
	if err != nil {
		log.Fatal(err)
	}
	conn, err := connect.NewConnector(connect.WithObserver(m.Observe))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	reg := prometheus.NewRegistry()
	if err := m.Register(reg, conn); err != nil {
		log.Fatal(err)
	}

	// One READ, within this process (the mem backend).
	ctx := context.Background()
	src, dst := []byte("KV cache block"), make([]byte, 14)
	op, err := conn.CreateReadable(ctx, connect.NewDescriptor(src))
	if err != nil {
		log.Fatal(err)
	}
	defer op.Close()
	rop, err := conn.BeginRead(ctx, op.Metadata(), connect.NewDescriptor(dst))
	if err != nil {
		log.Fatal(err)
	}
	if err := rop.Wait(ctx); err != nil {
		log.Fatal(err)
	}

	fams, err := reg.Gather()
	if err != nil {
		log.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != "goxfer_operations_total" {
			continue
		}
		for _, mt := range f.GetMetric() {
			var ls []string
			for _, l := range mt.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			fmt.Println(strings.Join(ls, " "), mt.GetCounter().GetValue())
		}
	}
	// Output:
	// backend=mem kind=read path=mem role=active status=complete 1
}
