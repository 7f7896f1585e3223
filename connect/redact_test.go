package connect

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// secrets are the forms in which a token's capability could leak: its text,
// its key in base64 and hex (whole, and its first bytes, which agent.Key's
// own String shows), and the key's bytes as fmt prints a byte array.
func secrets(md Metadata) map[string]string {
	key := md.key.open()
	k := key[:]
	return map[string]string{
		"text":               md.Text(),
		"key, base64url":     base64.RawURLEncoding.EncodeToString(k),
		"key, base64":        base64.StdEncoding.EncodeToString(k),
		"key, hex":           hex.EncodeToString(k),
		"key, HEX":           strings.ToUpper(hex.EncodeToString(k)),
		"key's first bytes":  hex.EncodeToString(k[:4]),
		"key, decimal bytes": strings.Trim(fmt.Sprint(k), "[]"),
		"key, hex bytes":     fmt.Sprintf("% x", k),
	}
}

// requireRedacted fails if out holds any form of md's capability.
func requireRedacted(t *testing.T, md Metadata, out, what string) {
	t.Helper()
	for name, s := range secrets(md) {
		require.NotContains(t, out, s, "%s shows the token's %s: %s", what, name, out)
	}
}

// tokens are the tokens the redaction tests print: a real Connector's of
// both kinds, full and compact, and one of many descriptors.
func tokens(t *testing.T) []Metadata {
	c := newConnector(t)
	r := expose(t, c, KindRead, buffers([]int{4096, 100}, 1))
	w := expose(t, c, KindWrite, buffers([]int{8}, 1))
	return []Metadata{r.Metadata(), w.Metadata(), r.Metadata().Compact(), testMetadata(KindRead, 300)}
}

func TestMetadataStringIsRedacted(t *testing.T) {
	md := tokens(t)[0]
	want := fmt.Sprintf("token{READ agent=%s descriptors=2 bytes=4196 full key=%s}", md.Agent(), md.fingerprint())
	assert.Equal(t, want, md.String())
	assert.Equal(t, strings.Replace(want, "full", "compact", 1), md.Compact().String())
	key := md.key.open()
	sum := sha256.Sum256(key[:])
	assert.Equal(t, "sha256:"+hex.EncodeToString(sum[:4]), md.fingerprint(), "4 bytes of the key's SHA-256")
	assert.Equal(t, key.String(), md.fingerprint(), "the agent's errors name the key alike")
	assert.Equal(t, "token{zero}", Metadata{}.String())
	assert.Equal(t, "connect.Metadata{}", fmt.Sprintf("%#v", Metadata{}))

	// The fingerprint tells tokens apart, and a token from itself parsed.
	other := tokens(t)[0]
	assert.NotEqual(t, md.fingerprint(), other.fingerprint())
	back, err := ParseMetadata(md.Text())
	require.NoError(t, err)
	assert.Equal(t, md.String(), back.String())
}

// Every fmt verb, with flags and widths, on the token, a pointer to it and
// values that hold it, prints the redacted form or nothing of the token.
func TestMetadataFmtIsRedacted(t *testing.T) {
	verbs := []string{
		"%v", "%+v", "%#v", "%s", "%q", "%#q", "%x", "%X", "% x", "%d", "%o", "%O", "%b", "%c",
		"%U", "%e", "%f", "%g", "%t", "%p", "%T", "%60v", "%-60s", "%.10s", "%+q", "%08v", "%w",
	}
	type exported struct{ Token Metadata }
	type unexported struct{ token Metadata }
	for _, md := range tokens(t) {
		values := map[string]any{
			"value":                 md,
			"pointer":               &md,
			"slice":                 []Metadata{md, md},
			"map":                   map[string]Metadata{"t": md},
			"struct field":          exported{md},
			"unexported field":      unexported{md},
			"pointer to struct":     &unexported{md},
			"interface in a struct": struct{ V any }{md},
		}
		for name, v := range values {
			for _, verb := range verbs {
				out := fmt.Sprintf(verb, v)
				requireRedacted(t, md, out, fmt.Sprintf("%s of a %s", verb, name))
			}
			requireRedacted(t, md, fmt.Sprint(v), "Sprint of a "+name)
			requireRedacted(t, md, fmt.Sprintln(v, v), "Sprintln of a "+name)
		}
		for _, verb := range []string{"%v", "%+v", "%s"} {
			assert.Equal(t, md.String(), fmt.Sprintf(verb, md), verb)
			assert.Equal(t, md.String(), fmt.Sprintf(verb, &md), verb)
		}
		assert.Equal(t, fmt.Sprintf("%q", md.String()), fmt.Sprintf("%q", md))
		assert.Equal(t, fmt.Sprintf("%x", md.String()), fmt.Sprintf("%x", md))
		assert.Equal(t, fmt.Sprintf("%70s|", md.String()), fmt.Sprintf("%70s|", md))
		assert.Equal(t, "%!d(connect.Metadata="+md.String()+")", fmt.Sprintf("%d", md))
		assert.Contains(t, fmt.Sprintf("%#v", md), "connect.Metadata{Kind: "+md.Kind().String())
		assert.Contains(t, fmt.Sprintf("%#v", md), md.fingerprint())
	}
}

// Operations print without the key of their token with the verbs that print
// structs: the passive one holds its Metadata, the active one the key.
// (Verbs fmt finds bad for a struct, such as %s, make it print what the
// operation's pointers point to, the Connector's whole state included.)
func TestOperationsFmtIsRedacted(t *testing.T) {
	ctx := guarded(t)
	passive, act := pair(t, "mem")
	pop := expose(t, passive, KindRead, buffers([]int{64}, 1))
	md := pop.Metadata()
	rop, err := act.BeginRead(ctx, md, descriptors(buffers([]int{64}, 0))...)
	require.NoError(t, err)
	require.NoError(t, rop.Wait(ctx))
	for _, verb := range []string{"%v", "%+v", "%#v", "%x", "%d"} {
		requireRedacted(t, md, fmt.Sprintf(verb, pop), verb+" of a ReadableOperation")
		requireRedacted(t, md, fmt.Sprintf(verb, rop), verb+" of a ReadOperation")
	}
}

// slog's JSON and text handlers log a token as the group of its redacted
// fields, alone, in groups, through a pointer, and with attributes added
// before.
func TestMetadataSlogIsRedacted(t *testing.T) {
	for _, md := range tokens(t) {
		var buf bytes.Buffer
		handlers := map[string]slog.Handler{
			"json": slog.NewJSONHandler(&buf, nil),
			"text": slog.NewTextHandler(&buf, nil),
		}
		for name, h := range handlers {
			buf.Reset()
			log := slog.New(h)
			log.Info("exposed", "token", md)
			log.Info("exposed", slog.Any("token", md), slog.Any("ptr", &md))
			log.With("token", md).Info("with")
			log.WithGroup("req").Info("grouped", "token", md)
			log.LogAttrs(context.Background(), slog.LevelWarn, "attrs", slog.Group("g", slog.Any("token", md)))
			log.Info("err", "err", fmt.Errorf("bad token %v", md))
			requireRedacted(t, md, buf.String(), name+" handler")
			assert.Contains(t, buf.String(), md.fingerprint(), name)
			assert.Contains(t, buf.String(), md.Agent().String(), name)
		}

		buf.Reset()
		slog.New(slog.NewJSONHandler(&buf, nil)).Info("exposed", "token", md)
		var rec struct {
			Token struct {
				Kind        string
				Agent       string
				Descriptors int
				Bytes       uint64
				Compact     bool
				Key         string
			} `json:"token"`
		}
		require.NoError(t, json.Unmarshal(buf.Bytes(), &rec), buf.String())
		assert.Equal(t, md.Kind().String(), rec.Token.Kind)
		assert.Equal(t, md.Agent().String(), rec.Token.Agent)
		assert.Equal(t, md.Len(), rec.Token.Descriptors)
		assert.Equal(t, md.bytes(), rec.Token.Bytes)
		assert.Equal(t, md.IsCompact(), rec.Token.Compact)
		assert.Equal(t, md.fingerprint(), rec.Token.Key)
	}
	var buf bytes.Buffer
	slog.New(slog.NewTextHandler(&buf, nil)).Info("none", "token", Metadata{})
	assert.Contains(t, buf.String(), "token=token{zero}")
}

// Errors that format a token, wrap such errors, or come from operations
// given one show none of its capability.
func TestErrorsWithMetadataAreRedacted(t *testing.T) {
	ctx := guarded(t)
	passive, act := pair(t, "mem")
	pop := expose(t, passive, KindRead, buffers([]int{64, 32}, 1))
	md := pop.Metadata()

	base := fmt.Errorf("handler: token %v refused: %w", md, ErrAccessDenied)
	errs := []error{
		base,
		fmt.Errorf("request 7: %w", base),
		errors.Join(base, fmt.Errorf("token %s, %q, %+v, %#v", md, md, &md, md)),
		&TransferError{Op: "read", Peer: md.Agent(), Err: base},
	}
	_, err := act.BeginWrite(ctx, md, descriptors(buffers([]int{64, 32}, 0))...)
	require.ErrorIs(t, err, ErrKindMismatch)
	errs = append(errs, err)
	_, err = act.BeginRead(ctx, md, descriptors(buffers([]int{64, 33}, 0))...)
	require.ErrorIs(t, err, ErrSizeMismatch)
	errs = append(errs, err)
	_, err = md.Select(Span{Index: 2})
	require.ErrorIs(t, err, ErrInvalidSpan)
	errs = append(errs, err)
	for _, err := range errs {
		for _, verb := range []string{"%v", "%+v", "%s", "%q", "%#v"} {
			requireRedacted(t, md, fmt.Sprintf(verb, err), verb+" of "+err.Error())
		}
		var buf bytes.Buffer
		slog.New(slog.NewJSONHandler(&buf, nil)).Error("failed", "err", err)
		requireRedacted(t, md, buf.String(), "a logged error")
	}
	assert.ErrorIs(t, errs[1], ErrAccessDenied)
	assert.Contains(t, errs[0].Error(), md.String())
}

// The capability is in the forms that carry it on purpose: Text,
// MarshalText (and so JSON) and MarshalBinary.
func TestMetadataTransportForms(t *testing.T) {
	md := tokens(t)[0]
	text, err := md.MarshalText()
	require.NoError(t, err)
	assert.Equal(t, md.Text(), string(text))
	js, err := json.Marshal(map[string]Metadata{"token": md})
	require.NoError(t, err)
	assert.Equal(t, `{"token":"`+md.Text()+`"}`, string(js))
	bin, err := md.MarshalBinary()
	require.NoError(t, err)
	key := md.key.open()
	assert.True(t, bytes.Contains(bin, key[:]))
}
