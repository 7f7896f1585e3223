package tcp

// StagesDevice reports true: tcp touches a peer's memory only through the
// leases the peer's agent grants, one per frame, so that agent stages its
// device memory through pinned host buffers ([agent.DeviceStager]). Local
// device memory is staged by this side's agent, chunk by chunk, before tcp
// sees it.
func (b *Backend) StagesDevice() bool { return true }
