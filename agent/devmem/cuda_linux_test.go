//go:build linux && (amd64 || arm64)

package devmem

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// newMissingCUDA returns a CUDA driver that looks for a library that is
// not there, whatever this machine has.
func newMissingCUDA(t *testing.T) Driver {
	old := libcuda
	libcuda = "libcuda-does-not-exist.so.1"
	t.Cleanup(func() { libcuda = old })
	d := &cudaDriver{}
	_, _ = d.load()
	return d
}

// TestCUDAUnavailable checks the error a machine without the driver gets,
// from every method: a library that cannot be loaded is named.
func TestCUDAUnavailable(t *testing.T) {
	d := newMissingCUDA(t)
	_, err := d.Devices()
	require.ErrorIs(t, err, ErrUnavailable)
	assert.Contains(t, err.Error(), "libcuda-does-not-exist.so.1")
	assert.Contains(t, err.Error(), EnvDevice+"=sim")
	require.ErrorIs(t, d.Check(0x1000, 1, 0), ErrUnavailable)
	_, err = d.Alloc(0, 1)
	require.ErrorIs(t, err, ErrUnavailable)
	require.ErrorIs(t, d.Free(0x1000), ErrUnavailable)
	_, err = d.HostAlloc(1)
	require.ErrorIs(t, err, ErrUnavailable)
	require.ErrorIs(t, d.HostFree([]byte{1}), ErrUnavailable)
	_, err = d.NewStream(0)
	require.ErrorIs(t, err, ErrUnavailable)
	assert.Equal(t, "cuda", d.Name())
}
