//go:build linux

package cma

import (
	"errors"
	"io"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/backendtest"
)

// A same-user process that takes a lease on a live connection and then
// never ends it, whatever else it does on the connection, cannot hold up
// Revoke (nor the exposing agent's Close, which revokes): once a lease is
// held for WithTimeout on an exposure being revoked, the exposing side shuts
// its end of the connection and waits for the copier's close for at most
// WithTimeout more, then releases the lease. Revoke returns within about
// twice the timeout.
func TestRevokeBoundedAgainstSilentLeaseHolder(t *testing.T) {
	const timeout = 300 * time.Millisecond
	for _, tc := range []struct {
		name string
		// after the grant, until stop is closed
		behave func(p *rawPeer, stop <-chan struct{})
		close  bool // revoke through the agent's Close
	}{
		{name: "Silent", behave: func(*rawPeer, <-chan struct{}) {}},
		{name: "SilentClose", behave: func(*rawPeer, <-chan struct{}) {}, close: true},
		{name: "Chatty", behave: func(p *rawPeer, stop <-chan struct{}) {
			// Ends of leases it never asked for, without pause: frames keep
			// coming and no read waits.
			p.spam(frameBytes(header{typ: tEnd, id: 1 << 40}, nil, nil), 50*time.Millisecond, stop)
		}},
		{name: "Trickle", behave: func(p *rawPeer, stop <-chan struct{}) {
			// Frames begun and finished just within the frame timeout.
			b := frameBytes(header{typ: tEnd, id: 1 << 40}, nil, nil)
			for {
				for _, x := range b {
					select {
					case <-stop:
						return
					case <-time.After(timeout / hdrSize / 2):
					}
					_ = p.c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
					if _, err := p.c.Write([]byte{x}); err != nil {
						return
					}
				}
			}
		}},
		{name: "NeverReads", behave: func(p *rawPeer, stop <-chan struct{}) {
			// Lease requests under a wrong key, whose refusals it never
			// reads: the exposing side's answers fill the socket and its
			// writes wait.
			b := frameBytes(header{typ: tBegin, status: uint8(agent.AccessWrite), count: 1, id: 2, key: agent.NewKey()}, [][2]uint64{{4096, 1}}, nil)
			for id := uint64(2); ; id++ {
				select {
				case <-stop:
					return
				default:
				}
				(&header{typ: tBegin, status: uint8(agent.AccessWrite), count: 1, id: id, key: agent.NewKey()}).put(b)
				_ = p.c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
				_, _ = p.c.Write(b)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			backendtest.Watchdog(t, time.Minute)
			a, exp, p, _ := holdLease(t, WithTimeout(timeout))

			stop, behaved := make(chan struct{}), make(chan struct{})
			go func() { defer close(behaved); tc.behave(p, stop) }()
			defer func() { close(stop); <-behaved }()

			start := time.Now()
			revoked := make(chan struct{})
			go func() {
				defer close(revoked)
				if tc.close {
					_ = a.Close()
				} else {
					exp.Revoke()
				}
			}()
			select {
			case <-revoked:
			case <-time.After(20 * timeout):
				t.Fatalf("Revoke still waits after %v on a lease whose holder never ends it", 20*timeout)
			}
			took := time.Since(start)
			t.Logf("Revoke returned after %v (WithTimeout %v)", took.Round(time.Millisecond), timeout)
			// The peer was told: its stream ends (reset, if the exposing
			// side closed with its frames unread).
			_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err := io.Copy(io.Discard, p.br)
			if !errors.Is(err, syscall.ECONNRESET) {
				assert.NoError(t, err, "the exposing side shut its end of the connection")
			}
			assert.GreaterOrEqual(t, took, timeout, "released before the silent holder could have been given WithTimeout to close")
		})
	}
}
