package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/goxfer/goxfer/connect"
)

// The initiator's side of a round: the target prepares a point (buffers,
// passive operations, their tokens), the initiator runs it, the target
// reports what it saw.

// prepared is a round the target has set up.
type prepared struct {
	id    uint64
	t     *remote
	ready roundReady
	mds   []connect.Metadata
}

func (in *initiator) prepare(ctx context.Context, t *remote, req roundReq) (*prepared, error) {
	req.ID = in.round.Add(1)
	ctx, cancel := context.WithTimeout(ctx, in.cfg.timeout)
	defer cancel()
	p := &prepared{id: req.ID, t: t}
	if err := call(ctx, in.nc, subject(in.cfg.session, t.name, "round"), req, &p.ready); err != nil {
		return nil, err
	}
	if p.ready.Err != "" {
		return nil, fmt.Errorf("target: %s", p.ready.Err)
	}
	for page := range p.ready.Pages {
		b, _ := json.Marshal(map[string]any{"id": req.ID, "page": page})
		msg, err := in.nc.RequestWithContext(ctx, subject(in.cfg.session, t.name, "tokens"), b)
		if err != nil {
			return nil, fmt.Errorf("fetch tokens: %w", err)
		}
		if p.mds, err = decodeTokens(msg.Data, p.mds); err != nil {
			return nil, fmt.Errorf("fetch tokens: %w", err)
		}
	}
	if len(p.mds) != p.ready.Tokens {
		return nil, fmt.Errorf("fetched %d tokens, the target made %d", len(p.mds), p.ready.Tokens)
	}
	return p, nil
}

func (in *initiator) finish(ctx context.Context, p *prepared) (roundResult, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), in.cfg.timeout+5*time.Second)
	defer cancel()
	var res roundResult
	if err := call(ctx, in.nc, subject(in.cfg.session, p.t.name, "finish"), finishReq{ID: p.id}, &res); err != nil {
		return res, err
	}
	if res.Err != "" {
		return res, errors.New("target: " + res.Err)
	}
	return res, nil
}
