package serve

import (
	"errors"
	"fmt"

	"github.com/google/uuid"
)

// CheckHandshake is the identity check of a dialler's handshake, the same in
// every backend: the dialler must expect this agent (self), not one that
// used to listen at the address, and must name itself (from) with an
// identity other than the nil one. It returns nil, or an error saying which
// check failed, which the caller wraps in its protocol sentinel, so that
// the drop counts as a HandshakeFailure:
//
//	if err := serve.CheckHandshake(b.id, in.self, in.expect); err != nil {
//		status, err = stDenied, fmt.Errorf("%w: %w", errProtocol, err)
//	}
//
// An identity is only a claim: a backend that limits connections per
// identity counts them per identity and remote address together.
func CheckHandshake(self, from, expect uuid.UUID) error {
	switch {
	case expect != self:
		return fmt.Errorf("handshake expected agent %s, this is %s", expect, self)
	case from == uuid.Nil:
		return errors.New("handshake from the nil agent")
	}
	return nil
}
