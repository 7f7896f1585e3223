// Package chaos holds goxfer's network-chaos suite: tests only. Real
// Connectors, over the tcp backend alone, move patterned bytes through an
// internal/faultproxy Proxy that the passive side advertises
// (tcp.WithAdvertiseAddr), while the proxy resets, stalls, half-opens,
// half-closes, delays and throttles their connections mid-transfer. Every
// operation must end, within a bound derived from the keepalive timeout,
// either exact or with connect.ErrRemoteLost or the caller's deadline;
// every byte of every success is checked; and the next operation after the
// fault is lifted, through the same Connectors, must succeed.
//
// Short mode (the default, what CI runs):
//
//	go test -race ./internal/chaos/
//
// Long mode, many rounds per fault kind:
//
//	go test -race -tags soak -timeout 30m ./internal/chaos/
//	GOXFER_CHAOS_ROUNDS=50 go test ./internal/chaos/   # any number of rounds
//
// Run with -v to see the report: operations, faults injected by kind,
// outcomes by error kind, and bytes corrupted (always 0). See
// docs/reliability.md.
package chaos
