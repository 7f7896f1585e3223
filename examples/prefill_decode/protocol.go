package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/agent/backend/tcp"
	"github.com/goxfer/goxfer/agent/devmem"
	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/metrics/promconnect"
	gxnats "github.com/goxfer/goxfer/transport/nats"
)

// The NATS subjects the workers talk on. The prefill workers serve them in
// a queue group, so that several share the load.
const (
	// subjectHello is a plain NATS request/reply: "which model do you
	// serve?". The decode worker asks it until a prefill worker answers,
	// which tells it that one is up and that both agree on the model.
	subjectHello = "goxfer.example.prefill.hello"
	// subjectRead carries READ-mode hand-offs (transport/nats Request and
	// Serve): the decode worker sends a kvRequest, the prefill worker
	// replies with a READ token for the prompt's KV blocks and a kvReply.
	subjectRead = "goxfer.example.prefill"
	// subjectOffer carries WRITE-mode offers (transport/nats Publish and
	// Subscribe): the decode worker publishes a WRITE token for empty
	// blocks with a kvRequest, and a prefill worker writes the KV cache
	// into them.
	subjectOffer = "goxfer.example.kv.offer"
	// subjectReady is where each prefill worker says, once, that it takes
	// requests (a helloReply; no queue group): the orchestrator starts
	// the decode workers once all of its prefill workers have.
	subjectReady = "goxfer.example.prefill.ready"
	// queuePrefill is the queue group of the prefill workers: NATS hands
	// each request and offer to one of them, picked at random.
	queuePrefill = "prefill"
)

// helloReply is a prefill worker's answer on subjectHello, and what it says
// on subjectReady.
type helloReply struct {
	Agent  string `json:"agent"` // its Connector's agent ID
	Worker string `json:"worker,omitempty"`
	Model  Model  `json:"model"`
}

// kvRequest asks for the KV cache of one prompt. ID names the request:
// retries carry the same ID, which is what lets the prefill worker treat a
// retry as a replacement for the earlier attempt, and the KV cache's
// content is derived from it, so the decode worker can check every byte.
type kvRequest struct {
	ID           string `json:"id"`
	PromptTokens int    `json:"prompt_tokens"`
}

// kvReply goes with a READ token: the request it answers, how many blocks
// the token names, and the prefill worker that serves them (its -name).
type kvReply struct {
	ID     string `json:"id"`
	Blocks int    `json:"blocks"`
	Worker string `json:"worker,omitempty"`
}

// connectNATS connects to the NATS server at url as name. The connection
// reconnects for ever, quickly, and says so on out: a server restart must
// only delay requests, never lose them.
func connectNATS(url, name string, out io.Writer) (*nats.Conn, error) {
	opts := []nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(100 * time.Millisecond),
		nats.DisconnectErrHandler(func(nc *nats.Conn, err error) {
			switch {
			case nc.IsClosed(): // closed by us, not lost
			case err != nil:
				fmt.Fprintf(out, "nats: disconnected (%v); reconnecting\n", err)
			default:
				fmt.Fprintf(out, "nats: disconnected; reconnecting\n")
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			fmt.Fprintf(out, "nats: reconnected to %s\n", nc.ConnectedUrlRedacted())
		}),
	}
	// nats.Connect gives up after its dial timeout (2 s by default).
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", url, err)
	}
	return nc, nil
}

// endpoint is what each worker needs to take part: a NATS connection, a
// membership in the presence registry, and a Connector that resolves
// compact tokens through the registry.
type endpoint struct {
	nc      *nats.Conn
	reg     *gxnats.Registry
	conn    *connect.Connector
	member  *gxnats.Member
	metrics *metricsServer // nil without -metrics
	out     io.Writer      // where Close warns
}

// openEndpoint connects to NATS, opens the presence registry (creating its
// JetStream KV bucket if need be), starts the Connector and joins it to the
// registry, so that peers can resolve its compact tokens and notice when it
// goes away. drv, if not nil, is the driver of the worker's GPU memory,
// which the Connector then uses to check and stage it.
func openEndpoint(ctx context.Context, cfg config, drv devmem.Driver, out io.Writer) (*endpoint, error) {
	nc, err := connectNATS(cfg.natsURL, "goxfer-example-"+cfg.name, out)
	if err != nil {
		return nil, err
	}
	e := &endpoint{nc: nc, out: out}
	if e.reg, err = gxnats.OpenRegistry(ctx, nc); err != nil {
		err = fmt.Errorf("open the presence registry: %w", err)
		return nil, errors.Join(err, e.Close())
	}
	opts := []connect.Option{connect.WithResolver(e.reg), connect.WithTCPOptions(tcp.WithListenAddr(cfg.listen))}
	if drv != nil {
		opts = append(opts, connect.WithDevice(drv))
	}
	var m *promconnect.Collector
	if cfg.metrics != "" {
		if m, err = promconnect.New(); err != nil {
			return nil, errors.Join(err, e.Close())
		}
		opts = append(opts, connect.WithObserver(m.Observe))
	}
	if e.conn, err = connect.NewConnector(opts...); err != nil {
		err = fmt.Errorf("start the connector: %w", err)
	} else if e.member, err = e.reg.Join(ctx, e.conn); err != nil {
		err = fmt.Errorf("join the presence registry: %w", err)
	} else if m != nil {
		e.metrics, err = serveMetrics(cfg.metrics, m, e.conn, out)
	}
	if err != nil {
		return nil, errors.Join(err, e.Close())
	}
	return e, nil
}

// Close undoes openEndpoint in reverse: peers see the worker depart, its
// operations end, then it disconnects.
func (e *endpoint) Close() error {
	var errs []error
	if e.metrics != nil {
		errs = append(errs, e.metrics.close())
	}
	if e.member != nil {
		// A worker that did its work does not fail for this: the entry
		// expires on its own. Seen when the registry's stream was electing
		// a leader after a NATS server was killed (TestClusterServerKilled).
		if err := e.member.Close(); err != nil {
			fmt.Fprintf(e.out, "WARN %v; peers see this worker depart when its entry expires, after two missed heartbeats\n", err)
		}
	}
	if e.conn != nil {
		errs = append(errs, e.conn.Close())
	}
	if e.reg != nil {
		errs = append(errs, e.reg.Close())
	}
	e.nc.Close()
	return errors.Join(errs...)
}
