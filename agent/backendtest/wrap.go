package backendtest

import (
	"context"
	"sync"
	"time"

	"github.com/goxfer/goxfer/agent"
	"github.com/goxfer/goxfer/agent/devmem"
)

// wrapper is a backend under test seen through a thin layer: it has only
// the methods of agent.Backend (and KeyedReacher, where the backend has
// it, so that reachability does not change), so it hides the backend's
// other optional interfaces, agent.DeviceStager among them. post, if set,
// replaces Post (calling the backend's itself); host, if set, wraps the
// Host the backend is started with.
type wrapper struct {
	agent.Backend
	post func(b agent.Backend, w *agent.Work) error
	host func(h agent.Host) agent.Host
}

// wrap returns b seen through w.
func wrap(b agent.Backend, w wrapper) agent.Backend {
	w.Backend = b
	if kr, ok := b.(agent.KeyedReacher); ok {
		return &keyedWrapper{wrapper: &w, kr: kr}
	}
	return &w
}

func (w *wrapper) Start(h agent.Host) ([]byte, error) {
	if w.host != nil {
		h = w.host(h)
	}
	return w.Backend.Start(h)
}

func (w *wrapper) Post(x *agent.Work) error {
	if w.post != nil {
		return w.post(w.Backend, x)
	}
	return w.Backend.Post(x)
}

type keyedWrapper struct {
	*wrapper
	kr agent.KeyedReacher
}

func (w *keyedWrapper) ReachableWithKey(ctx context.Context, info agent.Info, key agent.Key, acc agent.Access) error {
	return w.kr.ReachableWithKey(ctx, info, key, acc)
}

// sendMarks records, in a simulator's record, the interval from the agent
// posting each transfer (a staged transfer's part) to the backend
// finishing it, as a "send" (for either direction). The end is when the
// transfer's Done is seen: at once if the backend finished it before Post
// returned, otherwise by a goroutine waiting for it.
type sendMarks struct {
	sim *devmem.Sim
	wg  sync.WaitGroup
}

// post is a wrapper's Post.
func (m *sendMarks) post(b agent.Backend, w *agent.Work) error {
	end := m.sim.Mark("send", w.Bytes())
	if err := b.Post(w); err != nil {
		return err
	}
	select {
	case <-w.Done():
		end()
	default:
		m.wg.Go(func() { <-w.Done(); end() })
	}
	return nil
}

// wait waits until every send posted so far is in the record.
func (m *sendMarks) wait() { m.wg.Wait() }

// slowPeer makes the agent a slow peer: every lease its backend asks for
// is granted delay late, as by a process busy elsewhere, so each access a
// peer makes takes at least that long.
func slowPeer(delay time.Duration) func(agent.Host) agent.Host {
	return func(h agent.Host) agent.Host { return slowHost{Host: h, delay: delay} }
}

type slowHost struct {
	agent.Host
	delay time.Duration
}

func (h slowHost) Open(l agent.Link, key agent.Key, acc agent.Access) (agent.Lease, error) {
	time.Sleep(h.delay)
	return h.Host.Open(l, key, acc)
}
