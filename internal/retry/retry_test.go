package retry

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestUntilStopsAtTheFirstHit(t *testing.T) {
	calls := 0
	Until(t, 5, func(t *testing.T) bool {
		calls++
		assert.Equal(t, "TestUntilStopsAtTheFirstHit/attempt"+string(rune('0'+calls)), t.Name())
		return calls == 3
	})
	assert.Equal(t, 3, calls)
}
