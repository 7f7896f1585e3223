//go:build race

package soak

// raceEnabled: the race detector keeps shadow memory for every heap page
// the run touched, and does not give it back when the heap does, so RSS
// under -race shows the peak, not what is live.
const raceEnabled = true
