// Package soak holds goxfer's soak test: thousands of READ and WRITE
// operations between two processes, each with its own connect.Connector,
// 64 in flight at once, every byte checked against a deterministic pattern
// and every descriptor fenced by guard bytes, while both processes' resident
// memory and goroutine counts are watched for growth.
//
// The package has no API; it is all tests. The test binary re-executes
// itself as the second process (internal/testproc), and the two exchange
// tokens over NATS (an embedded server in the first process), as services
// would. One subtest runs per backend that crosses processes: tcp
// (connect.WithoutCMA) and cma (the default between two processes of one
// Linux host), and a third, shm, where both processes take every
// operation's memory from Connector.AllocHost and free it once the
// operation closed, so that cma copies through mapped shared memory (path
// "cma+shm") and no segment or lease table may stay mapped. In every
// subtest each process is active in some operations and passive in
// others.
//
// By default the test runs a short soak (a few hundred operations per
// backend), which is what CI runs with go test -race ./... . The full soak
// (more than 10,000 operations per backend) runs with the soak build tag:
//
//	go test -tags soak -run Soak -timeout 60m -v ./internal/soak/
//
// GOXFER_SOAK_OPS overrides the number of operations per backend, and
// GOXFER_SOAK_REPORT names a file to write the figures to as JSON. See
// docs/reliability.md.
package soak
