package devmem

// CUDA returns the process's CUDA driver, loaded at its first use.
// PLACEHOLDER: replaced by the purego binding.
func CUDA() Driver { return nil }
