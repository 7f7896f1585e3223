package oneline_test

import (
	"errors"
	"io"
	"io/fs"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goxfer/goxfer/internal/oneline"
)

type codeError struct{ code int }

func (e *codeError) Error() string { return "code error" }

func TestJoin(t *testing.T) {
	assert.NoError(t, oneline.Join())
	assert.NoError(t, oneline.Join(nil, nil))
	assert.Same(t, io.EOF, oneline.Join(nil, io.EOF, nil), "one error is itself")

	ce := &codeError{code: 7}
	err := oneline.Join(io.EOF, nil, fs.ErrNotExist, ce)
	assert.Equal(t, "EOF; file does not exist; code error", err.Error())
	assert.ErrorIs(t, err, io.EOF)
	assert.ErrorIs(t, err, fs.ErrNotExist)
	var got *codeError
	require.ErrorAs(t, err, &got)
	assert.Equal(t, 7, got.code)

	// Errors of many lines, errors.Join's included, come out on one.
	nested := oneline.Join(errors.Join(io.EOF, errors.New("two\n  three ")), errors.New("four\n"))
	assert.Equal(t, "EOF; two; three; four", nested.Error())
	assert.ErrorIs(t, nested, io.EOF)
	assert.Equal(t, "a; b", oneline.Join(errors.New("a\nb")).Error())
}

func TestText(t *testing.T) {
	assert.Equal(t, "", oneline.Text(nil))
	assert.Equal(t, "plain", oneline.Text(errors.New("plain")))
	assert.Equal(t, "a; b", oneline.Text(errors.Join(errors.New("a"), errors.New("b"))))
}
