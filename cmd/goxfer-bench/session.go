package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/goxfer/goxfer/connect"
	"github.com/goxfer/goxfer/transport/nats/natsserver"
)

// The initiator's side of a session: the NATS server it talks over, the
// targets it measures against (a child process, and one in this process for
// in-process backends), and the connections it measures with.

// remote is a target as the initiator sees it.
type remote struct {
	name      string // subject component: "proc" or "local"
	hello     hello
	sameClock bool // its CLOCK_MONOTONIC is ours
}

// undo holds the cleanups of the session's setup and runs them last first,
// as defers would.
type undo []func()

func (u *undo) add(f func()) { *u = append(*u, f) }

// run has a pointer receiver so that "defer u.run()" runs what was added
// after the defer statement.
func (u *undo) run() {
	for i := len(*u) - 1; i >= 0; i-- {
		(*u)[i]()
	}
}

// connectNATS connects to -nats, or to an embedded server it starts first
// (on -listen's host with -role initiator, which then prints how to start
// the target). u gets the disconnect and the server's shutdown.
func (in *initiator) connectNATS(ctx context.Context, u *undo) (err error) {
	cfg := in.cfg
	in.natsURL = cfg.natsURL
	if in.natsURL == "" {
		host := "127.0.0.1"
		if cfg.role == "initiator" {
			host, _, _ = net.SplitHostPort(cfg.listen)
		}
		srv, err := natsserver.Start(ctx, natsserver.WithoutJetStream(), natsserver.WithHost(host),
			natsserver.WithServerOptions(func(o *server.Options) { o.MaxPayload = 8 << 20 }))
		if err != nil {
			return fmt.Errorf("start the embedded NATS server: %w", err)
		}
		u.add(srv.Shutdown)
		in.natsURL = srv.URL()
		if cfg.role == "initiator" {
			fmt.Fprintf(in.stderr, "goxfer-bench: embedded NATS server at %s; start the target with:\n  goxfer-bench -role target -nats %s -session %s\n", in.natsURL, in.natsURL, cfg.session)
		}
	}
	in.nc, err = nats.Connect(in.natsURL, nats.Name("goxfer-bench initiator"), nats.Timeout(cfg.timeout))
	if err != nil {
		return fmt.Errorf("connect to NATS at %s: %w", in.natsURL, err)
	}
	u.add(in.nc.Close)
	return nil
}

// targetFor is the target that b's operations go to: the one in this
// process for an in-process backend, the target process otherwise.
func (in *initiator) targetFor(b backendDef) *remote {
	if b.inProcess {
		return in.local
	}
	return in.proc
}

// startTargets brings up the targets the measurements need and waits for
// their hello: the target process (spawned with -role both) for the
// backends across processes and the baselines, and a target in this
// process for in-process backends. u gets what stops them: a quit for the
// target process, the in-process target's close, the child's stop.
func (in *initiator) startTargets(ctx context.Context, u *undo) (err error) {
	cfg := in.cfg
	needProc := cfg.baseline || slices.ContainsFunc(cfg.backends, func(b backendDef) bool { return !b.inProcess })
	needLocal := slices.ContainsFunc(cfg.backends, func(b backendDef) bool { return b.inProcess })
	if needProc && cfg.role == "both" {
		stopChild, err := in.spawn()
		if err != nil {
			return err
		}
		u.add(stopChild)
	}
	if needLocal {
		// In-process backends (mem) reach only agents of this process: their
		// target runs here, driven through the same NATS subjects.
		t, err := startTarget(cfg, in.nc, "local")
		if err != nil {
			return fmt.Errorf("start the in-process target: %w", err)
		}
		u.add(t.Close)
		if in.local, err = in.await(ctx, "local"); err != nil {
			return err
		}
	}
	if needProc {
		if in.proc, err = in.await(ctx, "proc"); err != nil {
			return err
		}
		u.add(func() {
			qctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			var out struct{}
			_ = call(qctx, in.nc, subject(cfg.session, "proc", "quit"), struct{}{}, &out)
		})
	}
	return nil
}

// spawn starts the target as a child process running this binary.
func (in *initiator) spawn() (stop func(), err error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, "-role", "target", "-nats", in.natsURL, "-session", in.cfg.session,
		"-listen", in.cfg.listen, "-timeout", in.cfg.timeout.String(), "-backends", "all", "-staging", in.cfg.staging,
		"-device-ipc="+strconv.FormatBool(in.cfg.deviceIPC), "-tcp-latency", in.cfg.tcpSpin.String())
	if in.cfg.cpuProfile != "" {
		cmd.Args = append(cmd.Args, "-cpuprofile", in.cfg.cpuProfile+".target")
	}
	cmd.Env = append(os.Environ(), childEnv+"=1")
	cmd.Stdout = in.stderr
	cmd.Stderr = in.stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the target process: %w", err)
	}
	in.childExited = make(chan error, 1)
	exited := make(chan struct{})
	go func() {
		err := cmd.Wait()
		in.childExited <- err
		close(exited)
	}()
	return func() {
		_ = stdin.Close() // the child exits when its stdin closes
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	}, nil
}

// await asks the target for its hello until it answers or the timeout.
func (in *initiator) await(ctx context.Context, name string) (*remote, error) {
	ctx, cancel := context.WithTimeout(ctx, in.cfg.timeout)
	defer cancel()
	subj := subject(in.cfg.session, name, "hello")
	for {
		var h hello
		actx, acancel := context.WithTimeout(ctx, time.Second)
		err := call(actx, in.nc, subj, helloReq{Device: in.cfg.mem.target == memVRAM, GPU: in.cfg.gpu}, &h)
		acancel()
		if err == nil {
			if h.DeviceErr != "" {
				return nil, fmt.Errorf("-target-mem vram: the target (pid %d on %s) cannot allocate GPU memory: %s", h.PID, h.Host, h.DeviceErr)
			}
			return &remote{name: name, hello: h, sameClock: h.BootID != "" && h.BootID == bootID()}, nil
		}
		select {
		case cerr := <-in.childExited:
			return nil, fmt.Errorf("the target process exited before answering: %v", cerr)
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				how := ""
				if in.cfg.role == "initiator" {
					how = fmt.Sprintf(" (start it with: goxfer-bench -role target -nats %s -session %s)", in.natsURL, in.cfg.session)
				}
				return nil, fmt.Errorf("timeout: the target did not show up within %v: nobody answered on NATS subject %q at %s%s", in.cfg.timeout, subj, in.natsURL, how)
			}
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// openConnections starts one connector per measured backend, and with
// -baselines dials the target process's raw TCP server over 1 and 4
// connections, and (-interleave) its ping-pong server once. u gets their
// closes.
func (in *initiator) openConnections(ctx context.Context, u *undo) (err error) {
	cfg := in.cfg
	quiet := slog.New(slog.DiscardHandler)
	bcfg := *cfg
	bcfg.listen = anyPort(cfg.listen)
	for _, b := range cfg.backends {
		bs := agentBackends(&bcfg)
		opts := append([]connect.Option{connect.WithBackends(bs...), connect.WithBackend(b.name), connect.WithLogger(quiet)}, deviceOptions(cfg, &in.meter)...)
		c, err := connect.NewConnector(opts...)
		if err != nil {
			return fmt.Errorf("start a connector for %s: %w", b.name, err)
		}
		u.add(func() { _ = c.Close() })
		in.conns[b.name] = c
		in.insts[b.name] = findBackend(bs, b.name)
	}
	if in.proc != nil && cfg.baseline {
		if in.raw1, err = dialN(ctx, in.proc.hello.Raw, 1); err != nil {
			return err
		}
		u.add(func() { closeAll(in.raw1) })
		if in.raw4, err = dialN(ctx, in.proc.hello.Raw, 4); err != nil {
			return err
		}
		u.add(func() { closeAll(in.raw4) })
		if cfg.interleave {
			cs, err := dialN(ctx, in.proc.hello.Ping, 1)
			if err != nil {
				return err
			}
			in.ping = cs[0]
			u.add(func() { closeAll(cs) })
		}
	}
	return nil
}

func dialN(ctx context.Context, addr string, n int) ([]net.Conn, error) {
	var d net.Dialer
	cs := make([]net.Conn, 0, n)
	for range n {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			closeAll(cs)
			return nil, fmt.Errorf("dial the target's raw TCP server: %w", err)
		}
		cs = append(cs, c)
	}
	return cs, nil
}

func closeAll(cs []net.Conn) {
	for _, c := range cs {
		_ = c.Close()
	}
}
