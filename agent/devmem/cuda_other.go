//go:build !(linux && (amd64 || arm64))

package devmem

import (
	"errors"
	"runtime"
)

type cudaAPI struct{}

func loadCUDA() (*cudaAPI, error) {
	return nil, errors.New("goxfer binds the CUDA driver on linux/amd64 and linux/arm64 only, not on " + runtime.GOOS + "/" + runtime.GOARCH)
}

func (d *cudaDriver) Devices() (int, error) {
	_, err := d.load()
	return 0, err
}

func (d *cudaDriver) Check(uintptr, uint64, int) error {
	_, err := d.load()
	return err
}

func (d *cudaDriver) Alloc(int, int) (uintptr, error) {
	_, err := d.load()
	return 0, err
}

func (d *cudaDriver) Free(uintptr) error {
	_, err := d.load()
	return err
}

func (d *cudaDriver) HostAlloc(int) ([]byte, error) {
	_, err := d.load()
	return nil, err
}

func (d *cudaDriver) HostFree([]byte) error {
	_, err := d.load()
	return err
}

func (d *cudaDriver) NewStream(int) (Stream, error) {
	_, err := d.load()
	return nil, err
}

type cudaVMM struct{}

type cudaMapping struct{}

func (d *cudaDriver) Export(uintptr, int) (Share, error) {
	_, err := d.load()
	return Share{}, err
}

func (d *cudaDriver) Import(Share, int) (Mapping, error) {
	_, err := d.load()
	return nil, err
}

func (d *cudaDriver) AllocShareable(int, int) (uintptr, error) {
	_, err := d.load()
	return 0, err
}
