package nats

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// createWithin bounds the creation of a missing bucket (a variable for
// tests).
var createWithin = 5 * time.Second

// bindTries is how many times OpenRegistry asks JetStream for the bucket
// when it does not answer within its API timeout.
const bindTries = 3

func bindBucket(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, o options) (jetstream.KeyValue, error) {
	kv, err := js.KeyValue(ctx, o.bucket)
	// A JetStream API left unanswered for its timeout (5 s) is busy, for
	// example creating the bucket for a peer that started at the same
	// moment on a slow disk, or refusing us silently for lack of
	// permission: ask again a bounded number of times, within ctx.
	for try := 1; try < bindTries && errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil; try++ {
		o.logger.Warn("goxfer/nats: binding the registry bucket: no answer from JetStream; asking again", "bucket", o.bucket, "attempt", try+1, "of", bindTries)
		kv, err = js.KeyValue(ctx, o.bucket)
	}
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("%w: bind bucket %q: %w", ErrRegistry, o.bucket, err)
	}
	if !o.createBucket {
		return nil, fmt.Errorf("%w: bucket %q does not exist, and WithCreateBucket(false) forbids creating it", ErrRegistry, o.bucket)
	}
	return createBucket(ctx, nc, js, o)
}

// createBucket creates the missing bucket, or binds it if a racing peer
// created it first.
func createBucket(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, o options) (jetstream.KeyValue, error) {
	// A server that refuses the request for lack of permission does not
	// answer it; do not wait for the caller's whole ctx.
	cctx, cancel := context.WithTimeout(ctx, createWithin)
	defer cancel()
	cfg := jetstream.KeyValueConfig{
		Bucket:      o.bucket,
		Description: "goxfer agent presence registry",
		History:     1,
		TTL:         3 * o.heartbeat,
		Replicas:    o.replicas,
		Storage:     jetstream.FileStorage,
	}
	if o.replicas == 0 {
		cfg.Replicas = 1
		if nc.ConnectedClusterName() != "" {
			cfg.Replicas = clusterReplicas
		}
	}
	kv, err := js.CreateKeyValue(cctx, cfg)
	if o.replicas == 0 && cfg.Replicas > 1 && tooFewServers(err) {
		o.logger.Warn("goxfer/nats: the cluster has too few JetStream servers online to replicate the registry bucket; creating it with 1 replica (set WithReplicas to choose)",
			"bucket", o.bucket, "wanted", cfg.Replicas, "err", err)
		cfg.Replicas = 1
		kv, err = js.CreateKeyValue(cctx, cfg)
	}
	if errors.Is(err, jetstream.ErrBucketExists) {
		kv, err = js.KeyValue(ctx, o.bucket) // created by a racing peer
	}
	if err != nil {
		if le := nc.LastError(); errors.Is(le, nats.ErrPermissionViolation) {
			return nil, fmt.Errorf("%w: bucket %q does not exist and creating it failed: %w (the server reports: %q)", ErrRegistry, o.bucket, err, le)
		}
		return nil, fmt.Errorf("%w: bucket %q does not exist and creating it failed: %w", ErrRegistry, o.bucket, err)
	}
	return kv, nil
}

// clusterReplicas is how many servers of a cluster store a registry bucket
// by default: a quorum survives the loss of one.
const clusterReplicas = 3

// JetStream's error codes for a stream it cannot place: fewer servers
// online than replicas asked for.
const (
	jsNoSuitablePeers       = 10005 // "no suitable peers for placement"
	jsInsufficientResources = 10023 // "insufficient resources"
)

// tooFewServers says whether err is JetStream's refusal to place a stream
// for lack of servers.
func tooFewServers(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == jsNoSuitablePeers || apiErr.ErrorCode == jsInsufficientResources)
}

// bucketGoneErr says whether err means the bucket does not exist.
func bucketGoneErr(err error) bool {
	return errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, jetstream.ErrBucketNotFound)
}

// bucketGone says whether the bucket is missing from the server.
func (r *Registry) bucketGone() bool {
	ctx, cancel := context.WithTimeout(r.ctx, createWithin)
	defer cancel()
	_, err := r.js.KeyValue(ctx, r.bucket)
	return errors.Is(err, jetstream.ErrBucketNotFound)
}

// bucketCreated returns when the bucket's stream was created; it tells a
// bucket created anew under the same name from the one watched.
func (r *Registry) bucketCreated(ctx context.Context) (time.Time, error) {
	st, err := r.kv.Status(ctx)
	if err != nil {
		return time.Time{}, err
	}
	return streamCreated(st), nil
}

// streamCreated returns when the stream of the bucket whose status is st
// was created; zero if st does not say.
func streamCreated(st jetstream.KeyValueStatus) time.Time {
	if s, ok := st.(interface{ StreamInfo() *jetstream.StreamInfo }); ok && s.StreamInfo() != nil {
		return s.StreamInfo().Created
	}
	return time.Time{}
}

// recreateBucket creates the bucket again after it vanished (the server
// lost its store), if the registry may create it.
func (r *Registry) recreateBucket() error {
	if !r.o.createBucket {
		return errors.New("the bucket vanished, and WithCreateBucket(false) forbids re-creating it; create it again")
	}
	if _, err := createBucket(r.ctx, r.nc, r.js, r.o); err != nil {
		return err
	}
	r.log.Warn("goxfer/nats: registry bucket vanished (did the server lose its JetStream store?); re-created it and re-joined the members",
		"bucket", r.bucket)
	return nil
}
