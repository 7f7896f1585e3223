//go:build unix

package main

import (
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// verifiedLine is a decode worker's line for a request it verified.
var verifiedLine = regexp.MustCompile(`^\[decode(-\d+)?\] req +\d+/\d+ .* verified$`)

// reconnectedLine is a worker's line for the NATS server it reconnected to.
var reconnectedLine = regexp.MustCompile(`^\[(prefill|decode)(-\d+)?\] nats: reconnected to `)

// disconnectedLine is a worker's line for the NATS connection it lost.
var disconnectedLine = regexp.MustCompile(`^\[(prefill|decode)(-\d+)?\] nats: disconnected`)

// The example against a real cluster of three NATS servers: the workers
// get every server's URL, and one server is killed once requests flow.
// The workers on it reconnect to the others, requests in flight are
// retried, the presence registry (replicated on all three) keeps
// resolving the prefill workers' tokens, and every request completes,
// verified.
//
// Which server a worker connects to is chosen at random by its NATS
// client, so the test kills server 0 and, if no worker was on it (no
// worker says it was disconnected), restarts it and kills the next one;
// -decode-time paces the run (two requests every 400 ms) so that it is
// still going after two such tries.
func TestClusterServerKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("about 30 s: two runs of 64 requests, paced by -decode-time so that a server or two can be killed mid-run")
	}
	for _, mode := range []string{"read", "write"} {
		t.Run(mode, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			c, err := natsserver.StartCluster(ctx, 3)
			require.NoError(t, err)
			t.Cleanup(c.Shutdown)

			const n = 64
			e := start(t, append([]string{"-nats", c.ClientURL(), "-mode", mode, "-prefill", "2", "-decode", "1",
				"-requests", strconv.Itoa(n), "-decode-time", "400ms", "-attempt-timeout", "2s"}, small...)...)
			e.await(`^\[decode\] req +\d+/\d+ .* verified$`)

			killed, mark := -1, 0
			var seen killSeen
			for k := range c.Len() {
				drain(e.line, func(string) {}) // lines printed before the kill
				mark = len(e.output())
				require.NoError(t, c.Kill(k))
				if seen = watchKill(t, e, time.Now()); seen.disconnected > 0 {
					killed = k
					break
				}
				t.Logf("killed NATS server %d: no worker was connected to it; restarting it", k)
				rctx, rcancel := context.WithTimeout(t.Context(), 30*time.Second)
				require.NoError(t, c.Restart(rctx, k))
				rcancel()
			}
			require.GreaterOrEqual(t, killed, 0, "no server's kill disconnected a worker")
			t.Logf("killed NATS server %d of 3 (%s): after %v a worker was disconnected, after %v one reconnected, and after %v the next request was verified",
				killed, c.URLs()[killed], seen.disconnected.Round(100*time.Microsecond), seen.reconnected.Round(100*time.Microsecond), seen.verified.Round(100*time.Microsecond))

			require.Equal(t, 0, e.wait(), "exit status")
			out := e.output()
			requireAllVerified(t, out, n)
			assert.Contains(t, out, "0 failed, 0 not run")
			// Every worker that lost its server found another.
			after := out[mark:]
			disconnected := len(regexp.MustCompile(`(?m)^\[\S+\] nats: disconnected`).FindAllString(after, -1))
			reconnects := regexp.MustCompile(`(?m)^\[\S+\] nats: reconnected to (\S+)$`).FindAllStringSubmatch(after, -1)
			assert.Len(t, reconnects, disconnected, "each worker disconnected reconnected")
			for _, r := range reconnects {
				assert.NotEqual(t, c.URLs()[killed], r[1], "reconnected to the killed server")
			}
			t.Logf("%d workers reconnected to the other servers; %d attempts failed and were tried again; %s",
				len(reconnects), strings.Count(out, " failed, trying again in "),
				regexp.MustCompile(`summary: .*`).FindString(out))
		})
	}
}

// drain empties lines of what it holds now, giving each to see.
func drain(lines chan string, see func(string)) {
	for {
		select {
		case l := <-lines:
			see(l)
		default:
			return
		}
	}
}

// killSeen is what the example printed after a NATS server was killed:
// how long after the kill a worker said it was disconnected, reconnected,
// and the next request was verified after that (zero: not seen).
type killSeen struct {
	disconnected, reconnected, verified time.Duration
}

func (k killSeen) complete() bool {
	return k.disconnected > 0 && k.reconnected > 0 && k.verified > 0
}

// watchKill reads the example's lines after a NATS server was killed at
// killed, and reports what they showed. It returns once a worker was
// disconnected, reconnected and a request verified after that, or after
// 2 s with no worker disconnected (a worker notices at once: the server
// closes its connection).
func watchKill(t *testing.T, e *example, killed time.Time) killSeen {
	t.Helper()
	var seen killSeen
	see := func(l string) {
		switch {
		case disconnectedLine.MatchString(l) && seen.disconnected == 0:
			seen.disconnected = time.Since(killed)
		case reconnectedLine.MatchString(l) && seen.reconnected == 0:
			seen.reconnected = time.Since(killed)
		case verifiedLine.MatchString(l) && seen.disconnected > 0 && seen.verified == 0:
			seen.verified = time.Since(killed)
		}
	}
	noHit := time.After(2 * time.Second)
	guard := time.After(60 * time.Second)
	for !seen.complete() {
		select {
		case l := <-e.line:
			see(l)
		case <-noHit:
			if seen.disconnected == 0 {
				return seen
			}
		case <-e.done:
			drain(e.line, see) // its last lines
			if !seen.complete() {
				t.Fatalf("the example exited before a worker was disconnected, reconnected and a request verified after that: %+v", seen)
			}
		case <-guard:
			t.Fatalf("not within 60s of the kill: a worker disconnected, reconnected and a request verified after that: %+v", seen)
		}
	}
	return seen
}
