package serve

import (
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
)

func TestCheckHandshake(t *testing.T) {
	self, peer, other := uuid.New(), uuid.New(), uuid.New()
	assert.NoError(t, CheckHandshake(self, peer, self))
	assert.EqualError(t, CheckHandshake(self, peer, other), "handshake expected agent "+other.String()+", this is "+self.String())
	assert.EqualError(t, CheckHandshake(self, uuid.Nil, self), "handshake from the nil agent")
	// Another agent expected is reported first, as both backends did.
	assert.ErrorContains(t, CheckHandshake(self, uuid.Nil, other), "expected agent")
	assert.ErrorContains(t, CheckHandshake(self, uuid.Nil, uuid.Nil), "expected agent")
}
