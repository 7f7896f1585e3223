package connect

import (
	"github.com/goxfer/goxfer/agent/backend/ucx"
)

// WithUCX adds the UCX backend, configured by opts (for example
// [ucx.WithTransports]), to the defaults between cma and tcp. It needs the
// build tag ucx: without it [NewConnector] fails with [ucx.ErrNotBuiltIn].
// Options accumulate; it conflicts with [WithBackends].
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
