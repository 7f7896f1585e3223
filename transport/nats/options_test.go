package nats

import (
	"context"
	"reflect"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestOptionsRejectInvalidValues(t *testing.T) {
	check := func(name string, err error) {
		t.Helper()
		assert.ErrorIs(t, err, ErrInvalidOption, name)
	}
	for _, opt := range []ServeOption{WithQueue(""), WithConcurrency(0), WithLogger(nil), nil} {
		_, err := applyOptions(defaults(), []ServeOption{opt}, ServeOption.applyServe)
		check("Serve", err)
	}
	for _, opt := range []RequestOption{WithTimeout(0), WithRetry(0), WithAttemptTimeout(-1), nil} {
		_, err := applyOptions(defaults(), []RequestOption{opt}, RequestOption.applyRequest)
		check("Request", err)
	}
	for _, opt := range []PublishOption{WithTimeout(-1), nil} {
		_, err := applyOptions(defaults(), []PublishOption{opt}, PublishOption.applyPublish)
		check("Publish", err)
	}
	for _, opt := range []SubscribeOption{WithQueue(""), nil} {
		_, err := applyOptions(defaults(), []SubscribeOption{opt}, SubscribeOption.applySubscribe)
		check("Subscribe", err)
	}
	for _, opt := range []RegistryOption{WithLogger(nil), WithBucket("a.b"), WithBucket(""), WithHeartbeat(0), WithHeartbeat(2 * maxHeartbeat), WithReplicas(0), nil} {
		_, err := applyOptions(defaults(), []RegistryOption{opt}, RegistryOption.applyRegistry)
		check("OpenRegistry", err)
	}
	for _, opt := range []JoinOption{WithHeartbeat(0), nil} {
		_, err := applyOptions(defaults(), []JoinOption{opt}, JoinOption.applyJoin)
		check("Join", err)
	}
	_, err := Request(context.Background(), nil, "x", nil)
	check("Request without a connection", err)
}

// Each option's type lets exactly the calls that honour it take it: any
// other call does not compile.
func TestOptionTypesMatchTheCallsThatHonourThem(t *testing.T) {
	calls := map[string]reflect.Type{
		"Serve":        reflect.TypeFor[ServeOption](),
		"Request":      reflect.TypeFor[RequestOption](),
		"Publish":      reflect.TypeFor[PublishOption](),
		"Subscribe":    reflect.TypeFor[SubscribeOption](),
		"OpenRegistry": reflect.TypeFor[RegistryOption](),
		"Join":         reflect.TypeFor[JoinOption](),
	}
	// Each call's variadic parameter is its option type.
	for name, fn := range map[string]any{"Serve": Serve, "Request": Request, "Publish": Publish, "Subscribe": Subscribe, "OpenRegistry": OpenRegistry, "Join": (*Registry).Join} {
		ft := reflect.TypeOf(fn)
		assert.Equal(t, calls[name], ft.In(ft.NumIn()-1).Elem(), name)
	}
	honoured := []struct {
		option any // the constructor
		calls  []string
	}{
		{WithQueue, []string{"Serve", "Subscribe"}},
		{WithConcurrency, []string{"Serve"}},
		{WithHeader, []string{"Request", "Publish"}},
		{WithTimeout, []string{"Request", "Publish"}},
		{WithRetry, []string{"Request"}},
		{WithAttemptTimeout, []string{"Request"}},
		{WithLogger, []string{"Serve", "OpenRegistry"}},
		{WithBucket, []string{"OpenRegistry"}},
		{WithHeartbeat, []string{"OpenRegistry", "Join"}},
		{WithCreateBucket, []string{"OpenRegistry"}},
		{WithReplicas, []string{"OpenRegistry"}},
	}
	for _, h := range honoured {
		out := reflect.TypeOf(h.option).Out(0)
		for call, it := range calls {
			assert.Equal(t, slices.Contains(h.calls, call), out.Implements(it), "%v taken by %s", out, call)
		}
	}
}
