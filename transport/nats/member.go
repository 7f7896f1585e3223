package nats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/goxfer/goxfer/connect"
)

// Member is a Connector's presence in a [Registry]; see [Registry.Join].
// It is safe for concurrent use. It owns the goroutine that heartbeats,
// stopped by [Member.Leave] (or [Registry.Close]); the Connector stays the
// caller's.
type Member struct {
	r    *Registry
	c    *connect.Connector
	id   uuid.UUID
	info []byte // its AgentInfo's binary form
	hb   time.Duration

	ctx    context.Context // cancelled by Leave: stops the heartbeats
	cancel context.CancelFunc
	poke   chan struct{} // put now
	done   chan struct{} // closed when the heartbeats stopped, or never started
	joined atomic.Bool   // the first put succeeded; final once done is closed
	unsure atomic.Bool   // Close cut the first put short; final once done is closed
	err    error         // the last heartbeat's failure; under r.mu
	// Under r.mu: the puts not yet echoed, oldest first.
	sends []*sentPut

	leaveOnce sync.Once
	leaveErr  error
}

// Join publishes c's [connect.AgentInfo] in the registry under its agent
// ID, then re-puts it every heartbeat ([WithHeartbeat]; default: the
// Registry's) from one goroutine, until [Member.Leave], and at once
// whenever the Registry re-creates its watch (after a reconnection, or
// after re-creating a bucket that vanished). A heartbeat that fails (while
// the connection is down, say) is retried at the next tick; one that fails
// on a live connection is logged at Warn level, reported by [Registry.Err]
// until one succeeds, and has the Registry check (at most once a second)
// that its bucket still exists. Until Leave, every departure the Registry
// sees is forwarded to c ([connect.Connector.PeerDeparted]; a peer that
// left, one heartbeat after its entry was deleted), so c's
// operations in flight with a departed peer fail with
// [connect.ErrRemoteLost] within about two heartbeats. c stays the
// caller's; the Member must Leave before c closes ([Registry.Close] leaves
// it otherwise). Join fails if the first put does, which ctx bounds, and
// so does Registry.Close: a Join cut short by Close fails with an error
// matching [ErrClosed]. Options honoured: WithHeartbeat. Safe for
// concurrent use.
func (r *Registry) Join(ctx context.Context, c *connect.Connector, opts ...JoinOption) (*Member, error) {
	base := defaults()
	base.heartbeat = r.hb
	o, err := applyOptions(base, opts, JoinOption.applyJoin)
	if err != nil {
		return nil, err
	}
	if c == nil {
		return nil, fmt.Errorf("%w: Join needs a Connector", ErrInvalidOption)
	}
	info := c.AgentInfo()
	ib, err := info.MarshalBinary()
	if err != nil {
		return nil, fmt.Errorf("goxfer/nats: join registry %q: %w", r.bucket, err)
	}
	if r.ttl > 0 && 2*o.heartbeat >= r.ttl {
		r.log.Warn("goxfer/nats: heartbeat too long for the bucket's TTL; the entry may expire between heartbeats", "bucket", r.bucket, "heartbeat", o.heartbeat, "ttl", r.ttl)
	}
	m := &Member{r: r, c: c, id: info.ID(), info: ib, hb: o.heartbeat, poke: make(chan struct{}, 1), done: make(chan struct{})}
	m.ctx, m.cancel = context.WithCancel(context.Background())
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		m.cancel()
		return nil, fmt.Errorf("%w: registry on bucket %q", ErrClosed, r.bucket)
	}
	// Registered before the put, so that a departure seen meanwhile
	// reaches c, and Close leaves it.
	r.members[m] = struct{}{}
	r.wg.Add(1)
	r.mu.Unlock()
	// Close (through Leave) cancels the first put too: it must not wait
	// for the caller's context while the server does not answer.
	pctx, pcancel := context.WithCancel(ctx)
	stop := context.AfterFunc(m.ctx, pcancel)
	err = m.put(pctx)
	stop()
	pcancel()
	if err != nil {
		r.mu.Lock()
		delete(r.members, m)
		r.mu.Unlock()
		left := m.ctx.Err() != nil
		// Cut short by Close, the put may still be stored (it was sent, or
		// waits in the reconnect buffer): Leave deletes the entry.
		m.unsure.Store(left)
		m.cancel()
		close(m.done) // a Leave racing this (Close) must not wait for heartbeats that never start
		r.wg.Done()
		if left {
			return nil, fmt.Errorf("%w: registry on bucket %q closed while agent %s joined: %w", ErrClosed, r.bucket, m.id, err)
		}
		return nil, fmt.Errorf("goxfer/nats: join registry %q as agent %s: %w", r.bucket, m.id, err)
	}
	m.joined.Store(true)
	// Present here at once, without waiting for the watch to echo it.
	r.hear(m.id, entry{hb: m.hb, info: info}, 0)
	go m.heartbeat()
	return m, nil
}

// ID returns the agent ID the Member publishes. Safe for concurrent use.
func (m *Member) ID() uuid.UUID { return m.id }

// put puts m's entry once, numbered so that its echo is known.
func (m *Member) put(ctx context.Context) error {
	sp := m.r.sending(m)
	rev, err := m.r.kv.Put(ctx, m.id.String(), appendEntry(nil, m.hb, sp.seq, m.info))
	switch {
	case err == nil:
		m.r.acked(m, sp, rev)
	case refused(m.r.nc, err):
		m.r.refusedPut(sp)
	default:
		m.r.lostPut(sp)
	}
	return err
}

func (m *Member) heartbeat() {
	defer m.r.wg.Done()
	defer close(m.done)
	// Back from an outage, put at once: others count our silence from
	// their own reconnection.
	back := m.r.nc.StatusChanged(nats.CONNECTED)
	defer m.r.nc.RemoveStatusListener(back)
	t := time.NewTicker(m.hb)
	defer t.Stop()
	failing := 0
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-t.C:
		case <-back:
			t.Reset(m.hb)
		case <-m.poke:
			t.Reset(m.hb)
		}
		ctx, cancel := context.WithTimeout(m.ctx, m.hb)
		err := m.put(ctx)
		cancel()
		if m.ctx.Err() != nil {
			return
		}
		m.r.mu.Lock()
		m.err = err
		m.r.mu.Unlock()
		if err == nil {
			if failing > 0 && m.r.nc.Status() == nats.CONNECTED {
				m.r.log.Info("goxfer/nats: heartbeat works again", "bucket", m.r.bucket, "agent", m.id, "failed", failing)
			}
			failing = 0
			continue
		}
		failing++
		if m.r.nc.Status() == nats.CONNECTED {
			// The bucket may have vanished under a watch that cannot tell.
			// Not only ErrNoStreamResponse says so: at short heartbeats the
			// client's retries outlast the put's timeout.
			select {
			case m.r.recheck <- struct{}{}:
			default:
			}
		}
		// Failures while the connection is down are expected; on a live
		// connection, peers will soon declare this agent departed.
		level := slog.LevelDebug
		if failing == 1 && m.r.nc.Status() == nats.CONNECTED {
			level = slog.LevelWarn
		}
		m.r.log.Log(m.ctx, level, "goxfer/nats: heartbeat failed; peers declare this agent departed after two; retrying at the next one",
			"bucket", m.r.bucket, "agent", m.id, "err", err)
	}
}

// refused says whether a put's err is the store's refusal of this
// Member's entry (its size, a full account: JetStream answered with an
// error; or a permission violation, which it answers with no
// acknowledgement), rather than no answer: a put the store refuses says
// nothing of anybody else's.
func refused(nc *nats.Conn, err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		return apiErr.ErrorCode != jsClusterNotAvailable
	}
	return errors.Is(nc.LastError(), nats.ErrPermissionViolation)
}

// jsClusterNotAvailable is JetStream's "JetStream system temporarily
// unavailable": no leader for the stream, or for JetStream, now.
const jsClusterNotAvailable = 10008

// Leave stops the heartbeats and deletes the entry, so that every Registry
// sees the departure at once (and tells its joined Connectors one
// heartbeat later: Close the Connector right after Leave, and the
// notifications it still owes get there first). It honours ctx: if ctx
// ends first, the entry is left to expire (peers then declare this agent
// departed after two heartbeats) and the error matches ctx.Err(). It is
// idempotent and safe for concurrent use; every call returns the first
// call's result.
func (m *Member) Leave(ctx context.Context) error {
	m.leaveOnce.Do(func() {
		m.cancel()
		m.r.mu.Lock()
		delete(m.r.members, m)
		m.r.mu.Unlock()
		// The heartbeat goroutine stops at once: its put's context is
		// cancelled. It may not have started: a Join whose put failed.
		select {
		case <-m.done:
		case <-ctx.Done():
			m.leaveErr = fmt.Errorf("goxfer/nats: leave registry %q as agent %s: %w", m.r.bucket, m.id, ctx.Err())
			return
		}
		if !m.joined.Load() {
			if m.unsure.Load() {
				// Best effort: the Join failed, so its caller holds
				// nothing to leave, and the entry expires anyway.
				_ = m.r.kv.Delete(ctx, m.id.String())
			}
			return
		}
		if err := m.r.kv.Delete(ctx, m.id.String()); err != nil {
			m.leaveErr = fmt.Errorf("goxfer/nats: leave registry %q as agent %s: %w", m.r.bucket, m.id, err)
		}
	})
	return m.leaveErr
}

// Close is [Member.Leave] with a short internal timeout (2 s).
func (m *Member) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return m.Leave(ctx)
}
