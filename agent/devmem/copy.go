package devmem

import "github.com/goxfer/goxfer/internal/oneline"

// CopyToDevice copies src into device memory at dst on GPU dev and waits
// for the copy: for tests, benchmarks and examples that fill device memory.
func CopyToDevice(d Driver, dev int, dst uintptr, src []byte) error {
	st, err := d.NewStream(dev)
	if err != nil {
		return err
	}
	err = st.ToDevice(dst, src)
	return oneline.Join(err, st.Close())
}

// CopyToHost copies len(dst) bytes of device memory at src on GPU dev
// into dst and waits for the copy.
func CopyToHost(d Driver, dev int, dst []byte, src uintptr) error {
	st, err := d.NewStream(dev)
	if err != nil {
		return err
	}
	err = st.ToHost(dst, src)
	return oneline.Join(err, st.Close())
}

// CopyDevice copies n bytes of device memory from src to dst on a stream
// of GPU dev and waits for the copy.
func CopyDevice(d Driver, dev int, dst, src uintptr, n int) error {
	st, err := d.NewStream(dev)
	if err != nil {
		return err
	}
	err = st.Copy(dst, src, n)
	return oneline.Join(err, st.Close())
}
