package serve

import (
	"slices"
	"sync"
	"testing"
	"testing/synctest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSetMembers(t *testing.T) {
	var s Set[int] // the zero Set is ready
	assert.Zero(t, s.Len())
	assert.Empty(t, s.Members())
	require.True(t, s.Add(1))
	require.True(t, s.Add(2))
	require.True(t, s.Add(2))
	assert.Equal(t, 2, s.Len(), "a member added twice is tracked once")
	m := s.Members()
	slices.Sort(m)
	assert.Equal(t, []int{1, 2}, m)
	m[0] = 99 // a copy
	s.Remove(1)
	s.Remove(7) // not a member: nothing happens
	assert.Equal(t, []int{2}, s.Members())
	assert.False(t, s.Stopping())
}

// Stop refuses new members and goroutines from then on, hands back the
// members once, and closes Done.
func TestSetStop(t *testing.T) {
	var s Set[string]
	done := s.Done()
	s.Add("a")
	s.Add("b")
	m, first := s.Stop()
	require.True(t, first)
	slices.Sort(m)
	assert.Equal(t, []string{"a", "b"}, m)
	assert.True(t, s.Stopping())
	select {
	case <-done:
	default:
		t.Fatal("Done is open after Stop")
	}
	<-s.Done() // made after Stop: closed too

	assert.False(t, s.Add("c"))
	assert.False(t, s.Go(func() { t.Error("ran after Stop") }))
	assert.False(t, s.Serve("d", func(string) { t.Error("served after Stop") }))
	assert.Equal(t, 2, s.Len(), "members stay until removed")
	m, first = s.Stop()
	assert.False(t, first)
	assert.Empty(t, m)
	s.Wait() // nothing running
}

// Serve tracks a connection while its goroutine runs; Wait waits for the
// goroutines that Go and Serve started, and only once the set is stopped.
func TestSetServeAndWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var s Set[int]
		release := make(chan struct{})
		seen := make(chan int, 2)
		require.True(t, s.Serve(1, func(c int) { seen <- c; <-release }))
		require.True(t, s.Go(func() { <-release }))
		synctest.Wait()
		assert.Equal(t, 1, <-seen)
		assert.Equal(t, []int{1}, s.Members(), "served while its goroutine runs")

		waited := make(chan struct{})
		go func() {
			s.Wait()
			close(waited)
		}()
		synctest.Wait()
		assert.False(t, returned(waited), "Wait returned before Stop")

		m, _ := s.Stop()
		assert.Equal(t, []int{1}, m)
		synctest.Wait()
		assert.False(t, returned(waited), "Wait returned with goroutines running")

		close(release)
		synctest.Wait()
		assert.True(t, returned(waited))
		assert.Zero(t, s.Len(), "a served connection leaves with its goroutine")
	})
}

// Wait before Stop, with nothing running, waits for Stop.
func TestSetWaitWaitsForStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var s Set[int]
		waited := make(chan struct{})
		go func() {
			s.Wait()
			close(waited)
		}()
		synctest.Wait()
		assert.False(t, returned(waited))
		s.Stop()
		synctest.Wait()
		assert.True(t, returned(waited))
	})
}

// A served connection removed early is not handed back by Stop, and its
// goroutine's end removes nothing else.
func TestSetRemoveWhileServing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var s Set[int]
		release := make(chan struct{})
		s.Serve(1, func(c int) {
			s.Remove(c) // as cma's reader does: its connection is closed another way
			<-release
		})
		s.Add(2)
		synctest.Wait()
		m, _ := s.Stop()
		assert.Equal(t, []int{2}, m)
		close(release)
		s.Wait()
		assert.Equal(t, []int{2}, s.Members())
	})
}

// A goroutine of the set may start others until the set stops, and is
// refused after, like anyone.
func TestSetGoFromItsGoroutines(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var s Set[int]
		step := make(chan struct{})
		results := make(chan bool, 2)
		s.Go(func() {
			results <- s.Go(func() {})
			<-step
			results <- s.Go(func() { t.Error("ran after Stop") })
		})
		synctest.Wait()
		s.Stop()
		close(step)
		s.Wait()
		assert.True(t, <-results)
		assert.False(t, <-results)
	})
}

// Stop, Serve, Go and Wait race without losing a goroutine: every one that
// was accepted ran and was waited for.
func TestSetConcurrent(t *testing.T) {
	for range 20 {
		var s Set[int]
		var mu sync.Mutex
		started, finished := 0, 0
		var wg sync.WaitGroup
		for w := range 8 {
			wg.Go(func() {
				for i := range 50 {
					ok := s.Serve(w*1000+i, func(int) {
						mu.Lock()
						finished++
						mu.Unlock()
					})
					if ok {
						mu.Lock()
						started++
						mu.Unlock()
					}
				}
			})
		}
		wg.Go(func() { s.Stop() })
		wg.Wait()
		s.Wait()
		mu.Lock()
		assert.Equal(t, started, finished)
		mu.Unlock()
		assert.Zero(t, s.Len())
	}
}

// Admit enters the gate and serves the connection until Stop; from Stop on
// it refuses, and a refused admission evicts nothing: the connections in
// their handshake are the stopping backend's to close, not a newcomer's to
// evict and count.
func TestSetAdmit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var s Set[*closeConn]
		g := NewGate(1)
		release := make(chan struct{})
		passes := make(chan *Pass, 2)
		serve := func(c *closeConn, p *Pass) {
			passes <- p
			<-release
		}
		a, b, c := &closeConn{}, &closeConn{}, &closeConn{}

		evicted, ok := s.Admit(g, a, a, serve)
		require.True(t, ok)
		assert.False(t, evicted)
		pa := <-passes
		assert.Equal(t, 1, g.Len())

		evicted, ok = s.Admit(g, b, b, serve)
		require.True(t, ok)
		assert.True(t, evicted, "the gate of one was full")
		pb := <-passes
		assert.Equal(t, 1, a.closes(), "the oldest handshake is closed by Admit")
		assert.False(t, pa.Done(), "and its pass says so")
		assert.Zero(t, b.closes())
		assert.Equal(t, 1, g.Len(), "b is inside")

		m, _ := s.Stop()
		assert.ElementsMatch(t, []*closeConn{a, b}, m, "served while their goroutines run")

		evicted, ok = s.Admit(g, c, c, func(*closeConn, *Pass) { t.Error("served after Stop") })
		assert.False(t, ok, "admitted after Stop")
		assert.False(t, evicted, "a refused admission evicted a handshake")
		assert.Zero(t, b.closes(), "the handshake inside was closed by a refused admission")
		assert.Zero(t, c.closes(), "a refused connection stays the caller's to close")
		assert.Equal(t, 1, g.Len(), "a refused admission entered the gate")
		assert.True(t, pb.Done(), "b is still inside, never evicted")
		assert.Equal(t, 2, s.Len(), "a refused connection is not tracked")

		close(release)
		s.Wait()
		assert.Zero(t, s.Len())
		assert.Zero(t, g.Len())
	})
}

// Admit racing Stop: every connection admitted is handed back by Stop (none
// escapes it, served by nobody), every one refused evicted nothing, and
// each eviction closed exactly one connection.
func TestSetAdmitRacingStop(t *testing.T) {
	for range 50 {
		var s Set[*closeConn]
		g := NewGate(4)
		release := make(chan struct{})
		var mu sync.Mutex
		admitted := map[*closeConn]bool{}
		var all []*closeConn
		evictions := 0
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for range 20 {
					c := &closeConn{}
					evicted, ok := s.Admit(g, c, c, func(*closeConn, *Pass) { <-release })
					mu.Lock()
					all = append(all, c)
					if ok {
						admitted[c] = true
					}
					if evicted {
						evictions++
					}
					mu.Unlock()
					if !ok && evicted {
						t.Error("a refused admission evicted a connection")
					}
				}
			})
		}
		var members []*closeConn
		wg.Go(func() { members, _ = s.Stop() })
		wg.Wait()
		assert.Len(t, members, len(admitted), "Stop did not hand back every admitted connection")
		for _, c := range members {
			assert.True(t, admitted[c], "Stop handed back a connection never admitted")
		}
		closes := 0
		for _, c := range all {
			closes += c.closes()
			if !admitted[c] {
				assert.Zero(t, c.closes(), "a refused connection was closed by Admit")
			}
		}
		assert.Equal(t, evictions, closes, "each eviction closes one connection")
		close(release)
		s.Wait()
	}
}
