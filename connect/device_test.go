package connect

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseDevice(t *testing.T) {
	tests := []struct {
		in      string
		want    Device
		wantErr string
	}{
		{in: "cpu", want: Host()},
		{in: "host", want: Host()},
		{in: "HOST", want: Host()},
		{in: "cuda", want: CUDA(0)},
		{in: "cuda:0", want: CUDA(0)},
		{in: "cuda:7", want: CUDA(7)},
		{in: "CUDA:12", want: CUDA(12)},
		{in: "cuda:2147483647", want: CUDA(2147483647)},
		{in: "", wantErr: `connect: device "": want "cpu", "host", "cuda" or "cuda:N"`},
		{in: "gpu", wantErr: `connect: device "gpu": want "cpu", "host", "cuda" or "cuda:N"`},
		{in: "cpu:0", wantErr: `connect: device "cpu:0": host memory takes no ordinal`},
		{in: "cuda:", wantErr: `connect: device "cuda:": want a GPU ordinal in [0, 2147483647] after "cuda:", found ""`},
		{in: "cuda:-1", wantErr: `connect: device "cuda:-1": want a GPU ordinal in [0, 2147483647] after "cuda:", found "-1"`},
		{in: "cuda:x", wantErr: `connect: device "cuda:x": want a GPU ordinal in [0, 2147483647] after "cuda:", found "x"`},
		{in: "cuda:2147483648", wantErr: `connect: device "cuda:2147483648": want a GPU ordinal in [0, 2147483647] after "cuda:", found "2147483648"`},
		{in: " cuda:1", wantErr: `connect: device " cuda:1": want "cpu", "host", "cuda" or "cuda:N"`},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			d, err := ParseDevice(tt.in)
			if tt.wantErr != "" {
				require.EqualError(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, d)
			back, err := ParseDevice(d.String())
			require.NoError(t, err)
			assert.Equal(t, d, back, "String and ParseDevice round-trip")
		})
	}
}

func TestDeviceString(t *testing.T) {
	assert.Equal(t, "host", Host().String())
	assert.Equal(t, "host", Device{}.String())
	assert.Equal(t, "cuda:3", CUDA(3).String())
	assert.Equal(t, "host:2", Device{Kind: DeviceHost, ID: 2}.String())
	assert.Equal(t, "DeviceKind(7):0", Device{Kind: 7}.String())
	assert.Equal(t, "cuda", DeviceCUDA.String())
}

func TestDescriptor(t *testing.T) {
	buf := make([]byte, 100)
	d := NewDescriptor(buf)
	assert.Equal(t, 100, d.Size())
	assert.Equal(t, Host(), d.Device())
	assert.Same(t, &buf[0], &d.Bytes()[0], "Bytes aliases the buffer")

	g := NewDeviceDescriptor(0x7000, 4096, CUDA(1))
	assert.Equal(t, 4096, g.Size())
	assert.Equal(t, CUDA(1), g.Device())
	assert.Nil(t, g.Bytes(), "GPU memory has no host bytes")
	l, err := g.local()
	require.NoError(t, err)
	assert.EqualValues(t, 0x7000, l.Addr)
	assert.EqualValues(t, 4096, l.Len)
	assert.EqualValues(t, 1, l.Device)
	assert.Nil(t, l.Mem)

	for _, bad := range []Device{{Kind: DeviceHost, ID: 1}, {Kind: 9}, CUDA(-2)} {
		_, err := NewDeviceDescriptor(0x7000, 1, bad).local()
		assert.ErrorContains(t, err, "does not exist", "device %v", bad)
	}
}
