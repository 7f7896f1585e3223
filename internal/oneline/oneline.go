// Package oneline joins errors as errors.Join does, into an error whose
// text is one line: log lines and messages shown to users stay whole.
package oneline

import "strings"

// Join returns an error that wraps the non-nil errs, for errors.Is and
// errors.As as errors.Join's does, and whose text is theirs joined by
// "; ", any newline within them replaced by "; " too. It returns nil if
// every err is nil, and the one error itself if only one is not nil.
func Join(errs ...error) error {
	n := 0
	for _, err := range errs {
		if err != nil {
			n++
		}
	}
	if n == 0 {
		return nil
	}
	e := &joined{errs: make([]error, 0, n)}
	for _, err := range errs {
		if err != nil {
			e.errs = append(e.errs, err)
		}
	}
	if n == 1 && !strings.Contains(e.errs[0].Error(), "\n") {
		return e.errs[0]
	}
	return e
}

type joined struct{ errs []error }

func (e *joined) Error() string {
	var b strings.Builder
	for i, err := range e.errs {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(Text(err))
	}
	return b.String()
}

func (e *joined) Unwrap() []error { return e.errs }

// Text returns err's text on one line: each newline, with the spaces
// around it, becomes "; ". It returns "" for a nil err.
func Text(err error) string {
	if err == nil {
		return ""
	}
	s := err.Error()
	if !strings.Contains(s, "\n") {
		return s
	}
	lines := strings.Split(s, "\n")
	kept := lines[:0]
	for _, l := range lines {
		if l = strings.TrimSpace(l); l != "" {
			kept = append(kept, l)
		}
	}
	return strings.Join(kept, "; ")
}
