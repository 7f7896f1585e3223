//go:build !linux

package main

import "syscall"

// workerProcAttr leaves the workers in the orchestrator's process group
// outside Linux: a Ctrl-C reaches them directly as well as through the
// orchestrator, and the second signal ends them at once.
func workerProcAttr() *syscall.SysProcAttr { return nil }
