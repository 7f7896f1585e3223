package soak

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/internal/pattern"
	"github.com/goxfer/goxfer/internal/testproc"
)

// The child process: the test binary re-executed with childEnv set. The
// parent drives its life over testproc (ctlRequest: start, sample, stop);
// the operations themselves go over NATS (opRequest), where the child
// answers each request on a goroutine of its own, so that 64 of them run
// at once.

const childEnv = "GOXFER_SOAK_CHILD"

// opTimeout bounds every blocking call of one operation, in both processes:
// far more than any needs, it only turns a hang into a reported failure.
const opTimeout = 2 * time.Minute

// ctlRequest is one command to the child:
//
//	start   Backend NATS Subject SampleEvery -> PID, Agent: a Connector for
//	        Backend ("tcp": WithoutCMA; "cma": the defaults; "shm": the
//	        defaults, every slab from AllocHost), serving opRequests on
//	        Subject
//	sample  Profile -> Sample: quiescent, once every request has been
//	        answered; with Profile, a heap profile written there
//	stop    -> Peaks, Counts, Leaks, ShmLeft: stops serving, closes the
//	        Connector and NATS, and looks for goroutines and shared memory
//	        left over; the last answer
type ctlRequest struct {
	Cmd         string        `json:"cmd"`
	Backend     string        `json:"backend,omitempty"`
	NATS        string        `json:"nats,omitempty"`
	Subject     string        `json:"subject,omitempty"`
	SampleEvery time.Duration `json:"sample_every,omitempty"`
	Profile     string        `json:"profile,omitempty"` // sample: where to write a heap profile
}

func (r ctlRequest) Name() string { return r.Cmd }

type ctlResponse struct {
	Err    string  `json:"err,omitempty"`
	PID    int     `json:"pid,omitempty"`
	Agent  string  `json:"agent,omitempty"`
	Sample *sample `json:"sample,omitempty"`
	Peaks  *peaks  `json:"peaks,omitempty"`
	Counts *counts `json:"counts,omitempty"`
	Leaks  string  `json:"leaks,omitempty"` // goroutines left after Close, as goleak lists them
	// ShmLeft is the shared memory mapped or open after Close (see
	// shmUse), "" if none.
	ShmLeft string `json:"shm_left,omitempty"`
}

func ctlFailed(err error) ctlResponse { return ctlResponse{Err: err.Error()} }

// counts are one process's operations, to show that everything it opened
// it also closed.
type counts struct {
	Created int `json:"created"` // passive operations created
	Closed  int `json:"closed"`  // passive operations closed
	Begun   int `json:"begun"`   // active operations begun
	Waited  int `json:"waited"`  // active operations awaited
}

// opRequest is one step of an operation, sent by the parent over NATS:
//
//	expose ID Kind Sizes -> Token: the child exposes memory for Kind,
//	                        filled with dataSeed (READ) or fillerSeed (WRITE)
//	finish ID            -> Result: the child awaits the exposure, checks
//	                        its memory holds dataSeed, closes it and frees
//	                        the memory
//	begin  ID Sizes Token -> Result: the child reads or writes (the token's
//	                        kind) between the parent's memory and its own,
//	                        awaits and checks its memory, and frees it
type opRequest struct {
	Cmd   string                `json:"cmd"`
	ID    int                   `json:"id"`
	Kind  connect.OperationKind `json:"kind,omitempty"`
	Sizes []int                 `json:"sizes,omitempty"`
	Token string                `json:"token,omitempty"`
}

type opReply struct {
	Token  string `json:"token,omitempty"`
	Result side   `json:"result"`
}

// side is what one process saw of an operation.
type side struct {
	Backend string   `json:"backend,omitempty"` // the active side's backend
	Path    string   `json:"path,omitempty"`    // and its path ("cma+shm")
	Errs    []string `json:"errs,omitempty"`    // failures, not corruption
	Damage  damage   `json:"damage"`
}

func (s *side) fail(format string, args ...any) {
	if len(s.Errs) < keepFirst {
		s.Errs = append(s.Errs, fmt.Sprintf(format, args...))
	}
}

// exposure is a passive operation of the child, alive until finish.
type exposure struct {
	op interface {
		Wait(context.Context) error
		Close() error
	}
	mem *opMem
}

type childServer struct {
	conn *connect.Connector
	mem  memory
	nc   *nats.Conn
	sub  *nats.Subscription
	smp  *sampler

	handlers sync.WaitGroup // one per opRequest being answered

	mu      sync.Mutex
	exposed map[int]*exposure
	n       counts
}

// runChild is the child process: it serves ctlRequests from in until stop
// or end of input, and returns the exit status.
func runChild(in io.Reader, out io.Writer) int {
	s := &childServer{exposed: make(map[int]*exposure)}
	handle := func(req ctlRequest) (ctlResponse, bool) {
		switch req.Cmd {
		case "start":
			return s.start(req), false
		case "sample":
			s.handlers.Wait()
			x, err := quiescent(req.Profile)
			if s.smp != nil {
				s.smp.note(x)
			}
			if err != nil {
				return ctlFailed(err), false
			}
			return ctlResponse{Sample: &x}, false
		case "stop":
			return s.stop(), true
		}
		return ctlFailed(fmt.Errorf("unknown command %q", req.Cmd)), false
	}
	if err := testproc.Serve(in, out, handle, ctlFailed); err != nil {
		fmt.Fprintln(os.Stderr, "soak child:", err)
		return 2
	}
	return 0
}

func (s *childServer) start(req ctlRequest) ctlResponse {
	if s.conn != nil {
		return ctlFailed(errors.New("started twice"))
	}
	opts := []connect.Option{connect.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))}
	if req.Backend == "tcp" {
		opts = append(opts, connect.WithoutCMA())
	}
	conn, err := connect.NewConnector(opts...)
	if err != nil {
		return ctlFailed(err)
	}
	nc, err := nats.Connect(req.NATS, nats.Name("soak child"))
	if err != nil {
		_ = conn.Close()
		return ctlFailed(err)
	}
	s.conn, s.nc, s.mem = conn, nc, memoryFor(req.Backend, conn)
	// The subscription's callback runs one message at a time; each request
	// is answered on a goroutine of its own, which stop waits for.
	s.sub, err = nc.Subscribe(req.Subject, func(m *nats.Msg) {
		s.handlers.Add(1)
		go func() {
			defer s.handlers.Done()
			s.answer(m)
		}()
	})
	if err == nil {
		err = nc.Flush()
	}
	if err != nil {
		return ctlFailed(errors.Join(err, s.close()))
	}
	s.smp = startSampler(req.SampleEvery, 0)
	return ctlResponse{PID: os.Getpid(), Agent: conn.AgentInfo().ID().String()}
}

func (s *childServer) answer(m *nats.Msg) {
	var req opRequest
	var rep opReply
	if err := json.Unmarshal(m.Data, &req); err != nil {
		rep.Result.fail("child: bad request: %v", err)
	} else {
		rep = s.do(req)
	}
	b, err := json.Marshal(rep)
	if err == nil {
		err = m.Respond(b)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "soak child: answer %s %d: %v\n", req.Cmd, req.ID, err)
	}
}

func (s *childServer) do(req opRequest) opReply {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	switch req.Cmd {
	case "expose":
		return s.expose(ctx, req)
	case "finish":
		return opReply{Result: s.finish(ctx, req.ID)}
	case "begin":
		return opReply{Result: s.begin(ctx, req)}
	}
	var rep opReply
	rep.Result.fail("child: unknown command %q", req.Cmd)
	return rep
}

func (s *childServer) expose(ctx context.Context, req opRequest) opReply {
	var rep opReply
	seed := uint64(dataSeed)
	if req.Kind == connect.KindWrite {
		seed = fillerSeed
	}
	mem, err := s.mem.slab(req.ID, req.Sizes, seed)
	if err != nil {
		rep.Result.fail("child: op %d: memory: %v", req.ID, err)
		return rep
	}
	e := &exposure{mem: mem}
	var md connect.Metadata
	switch req.Kind {
	case connect.KindRead:
		var op *connect.ReadableOperation
		if op, err = s.conn.CreateReadable(ctx, descriptors(mem.Slab)...); err == nil {
			e.op, md = op, op.Metadata()
		}
	case connect.KindWrite:
		var op *connect.WritableOperation
		if op, err = s.conn.CreateWritable(ctx, descriptors(mem.Slab)...); err == nil {
			e.op, md = op, op.Metadata()
		}
	default:
		err = fmt.Errorf("kind %v", req.Kind)
	}
	if err != nil {
		rep.Result.fail("child: op %d: create %v: %v", req.ID, req.Kind, err)
		if err := mem.free(); err != nil {
			rep.Result.fail("child: op %d: %v", req.ID, err)
		}
		return rep
	}
	s.mu.Lock()
	s.exposed[req.ID] = e
	s.n.Created++
	s.mu.Unlock()
	rep.Token = md.Text()
	return rep
}

func (s *childServer) finish(ctx context.Context, id int) side {
	var r side
	s.mu.Lock()
	e, ok := s.exposed[id]
	delete(s.exposed, id)
	s.mu.Unlock()
	if !ok {
		r.fail("child: op %d: finish: nothing exposed", id)
		return r
	}
	if err := e.op.Wait(ctx); err != nil {
		r.fail("child: op %d: passive Wait: %v", id, err)
	}
	// READ: the reader left the memory alone; WRITE: the writer's bytes.
	r.Damage = check(e.mem.Slab, id, dataSeed)
	if err := e.op.Close(); err != nil {
		r.fail("child: op %d: passive Close: %v", id, err)
	}
	if err := e.mem.free(); err != nil {
		r.fail("child: op %d: %v", id, err)
	}
	s.mu.Lock()
	s.n.Closed++
	s.mu.Unlock()
	return r
}

func (s *childServer) begin(ctx context.Context, req opRequest) side {
	var r side
	md, err := connect.ParseMetadata(req.Token)
	if err != nil {
		r.fail("child: op %d: token: %v", req.ID, err)
		return r
	}
	if err := sameSizes(md.Sizes(), req.Sizes); err != nil {
		r.fail("child: op %d: token: %v", req.ID, err)
		return r
	}
	seed := uint64(dataSeed)
	if md.Kind() == connect.KindRead {
		seed = fillerSeed
	}
	mem, err := s.mem.slab(req.ID, req.Sizes, seed)
	if err != nil {
		r.fail("child: op %d: memory: %v", req.ID, err)
		return r
	}
	r.Backend, r.Path, err = transfer(ctx, s.conn, md, mem.Slab, func() {
		s.mu.Lock()
		s.n.Begun++
		s.mu.Unlock()
	})
	if err != nil {
		r.fail("child: op %d: %v", req.ID, err)
	}
	s.mu.Lock()
	s.n.Waited++
	s.mu.Unlock()
	// READ: the bytes landed; WRITE: the bytes sent are intact.
	r.Damage = check(mem.Slab, req.ID, dataSeed)
	if err := mem.free(); err != nil {
		r.fail("child: op %d: %v", req.ID, err)
	}
	return r
}

// transfer begins the READ or WRITE md asks for between local and the
// memory md names, calls begun once it is posted, and awaits it. It
// returns the backend that moved the bytes and its path.
func transfer(ctx context.Context, c *connect.Connector, md connect.Metadata, local *pattern.Slab, begun func()) (backend, path string, err error) {
	var op interface {
		Wait(context.Context) error
		Backend() string
		Path() string
	}
	switch md.Kind() {
	case connect.KindRead:
		op, err = c.BeginRead(ctx, md, descriptors(local)...)
	case connect.KindWrite:
		op, err = c.BeginWrite(ctx, md, descriptors(local)...)
	default:
		return "", "", fmt.Errorf("token of kind %v", md.Kind())
	}
	if err != nil {
		return "", "", fmt.Errorf("begin %v: %w", md.Kind(), err)
	}
	begun()
	if err := op.Wait(ctx); err != nil {
		return op.Backend(), op.Path(), fmt.Errorf("%v Wait: %w", md.Kind(), err)
	}
	return op.Backend(), op.Path(), nil
}

func sameSizes(got, want []int) error {
	if len(got) != len(want) {
		return fmt.Errorf("names %d descriptors, want %d", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			return fmt.Errorf("descriptor %d: size %d, want %d", i, got[i], want[i])
		}
	}
	return nil
}

// stop stops serving, waits for the requests being answered, closes what
// is still exposed (none, if every operation finished), the Connector and
// NATS, and reports goroutines that outlive them.
func (s *childServer) stop() ctlResponse {
	if s.conn == nil {
		return ctlFailed(errors.New("stop before start"))
	}
	var r ctlResponse
	err := s.close()
	p, _ := s.smp.stop()
	r.Peaks = &p
	s.mu.Lock()
	n := s.n
	s.mu.Unlock()
	r.Counts = &n
	if err != nil {
		r.Err = err.Error()
	}
	if err := goleak.Find(); err != nil {
		r.Leaks = err.Error()
	}
	r.ShmLeft = shmLeft()
	return r
}

func (s *childServer) close() error {
	var errs []error
	if s.sub != nil {
		errs = append(errs, s.sub.Unsubscribe())
	}
	s.handlers.Wait()
	s.mu.Lock()
	left := s.exposed
	s.exposed = nil
	s.mu.Unlock()
	for id, e := range left {
		errs = append(errs, fmt.Errorf("op %d still exposed at stop", id), e.op.Close(), e.mem.free())
	}
	if st := s.conn.Stats(); st.Registered+st.Exposed+st.InFlight != 0 || st.Refused != 0 {
		errs = append(errs, fmt.Errorf("the child's Connector holds %d regions, %d exposures, %d transfers after every operation closed, and refused %d accesses",
			st.Registered, st.Exposed, st.InFlight, st.Refused))
	}
	errs = append(errs, s.conn.Close())
	s.nc.Close()
	return errors.Join(errs...)
}
