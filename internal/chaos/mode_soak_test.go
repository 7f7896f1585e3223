//go:build soak

package chaos

// defaultRounds is how many rounds each fault kind runs under the soak tag.
const defaultRounds = 25
