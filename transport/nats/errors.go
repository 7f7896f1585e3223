package nats

import (
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
)

// Sentinel errors, matched with [errors.Is].
var (
	// ErrNoResponders reports a request to a subject that no worker serves.
	// Errors that match it also match [nats.ErrNoResponders].
	ErrNoResponders = errors.New("goxfer/nats: no worker serves the subject")
	// ErrHandler reports a request that the worker's [Handler] failed; the
	// error is a [*HandlerError].
	ErrHandler = errors.New("goxfer/nats: handler failed")
	// ErrPayloadTooLarge reports a message larger than the server accepts;
	// the error is a [*PayloadTooLargeError] and nothing was sent.
	ErrPayloadTooLarge = errors.New("goxfer/nats: message exceeds the server's max payload")
	// ErrClosed reports use of a closed [Service], [Subscription],
	// [Registry] or [Member], or a [Registry.Join] cut short by
	// [Registry.Close].
	ErrClosed = errors.New("goxfer/nats: closed")
	// ErrInvalidOption reports an invalid or nil option, or a nil connection,
	// [Handler] or Connector.
	ErrInvalidOption = errors.New("goxfer/nats: invalid option")
	// ErrUnknownAgent reports an agent ID that [Registry.Resolve] finds
	// neither in its table nor in the bucket.
	ErrUnknownAgent = errors.New("goxfer/nats: unknown agent")
	// ErrRegistry reports a presence registry that cannot work: a bucket
	// that [OpenRegistry] could not bind, watch or create, or what
	// [Registry.Err] finds failing now.
	ErrRegistry = errors.New("goxfer/nats: presence registry unavailable")
)

// Error codes a HandlerError carries (header Goxfer-Error-Code).
const (
	codeHandler     = "handler"
	codeBadRequest  = "bad-request"
	codeUnavailable = "unavailable"
	codeTimeout     = "timeout"
)

// HandlerError is a worker's [Handler] failure as the requester sees it:
// [Request] returns it, and the caller owns it. A Handler may also return
// one itself to choose the Code the requester gets (Subject is then set at
// the requester). It matches [ErrHandler] with [errors.Is].
type HandlerError struct {
	Subject string // the subject the request was sent to
	// Code classifies the failure: "handler" (the default: the Handler
	// returned an error or panicked), "bad-request" (the request was
	// malformed), "unavailable" (the worker was shutting down and did not
	// run the Handler; safe to retry) or "timeout" (the Handler ran out of
	// time). Unknown codes from newer peers are passed through.
	Code    string
	Message string // the Handler's error message, as the worker sent it
}

// Error returns a message naming the subject, the code and the handler's
// message; the code and the message come from the worker, and are quoted.
func (e *HandlerError) Error() string {
	code := e.Code
	if code == "" {
		code = codeHandler
	}
	if e.Subject == "" {
		return fmt.Sprintf("goxfer/nats: handler error (code %q): %q", code, e.Message)
	}
	return fmt.Sprintf("goxfer/nats: handler for subject %q failed (code %q): %q", e.Subject, code, e.Message)
}

// Is reports whether target is [ErrHandler].
func (e *HandlerError) Is(target error) bool { return target == ErrHandler }

// PayloadTooLargeError reports a message of Size bytes (headers and body)
// that exceeds the server's max payload of Max bytes ([nats.Conn.MaxPayload]).
// Nothing was sent. The caller owns it. It matches [ErrPayloadTooLarge]
// with [errors.Is].
type PayloadTooLargeError struct {
	Subject string
	Size    int64
	Max     int64
}

// Error returns a message giving both sizes and the subject.
func (e *PayloadTooLargeError) Error() string {
	return fmt.Sprintf("goxfer/nats: token message of %d bytes exceeds the server's max payload of %d bytes (subject %q)", e.Size, e.Max, e.Subject)
}

// Is reports whether target is [ErrPayloadTooLarge].
func (e *PayloadTooLargeError) Is(target error) bool { return target == ErrPayloadTooLarge }

// noRespondersError names the subject nobody serves; it matches both
// [ErrNoResponders] and [nats.ErrNoResponders], and cause if set.
type noRespondersError struct {
	subject  string
	attempts int
	// Set when ctx ended the retries: how long they took, and why.
	waited time.Duration
	cause  error
}

func (e *noRespondersError) Error() string {
	switch {
	case e.cause != nil:
		return fmt.Sprintf("goxfer/nats: no worker serves subject %q: no responders in %d attempts over %v, then %v", e.subject, e.attempts, e.waited.Round(time.Millisecond), e.cause)
	case e.attempts > 1:
		return fmt.Sprintf("goxfer/nats: no worker serves subject %q (%d attempts)", e.subject, e.attempts)
	}
	return fmt.Sprintf("goxfer/nats: no worker serves subject %q", e.subject)
}

func (e *noRespondersError) Is(target error) bool { return target == ErrNoResponders }

func (e *noRespondersError) Unwrap() []error {
	if e.cause == nil {
		return []error{nats.ErrNoResponders}
	}
	return []error{nats.ErrNoResponders, e.cause}
}

// ctxError wraps a context's error with the subject and how long the call
// waited.
func ctxError(subject string, start time.Time, attempts int, err error) error {
	tries := ""
	if attempts > 1 {
		tries = fmt.Sprintf(", %d attempts", attempts)
	}
	return fmt.Errorf("goxfer/nats: request to subject %q: no reply after %v%s: %w", subject, time.Since(start).Round(time.Millisecond), tries, err)
}
