"""process.Process: start/attach/list/signal user processes, with pipes or a PTY.

Each process gets its own session (and so its own process group). Output is fanned out to every
attached stream; a client disconnecting never kills the process. Exited processes are remembered for
30 s so a late Connect still gets start + end.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import signal
import struct
import subprocess
import termios
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from agentenv.envd import connect, userspawn
from agentenv.envd.lifetime import Deadline, Lifetimes
from agentenv.envd.connect import ConnectError, b64decode, b64encode, field as pfield
from agentenv.envd.state import EnvdState, get_state, process_env, rpc_user
from agentenv.envd.users import User, resolve_path

log = logging.getLogger("agentenv.envd")

STD_CHUNK = 32 * 1024
PTY_CHUNK = 16 * 1024
EXIT_RETENTION = 30.0
# After the main process exits, background children may still hold its output open: deliver what is in
# flight (until output has been quiet for OUTPUT_QUIET) but never wait for their EOF.
OUTPUT_QUIET = 0.05
OUTPUT_DRAIN_MAX = 2.0
DEFAULT_KEEPALIVE = 90.0

SIGNALS = {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9}


def exit_event(returncode: int) -> dict[str, Any]:
    """EndEvent mirroring Go's os.ProcessState: signals give exitCode -1, exited false."""
    if returncode >= 0:
        status = f"exit status {returncode}"
        end: dict[str, Any] = {"exited": True, "status": status}
        if returncode:
            end["exitCode"] = returncode
            end["error"] = status
        return end
    try:
        name = (signal.strsignal(-returncode) or f"signal {-returncode}").lower()
    except ValueError:
        name = f"signal {-returncode}"
    status = f"signal: {name}"
    return {"exitCode": -1, "exited": False, "status": status, "error": status}


def _set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _make_controlling_tty() -> None:  # runs in the child between fork and exec
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class _Protocol(asyncio.SubprocessProtocol):
    """Receives pipe output and the exit notification. Exit is reported as soon as the main process
    exits, even if a background grandchild keeps stdout open (asyncio's Process.wait() would not)."""

    def __init__(self) -> None:
        self.exited = asyncio.Event()
        self.pipes_done = asyncio.Event()
        self.last_data = 0.0
        self._open_pipes = {1, 2}
        self._sink: Callable[[dict], None] | None = None
        self._pending: list[dict] = []

    def attach(self, sink: Callable[[dict], None]) -> None:
        self._sink = sink
        pending, self._pending = self._pending, []
        for event in pending:
            sink(event)

    def emit(self, event: dict) -> None:
        self.last_data = time.monotonic()
        if self._sink is None:
            self._pending.append(event)
        else:
            self._sink(event)

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        name = "stdout" if fd == 1 else "stderr"
        for i in range(0, len(data), STD_CHUNK):
            self.emit({"data": {name: b64encode(data[i:i + STD_CHUNK])}})

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open_pipes.discard(fd)
        if not self._open_pipes:
            self.pipes_done.set()

    def process_exited(self) -> None:
        self.exited.set()


@dataclass(eq=False)
class ManagedProcess:
    pid: int
    config: dict[str, Any]
    tag: str | None
    transport: asyncio.SubprocessTransport
    protocol: _Protocol
    pty_master: int | None = None
    subscribers: set[asyncio.Queue] = field(default_factory=set)
    end: dict[str, Any] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.end is None

    def publish(self, event: dict[str, Any]) -> None:
        for q in self.subscribers:
            q.put_nowait(event)

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.subscribers.discard(q)

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.config, "pid": self.pid}
        if self.tag is not None:
            out["tag"] = self.tag
        return out

    def send_signal(self, sig: int) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                self.transport.send_signal(sig)

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the process leads its own session)."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            self.send_signal(sig)

    @property
    def stdin(self) -> asyncio.WriteTransport | None:
        pipe = self.transport.get_pipe_transport(0)
        return pipe  # type: ignore[return-value]


class ProcessManager:
    def __init__(self) -> None:
        self.procs: dict[int, ManagedProcess] = {}
        self.spawning = 0  # while > 0 the orphan reaper must not touch anything
        self.lifetimes = Lifetimes()  # the kill timers of commands with a timeout (run time only)

    def managed_pids(self) -> set[int]:
        return set(self.procs)

    def find(self, selector: dict | None) -> ManagedProcess:
        selector = selector or {}
        pid = pfield(selector, "pid")
        tag = pfield(selector, "tag")
        if pid is not None:
            mp = self.procs.get(int(pid))
            if mp is None:
                raise ConnectError("not_found", f"process with pid {pid} not found")
            return mp
        if tag is not None:
            for mp in self.procs.values():
                if mp.tag == tag and mp.running:
                    return mp
            for mp in self.procs.values():
                if mp.tag == tag:
                    return mp
            raise ConnectError("not_found", f"process with tag {tag} not found")
        raise ConnectError("invalid_argument", "process selector requires pid or tag")

    def find_running(self, selector: dict | None) -> ManagedProcess:
        mp = self.find(selector)
        if not mp.running:
            raise ConnectError("not_found", f"process with pid {mp.pid} not found")
        return mp

    async def start(
        self,
        state: EnvdState,
        user: User,
        msg: dict,
        lifetime: float | None,
    ) -> tuple[ManagedProcess, asyncio.Queue]:
        spec = pfield(msg, "process") or {}
        cmd = pfield(spec, "cmd")
        if not cmd:
            raise ConnectError("invalid_argument", "process.cmd is required")
        args = [str(a) for a in (pfield(spec, "args") or [])]
        if cmd == "/bin/bash" and not os.path.exists(cmd) and os.path.exists("/bin/sh"):
            # The SDKs run every command through `/bin/bash -l -c`; images without bash (Alpine,
            # busybox) get their POSIX shell, which takes the same flags.
            cmd = "/bin/sh"
        envs = pfield(spec, "envs") or {}
        cwd_req = pfield(spec, "cwd")
        if cwd_req:
            cwd = resolve_path(cwd_req, user)
        else:
            cwd = state.default_workdir or user.home
            cwd_req = cwd
        if not os.path.isdir(cwd):
            raise ConnectError("invalid_argument", f"cwd '{cwd_req}' does not exist")
        pty = pfield(msg, "pty")
        stdin_flag = pfield(msg, "stdin")
        want_stdin = True if stdin_flag is None else bool(stdin_flag)
        env = process_env(state, user, envs)

        creds: dict[str, Any] = {}
        if os.geteuid() == 0 and not user.is_root:
            creds = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}

        master: int | None = None
        loop = asyncio.get_running_loop()
        protocol = _Protocol()
        self.spawning += 1
        try:
            if pty is not None:
                size = pfield(pty, "size") or {}
                master, slave = os.openpty()
                try:
                    _set_winsize(master, int(size.get("cols") or 80), int(size.get("rows") or 24))
                    if creds:
                        os.fchown(slave, user.uid, -1)
                    transport, _ = await loop.subprocess_exec(
                        lambda: protocol, cmd, *args, stdin=slave, stdout=slave, stderr=slave, cwd=cwd,
                        env=env, start_new_session=True, preexec_fn=_make_controlling_tty, **creds,
                    )
                except BaseException:
                    os.close(master)
                    raise
                finally:
                    os.close(slave)
                protocol.pipes_done.set()
            else:
                pipes: dict[str, Any] = dict(stdin=subprocess.PIPE if want_stdin else subprocess.DEVNULL,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             cwd=cwd, env=env, start_new_session=True)
                if creds and userspawn.available():  # vfork under this thread's switched credentials
                    transport, _ = await userspawn.spawn_as(
                        user, loop.subprocess_exec(lambda: protocol, cmd, *args, **pipes))
                else:
                    transport, _ = await loop.subprocess_exec(lambda: protocol, cmd, *args, **pipes, **creds)
        except FileNotFoundError as exc:
            raise ConnectError("invalid_argument", f"failed to start process: {exc}") from None
        except PermissionError as exc:
            raise ConnectError("permission_denied", f"failed to start process: {exc}") from None
        finally:
            self.spawning -= 1

        config: dict[str, Any] = {"cmd": cmd, "args": args, "envs": dict(envs)}
        if pfield(spec, "cwd"):
            config["cwd"] = pfield(spec, "cwd")
        mp = ManagedProcess(transport.get_pid(), config, pfield(msg, "tag"), transport, protocol, master)
        self.procs[mp.pid] = mp
        queue = mp.subscribe()  # before attaching: the starter sees all output
        protocol.attach(mp.publish)
        # armed here, not in the task: the deadline counts from the spawn
        timer = self.lifetimes.start(lifetime, mp.kill_group, f"pid {mp.pid}") if lifetime else None
        loop.create_task(self._supervise(mp, timer))
        log.info("started pid %d as %s: %s %s", mp.pid, user.name, cmd, args)
        return mp, queue

    async def _supervise(self, mp: ManagedProcess, timer: Deadline | None) -> None:
        loop = asyncio.get_running_loop()
        pty_reader = loop.create_task(self._read_pty(mp)) if mp.pty_master is not None else None
        proto = mp.protocol
        try:
            await proto.exited.wait()
            # Deliver output still in flight, but don't wait for EOF that a background child may hold.
            # The exit is often seen before the pipes' EOF: wake on that EOF, not after a fixed sleep.
            deadline = loop.time() + OUTPUT_DRAIN_MAX
            eof = loop.create_task(proto.pipes_done.wait())
            drained: set[asyncio.Future] = {eof} if pty_reader is None else {eof, pty_reader}
            try:
                while loop.time() < deadline:
                    _, pending = await asyncio.wait(drained, timeout=OUTPUT_QUIET)
                    if not pending or time.monotonic() - proto.last_data >= OUTPUT_QUIET:
                        break
            finally:
                eof.cancel()
        finally:
            self.lifetimes.cancel(timer)
            if pty_reader is not None:
                pty_reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pty_reader
                with contextlib.suppress(OSError):
                    os.close(mp.pty_master)  # type: ignore[arg-type]
        returncode = mp.transport.get_returncode()
        mp.transport.close()  # closes our pipe ends; the process has already exited
        mp.end = exit_event(returncode if returncode is not None else -signal.SIGKILL)
        mp.publish({"end": mp.end})
        mp.done.set()
        log.info("pid %d ended: %s", mp.pid, mp.end["status"])
        loop.call_later(EXIT_RETENTION, self._forget, mp)

    def _forget(self, mp: ManagedProcess) -> None:
        if self.procs.get(mp.pid) is mp:
            del self.procs[mp.pid]

    @staticmethod
    async def _read_pty(mp: ManagedProcess) -> None:
        loop = asyncio.get_running_loop()
        fd = mp.pty_master
        assert fd is not None
        os.set_blocking(fd, False)
        finished = loop.create_future()

        def on_readable() -> None:
            try:
                chunk = os.read(fd, PTY_CHUNK)
            except BlockingIOError:
                return
            except OSError as exc:  # EIO once every slave fd is closed
                if exc.errno != errno.EIO:
                    log.warning("pty read for pid %d failed: %s", mp.pid, exc)
                chunk = b""
            if not chunk:
                loop.remove_reader(fd)
                if not finished.done():
                    finished.set_result(None)
                return
            mp.protocol.emit({"data": {"pty": b64encode(chunk)}})

        loop.add_reader(fd, on_readable)
        try:
            await finished
        finally:
            with contextlib.suppress(Exception):
                loop.remove_reader(fd)

    async def write_input(self, mp: ManagedProcess, inp: dict | None) -> None:
        inp = inp or {}
        if "pty" in inp:
            if mp.pty_master is None:
                raise ConnectError("internal", f"process {mp.pid} has no PTY")
            data = b64decode(inp["pty"])
            await _write_fd(mp.pty_master, data)
        elif "stdin" in inp:
            if mp.pty_master is not None:
                # A PTY process has no separate stdin; its terminal is its stdin.
                await _write_fd(mp.pty_master, b64decode(inp["stdin"]))
                return
            stdin = mp.stdin
            if stdin is None or stdin.is_closing():
                raise ConnectError("internal", f"stdin of process {mp.pid} is not open")
            stdin.write(b64decode(inp["stdin"]))

    async def shutdown(self) -> None:
        for mp in list(self.procs.values()):
            if mp.running:
                mp.kill_group()


async def _write_fd(fd: int, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
            view = view[n:]
        except BlockingIOError:
            fut = loop.create_future()
            loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                loop.remove_writer(fd)
        except OSError as exc:
            raise ConnectError("internal", f"writing to terminal failed: {exc}") from None


# ---- RPC handlers ----------------------------------------------------------------------------------

MANAGER_KEY: web.AppKey[ProcessManager] = web.AppKey("process_manager")


def keepalive_interval(request: web.Request) -> float:
    try:
        value = float(request.headers.get("Keepalive-Ping-Interval", ""))
        return value if value > 0 else DEFAULT_KEEPALIVE
    except ValueError:
        return DEFAULT_KEEPALIVE


async def pump(
    queue: asyncio.Queue, interval: float, deadline: float | None, stop_on: str | None
) -> AsyncIterator[dict]:
    """Yield queued events, a `keepalive` after each idle interval; stop after `stop_on` or at deadline."""
    loop = asyncio.get_running_loop()
    while True:
        wait = interval
        if deadline is not None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ConnectError("deadline_exceeded", "the stream deadline was exceeded")
            wait = min(wait, remaining)
        try:
            event = await asyncio.wait_for(queue.get(), wait)
        except TimeoutError:
            if deadline is not None and loop.time() >= deadline:
                raise ConnectError("deadline_exceeded", "the stream deadline was exceeded") from None
            yield {"keepalive": {}}
            continue
        if deadline is not None and loop.time() >= deadline:
            # Seen only after the deadline (a busy loop): the deadline wins, as in connect-go,
            # never an end event of a process our own timeout killed.
            raise ConnectError("deadline_exceeded", "the stream deadline was exceeded")
        yield event
        if stop_on is not None and stop_on in event:
            return


async def rpc_start(request: web.Request, msg: dict) -> AsyncIterator[dict]:
    state = get_state(request)
    manager = request.app[MANAGER_KEY]
    user = rpc_user(request)
    lifetime = connect.parse_timeout_ms(request.headers.get("Connect-Timeout-Ms"))
    # Connect-Timeout-Ms bounds both the stream and the process (as E2B's envd does). The stream's
    # deadline counts from the request, the process's kill timer from its spawn, so the stream
    # always ends first with deadline_exceeded (the SDKs' TimeoutException), never with the end
    # event of the process our timer killed (exit -1, "signal: killed").
    deadline = asyncio.get_running_loop().time() + lifetime if lifetime else None
    mp, queue = await manager.start(state, user, msg, lifetime)
    try:
        yield {"event": {"start": {"pid": mp.pid}}}
        async for event in pump(queue, keepalive_interval(request), deadline, "end"):
            yield {"event": event}
    finally:
        mp.unsubscribe(queue)


async def rpc_connect(request: web.Request, msg: dict) -> AsyncIterator[dict]:
    manager = request.app[MANAGER_KEY]
    rpc_user(request)
    mp = manager.find(pfield(msg, "process"))
    timeout = connect.parse_timeout_ms(request.headers.get("Connect-Timeout-Ms"))
    deadline = asyncio.get_running_loop().time() + timeout if timeout else None
    if not mp.running:
        yield {"event": {"start": {"pid": mp.pid}}}
        yield {"event": {"end": mp.end}}
        return
    queue = mp.subscribe()
    try:
        yield {"event": {"start": {"pid": mp.pid}}}
        async for event in pump(queue, keepalive_interval(request), deadline, "end"):
            yield {"event": event}
    finally:
        mp.unsubscribe(queue)


async def rpc_list(request: web.Request, msg: dict) -> dict:
    rpc_user(request)
    manager = request.app[MANAGER_KEY]
    return {"processes": [mp.info() for mp in manager.procs.values() if mp.running]}


async def rpc_send_input(request: web.Request, msg: dict) -> dict:
    rpc_user(request)
    manager = request.app[MANAGER_KEY]
    mp = manager.find_running(pfield(msg, "process"))
    await manager.write_input(mp, pfield(msg, "input"))
    return {}


async def rpc_stream_input(request: web.Request, messages: AsyncIterator[dict]) -> dict:
    rpc_user(request)
    manager = request.app[MANAGER_KEY]
    mp: ManagedProcess | None = None
    async for msg in messages:
        if "start" in msg:
            mp = manager.find_running(pfield(msg["start"], "process"))
        elif "data" in msg:
            if mp is None:
                raise ConnectError("failed_precondition", "StreamInput data before start")
            await manager.write_input(mp, pfield(msg["data"], "input"))
    return {}


async def rpc_send_signal(request: web.Request, msg: dict) -> dict:
    rpc_user(request)
    manager = request.app[MANAGER_KEY]
    mp = manager.find_running(pfield(msg, "process"))
    sig = connect.enum_value(pfield(msg, "signal"), SIGNALS, "signal")
    if sig == signal.SIGKILL:
        mp.kill_group(signal.SIGKILL)
    elif sig == signal.SIGTERM:
        mp.send_signal(signal.SIGTERM)
    else:
        raise ConnectError("unimplemented", f"signal {sig} is not supported")
    return {}


async def rpc_close_stdin(request: web.Request, msg: dict) -> dict:
    rpc_user(request)
    manager = request.app[MANAGER_KEY]
    mp = manager.find_running(pfield(msg, "process"))
    if mp.pty_master is not None:
        raise ConnectError("failed_precondition", "cannot close stdin of a PTY process; send Ctrl-D instead")
    stdin = mp.stdin
    if stdin is None:
        raise ConnectError("failed_precondition", f"process {mp.pid} was started without stdin")
    stdin.close()
    return {}


async def rpc_update(request: web.Request, msg: dict) -> dict:
    rpc_user(request)
    manager = request.app[MANAGER_KEY]
    mp = manager.find_running(pfield(msg, "process"))
    pty = pfield(msg, "pty")
    if pty is not None:
        if mp.pty_master is None:
            raise ConnectError("failed_precondition", f"process {mp.pid} has no PTY")
        size = pfield(pty, "size") or {}
        _set_winsize(mp.pty_master, int(size.get("cols") or 80), int(size.get("rows") or 24))
    return {}


def add_routes(app: web.Application) -> None:
    base = "/process.Process/"
    app.router.add_post(base + "Start", connect.server_stream(rpc_start))
    app.router.add_post(base + "Connect", connect.server_stream(rpc_connect))
    app.router.add_post(base + "List", connect.unary(rpc_list))
    app.router.add_post(base + "SendInput", connect.unary(rpc_send_input))
    app.router.add_post(base + "StreamInput", connect.client_stream(rpc_stream_input))
    app.router.add_post(base + "SendSignal", connect.unary(rpc_send_signal))
    app.router.add_post(base + "CloseStdin", connect.unary(rpc_close_stdin))
    app.router.add_post(base + "Update", connect.unary(rpc_update))
