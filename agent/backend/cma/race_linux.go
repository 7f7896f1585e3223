//go:build race

package cma

// raceBuild is true in a binary built with the race detector (the race
// build tag): readQuiet then reads through syscall.Read, whose
// annotations the detector needs (rawRead).
const raceBuild = true
