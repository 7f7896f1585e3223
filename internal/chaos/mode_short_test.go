//go:build !soak

package chaos

// defaultRounds is how many rounds each fault kind runs in short mode: one
// round is every operation kind and descriptor shape once.
const defaultRounds = 1
