package nats

import (
	"fmt"
	"time"

	"github.com/google/uuid"
)

// expire declares departed every agent silent for two of its heartbeats,
// and returns those it cannot judge yet (suspects), and the one that has
// waited longest for a verdict, for how long past its deadline.
//
// Silence by this machine's clock is not enough when the path from the
// server to this process lags (the server or this process starved, a
// congested link): the heartbeats are late, not missing; nor when the
// watch went deaf without saying so (the bucket was deleted and created
// anew under it). So a silent agent is a suspect until one of two answers
// comes: one of this process's own heartbeats, sent two heartbeats after
// the agent was last heard, comes back through the watch (the agent's puts
// due before it would have been stored, and heard, first; the Members put
// at once when there are suspects, so the answer comes within a round
// trip), or a store check sent after then finds the agent's key still
// holding its last put heard, or none (see storeCheck). A Registry never
// judges its own joined Members: they are present while joined, and Err
// reports their failing heartbeats.
func (r *Registry) expire(now time.Time) (suspects []uuid.UUID, longest uuid.UUID, waited time.Duration) {
	r.mu.Lock()
	var gone []uuid.UUID
	for id, p := range r.live {
		deadline := p.heard.Add(2 * p.hb)
		switch {
		case now.Before(deadline) || r.ownLocked(id):
		case !r.echoAt.Before(deadline):
			gone = append(gone, id)
		default:
			p.suspect = true
			suspects = append(suspects, id)
			if w := now.Sub(deadline); w > stuckAfter*p.hb && w > waited {
				longest, waited = id, w
			}
		}
	}
	r.mu.Unlock()
	if len(suspects) > 0 {
		r.pokeMembers()
	}
	for _, id := range gone {
		r.depart(id, "silent", 0)
	}
	return suspects, longest, waited
}

// ownLocked says whether id is a joined Member's; r.mu is held.
func (r *Registry) ownLocked(id uuid.UUID) bool {
	for m := range r.members {
		if m.id == id && m.joined.Load() {
			return true
		}
	}
	return false
}

// restartSilence counts every live agent's silence from at, after a
// period in which nobody could be heard.
func (r *Registry) restartSilence(at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.restartSilenceLocked(at)
}

// restartSilenceLocked is restartSilence; r.mu is held.
func (r *Registry) restartSilenceLocked(at time.Time) {
	// Judge nobody before a heartbeat sent now comes back.
	r.echoAt = time.Time{}
	for _, p := range r.live {
		if at.After(p.heard) {
			p.heard = at
		}
		p.suspect = false
	}
}

// credit adds lost, a time in which the registry did not run, to every
// live agent's allowance of silence, up to now.
func (r *Registry) credit(lost time.Duration, now time.Time) {
	r.mu.Lock()
	var shortest time.Duration
	for _, p := range r.live {
		if p.heard.Before(now) {
			p.heard = p.heard.Add(lost)
			if p.heard.After(now) {
				p.heard = now
			}
		}
		if shortest == 0 || p.hb < shortest {
			shortest = p.hb
		}
	}
	r.mu.Unlock()
	if shortest > 0 && lost >= shortest {
		r.log.Warn("goxfer/nats: registry did not run for a while (process paused or starved); that time counts as nobody's silence",
			"bucket", r.bucket, "lost", lost)
	}
}

// nextExpiry returns when the first live agent's silence would make it
// departed (zero if all are suspects), and the shortest heartbeat among
// the live agents; ok is false when there are none.
func (r *Registry) nextExpiry() (next time.Time, shortest time.Duration, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, p := range r.live {
		// A suspect is judged when an answer comes, or at the next check.
		if t := p.heard.Add(2 * p.hb); !p.suspect && !r.ownLocked(id) && (next.IsZero() || t.Before(next)) {
			next = t
		}
		if shortest == 0 || p.hb < shortest {
			shortest = p.hb
		}
	}
	return next, shortest, shortest > 0
}

// stuckAfter is how many of its heartbeats past its deadline a suspect
// may wait for a verdict before Err says presence lags.
const stuckAfter = 8

// setStuck records that a suspect has waited for a verdict for long (nil:
// none has).
func (r *Registry) setStuck(err error) {
	r.mu.Lock()
	r.stuckErr = err
	r.mu.Unlock()
}

func stuckError(id uuid.UUID, waited time.Duration, lastErr error) error {
	if lastErr != nil {
		return fmt.Errorf("agent %s is silent, and for %v neither an echo of this process's heartbeats nor the store (last: %w) has confirmed it departed", id, waited.Round(time.Millisecond), lastErr)
	}
	return fmt.Errorf("agent %s is silent, and for %v neither an echo of this process's heartbeats nor the store has confirmed it departed", id, waited.Round(time.Millisecond))
}
