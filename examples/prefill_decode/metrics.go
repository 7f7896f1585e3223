package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/metrics/promconnect"
)

// metricsServer serves a worker's Prometheus metrics at /metrics (-metrics):
// its Connector's (metrics/promconnect), the Go runtime's and the
// process's.
type metricsServer struct {
	srv  *http.Server
	done chan struct{} // closed when Serve has returned
}

// serveMetrics registers m, tied to conn, and serves it with the Go and
// process collectors on addr, saying where on out. Stop it with close.
func serveMetrics(addr string, m *promconnect.Collector, conn *connect.Connector, out io.Writer) (*metricsServer, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if err := m.Register(reg, conn); err != nil {
		return nil, fmt.Errorf("register the metrics: %w", err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("-metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	s := &metricsServer{
		srv:  &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second},
		done: make(chan struct{}),
	}
	go func() {
		defer close(s.done)
		_ = s.srv.Serve(ln) // ends with http.ErrServerClosed, from close
	}()
	fmt.Fprintf(out, "metrics: http://%s/metrics\n", ln.Addr())
	return s, nil
}

// close stops the server, letting scrapes in progress finish for a second.
func (s *metricsServer) close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	if errors.Is(err, context.DeadlineExceeded) {
		err = s.srv.Close()
	}
	<-s.done
	return err
}

// metricsAddr is the -metrics address of the orchestrator's i-th worker,
// from 0, the prefill workers first (with -prefill 3 -decode 2: prefill-1
// to prefill-3 are 0 to 2, decode-1 and decode-2 are 3 and 4): base's port
// plus i, so that the workers' servers do not collide; port 0 stays 0,
// each worker taking a free port.
func metricsAddr(base string, i int) (string, error) {
	host, port, err := net.SplitHostPort(base)
	if err != nil {
		return "", err
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p > 65535 {
		return "", fmt.Errorf("port %q: want a number from 0 to 65535", port)
	}
	if p == 0 {
		return base, nil
	}
	if p+i > 65535 {
		return "", fmt.Errorf("port %d: worker %d would need port %d", p, i, p+i)
	}
	return net.JoinHostPort(host, strconv.Itoa(p+i)), nil
}
