//go:build ucx

package ucx

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSysvBesidePosix(t *testing.T) {
	for tls, want := range map[string]string{
		"posix,self":      "posix,self,sysv",
		`\posix,self`:     `\posix,self,sysv`,
		"posix,sysv,self": "",
		"sm,self":         "",
		"tcp,self":        "",
		"^tcp":            "",
		"all":             "",
		"":                "",
	} {
		got, ok := sysvBesidePosix(tls)
		require.Equal(t, want != "", ok, tls)
		if ok {
			require.Equal(t, want, got, tls)
		}
	}
	t.Setenv("UCX_TLS", "posix,self")
	c, err := newConfig(nil)
	require.NoError(t, err)
	require.Equal(t, "posix,self,sysv", c.ucxTLS())
	c, err = newConfig([]Option{WithSysvBesidePosix(false)})
	require.NoError(t, err)
	require.Equal(t, "", c.ucxTLS())
	c, err = newConfig([]Option{WithTransports("tcp,self")})
	require.NoError(t, err)
	require.Equal(t, "tcp,self", c.ucxTLS())
}
