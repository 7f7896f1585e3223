// Package promconnect exports a [connect.Connector]'s metrics to
// Prometheus: the counters of [connect.Connector.Stats], read at each
// scrape, and per-operation counts, latency and byte histograms by kind
// (read, write), role (active, passive) and backend, fed by the
// Connector's observer ([connect.WithObserver]). docs/metrics.md lists the
// metrics and what to alert on.
//
// It is a package of its own so that programs that do not use Prometheus
// do not link it: connect, agent and the transports never import it.
//
//	m, err := promconnect.New()
//	conn, err := connect.NewConnector(connect.WithObserver(m.Observe))
//	defer conn.Close()
//	err = m.Register(prometheus.DefaultRegisterer, conn)
//	http.Handle("/metrics", promhttp.Handler())
//
// One Collector serves one Connector. To export several from one registry,
// register each through [prometheus.WrapRegistererWith] with a label that
// tells them apart.
package promconnect
