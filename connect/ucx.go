package connect

import (
	"github.com/goxfer/goxfer/agent/backend/ucx"
)

// WithUCX adds the UCX backend (agent/backend/ucx) to the default
// backends, configured by opts, for example ucx.WithTransports("rc,sm,self")
// for InfiniBand. It goes after cma and before tcp: mem > cma > ucx > tcp.
// On one host cma copies once, straight between the two processes' memories,
// with no server involvement, which is what UCX's own shared-memory paths
// do at best; across hosts UCX's RDMA and its tcp transport take the place
// of goxfer's own TCP backend, which stays last as the fallback for peers
// without UCX. The option may be given more than once; options accumulate.
// It conflicts with WithBackends, which replaces the defaults.
//
// UCX is compiled in only with the build tag ucx (against libucx-dev, UCX
// 1.13+); without it NewConnector fails with an error wrapping
// ucx.ErrNotBuiltIn. Invalid UCX options fail NewConnector with an error
// matching ErrInvalidOption.
//
// Default: no UCX backend.
func WithUCX(opts ...ucx.Option) Option {
	return optionFunc(func(o *options) error {
		if err := ucx.CheckOptions(opts...); err != nil {
			return err
		}
		o.ucx = append(o.ucx, opts...)
		if o.ucx == nil {
			o.ucx = []ucx.Option{}
		}
		return nil
	})
}
