package nats

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/connect"
)

// Exposed is what an [ExposeFunc] exposes for one request: the memory,
// and what the [Reply] carries besides its token.
type Exposed struct {
	Kind        connect.OperationKind // connect.KindRead or connect.KindWrite
	Descriptors []connect.Descriptor  // the memory; stays the caller's (see Done)
	Data        []byte                // optional application payload of the reply
	Header      nats.Header           // optional application headers of the reply
	// Options configure the exposure ([connect.WithExpiry],
	// [connect.WithEventBuffer]). Without a WithExpiry among them it
	// expires unused after 30 s, whatever the Connector's own expiry.
	Options []connect.ExposeOption
	// Done, when set, is called once the memory is no longer exposed:
	// with nil when the requester's transfer completed; otherwise with
	// why it ended: the requester's failure, cancellation or release (a
	// [*connect.TransferError]), its departure ([connect.ErrRemoteLost]),
	// the expiry ([connect.ErrExpired]), exposing failed, or the service
	// closed ([connect.ErrClosed]). From then on the memory is the
	// caller's again. It runs on a goroutine the [ExposureService] owns,
	// and must not block for long.
	Done func(err error)
}

// ExposeFunc chooses the memory that answers one request to an
// [ExposureService]. It runs as a [Handler] does, with the same ctx, and
// an error it returns reaches the requester as a Handler's does.
type ExposeFunc func(ctx context.Context, req *ServiceRequest) (*Exposed, error)

// defaultServeExpiry is how long a served exposure waits unused for its
// requester.
const defaultServeExpiry = 30 * time.Second

// ExposureService answers requests by exposing memory; see
// [ServeExposures]. It is safe for concurrent use.
type ExposureService struct {
	*Service // the request/reply side

	conn *connect.Connector
	fn   ExposeFunc

	ctx    context.Context // cancelled by Close: closes what is still exposed
	cancel context.CancelFunc
	wg     sync.WaitGroup // one per exposure until it is closed

	closeOnce sync.Once
	closeErr  error
}

// ServeExposures makes the common serving pattern one call: for each
// request on subject, fn chooses memory, the service exposes it with conn
// ([connect.Connector.Expose]), replies with the token, and closes the
// exposure, calling the Exposed's Done, as soon as the requester's
// transfer completes or fails, the requester releases the token
// ([connect.Connector.Release]) or departs (its loss, as conn's backends
// or a presence registry it joined report it), or the exposure expires
// unused. A transfer that could not start ([connect.ErrNotStarted]) closes
// nothing: the requester may try again. It serves as [Serve] does (queue
// group, concurrency and logger as [Serve]'s, with the same options).
// Each exposure expires unused after 30 s unless the Exposed's Options
// say otherwise. The service owns one goroutine per open exposure, and
// Close closes them.
func ServeExposures(nc *nats.Conn, subject string, conn *connect.Connector, fn ExposeFunc, opts ...ServeOption) (*ExposureService, error) {
	if conn == nil || fn == nil {
		return nil, fmt.Errorf("%w: ServeExposures needs a Connector and an ExposeFunc", ErrInvalidOption)
	}
	s := &ExposureService{conn: conn, fn: fn}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	svc, err := Serve(nc, subject, s.handle, opts...)
	if err != nil {
		s.cancel()
		return nil, err
	}
	s.Service = svc
	return s, nil
}

// handle is the service's Handler.
func (s *ExposureService) handle(ctx context.Context, req *ServiceRequest) (*Reply, error) {
	ex, err := s.fn(ctx, req)
	if err != nil {
		return nil, err
	}
	if ex == nil {
		return nil, errors.New("goxfer/nats: the ExposeFunc returned nothing to expose")
	}
	opts := append([]connect.ExposeOption{connect.WithExpiry(defaultServeExpiry)}, ex.Options...)
	e, err := s.conn.Expose(ctx, ex.Kind, ex.Descriptors, opts...)
	if err != nil {
		if ex.Done != nil {
			ex.Done(err)
		}
		return nil, err
	}
	s.wg.Add(1) // before Service.Close returns, which waits for this handler
	go s.watch(e, ex.Done)
	return &Reply{Metadata: e.Metadata(), Data: ex.Data, Header: ex.Header}, nil
}

// watch closes e at the first outcome it reports, other than a transfer
// that could not start, at its expiry, or when the service closes.
func (s *ExposureService) watch(e *connect.Exposure, done func(error)) {
	defer s.wg.Done()
	outcome := connect.ErrClosed
wait:
	for {
		select {
		case ev, ok := <-e.Events():
			if !ok { // closed: expired, or its Connector closed
				outcome = e.Err()
				break wait
			}
			if errors.Is(ev.Err, connect.ErrNotStarted) {
				continue
			}
			outcome = ev.Err
			break wait
		case <-s.ctx.Done():
			break wait
		}
	}
	if err := e.Close(); err != nil {
		s.log.Warn("goxfer/nats: releasing served memory failed", "subject", s.subject, "err", err)
	}
	if done != nil {
		done(outcome)
	}
}

// Close stops taking requests and waits for the handlers, as
// [Service.Close] does, then closes the exposures still open (their Done
// gets [connect.ErrClosed], unless they ended first) and waits for that.
// It is idempotent and safe for concurrent use; every call returns the
// first call's result.
func (s *ExposureService) Close() error {
	s.closeOnce.Do(func() {
		s.closeErr = s.Service.Close()
		s.cancel()
		s.wg.Wait()
	})
	return s.closeErr
}
