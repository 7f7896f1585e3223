package main

import "syscall"

// workerProcAttr puts a worker in a process group of its own, so that a
// Ctrl-C in the terminal reaches only the orchestrator, which passes it on
// once, in order; and has the kernel send the worker SIGTERM should the
// orchestrator die without stopping it, so that no worker outlives it.
func workerProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
}
