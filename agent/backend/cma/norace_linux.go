//go:build !race

package cma

// raceBuild is false without the race detector: readQuiet reads with a
// raw read(2) (rawRead).
const raceBuild = false
