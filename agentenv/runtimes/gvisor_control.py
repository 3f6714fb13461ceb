"""Freezing, thawing and checkpointing a gVisor sandbox through its control socket, as `runsc pause`,
`resume` and `checkpoint --leave-running` do.

Every runsc command is a ~60 MB Go binary starting: 18 ms and 11 ms of CPU here before it does
anything (measured with `runsc --version`), and `runsc pause` + `runsc resume` took 15–20 ms each.
A capture that keeps the sandbox running pays both while the sandbox is frozen, a pause pays the
first. What they do is small: under runsc's lock on the container (`<root>/<id>_sandbox:<id>.lock`),
one call to the sandbox's control server (`<root>/runsc-<id>.sock`, gVisor's urpc: one JSON object
`{"method", "arg"}` a call, answered by `{"success", "err", "result"}`), and the new status saved in
the container's state file. Done here, that is 0.3–1.5 ms.

The order of the steps is chosen for a server killed between them (runsc's CLI has the same window
when it is killed). The Sentry's pause is counted, and a resume of a sandbox that is not paused
panics the Sentry: the sandbox is gone (measured). So the state file never says "paused" when the
sandbox is not: a freeze saves "paused" after the Sentry answered, a thaw saves "running" before it
asks. A kill in between leaves a frozen sandbox whose state says "running": it keeps its memory and
disk (a pause and resume, or a kill, still work), where the other order could destroy it.

A checkpoint is the same call `runsc checkpoint` makes (`Sandbox.Checkpoint` in runsc/sandbox): the
image files are created here and handed to the Sentry with the call (SCM_RIGHTS), and the Sentry
writes them. Through runsc that costs a runsc start and, for `--network=sandbox` on this kernel,
the `unshare` + `sh` + `nsenter` + `mount` wrapper around it (`gvisor._NETNS_WRAPPER`) while the
sandbox is frozen: 30–40 ms of a ~110 ms freeze, measured (docs/benchmarks.md).

Anything that means nothing was asked of the Sentry (no socket, a path too long for one, a state
file that is not as expected, a method this runsc does not know) returns False, and the caller runs
the runsc command instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path
from typing import Any

from agentenv.errors import RuntimeFailure
from agentenv.runtimes.gvisor_state import StateFiles

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 20.0  # as a runsc command's (gvisor.SHORT_TIMEOUT); a pause waits for every task to stop
_MAX_REPLY = 1 << 20


# runsc/boot/restore.go: the state file, and with an uncompressed image its pages and their index
STATE_FILE, PAGES_META_FILE, PAGES_FILE = "checkpoint.img", "pages_meta.img", "pages.img"
_UNKNOWN_METHOD = "unknown method"  # pkg/urpc: ErrUnknownMethod, answered before anything runs


class NotAsked(Exception):
    """The control server was not asked anything (or refused the call before running it)."""


class Failed(Exception):
    """The control server ran the call, and it failed (its error is the message)."""


def call(path: Path, sandbox_id: str, method: str, arg: Any = None, timeout: float = CALL_TIMEOUT_S) -> Any:
    """One urpc call to the sandbox's control server at `path` (`StateFiles.control_socket`); its
    result. `NotAsked` when the call did not run; RuntimeFailure when it was sent and no answer came
    (the sandbox died, or it took too long)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    what = f"{method} of sandbox {sandbox_id}"
    try:
        try:
            sock.connect(str(path))
        except OSError as e:  # missing, refused, or a path longer than sun_path
            raise NotAsked(f"{path}: {e}") from None
        sock.sendall(_request(method, arg))
        reply = _Reply(what)
        while not reply.feed(_recv(sock, what)):
            pass
    finally:
        sock.close()
    return reply.result(fds=False)


async def call_async(path: Path, sandbox_id: str, method: str, arg: Any, *, timeout: float, fds: list[int]) -> Any:
    """`call` with `fds` handed over with it (urpc's FilePayload, SCM_RIGHTS), waiting for the answer
    on the event loop (a checkpoint takes as long as its image: no thread is held). `Failed` when
    the call ran and failed."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    what = f"{method} of sandbox {sandbox_id}"
    try:
        try:
            await loop.sock_connect(sock, str(path))
            data = _request(method, arg)
            sent = socket.send_fds(sock, [data], fds)  # the files ride on the first bytes
        except OSError as e:  # missing, refused, a path longer than sun_path; nothing was sent
            raise NotAsked(f"{path}: {e}") from None
        if sent < len(data):
            await loop.sock_sendall(sock, data[sent:])
        reply = _Reply(what)

        async def answer() -> None:
            while True:
                try:
                    chunk = await loop.sock_recv(sock, 65536)
                except OSError as e:
                    raise RuntimeFailure(f"no answer to {what}: {e}") from None
                if reply.feed(_checked(chunk, what)):
                    return

        try:
            await asyncio.wait_for(answer(), timeout)
        except asyncio.TimeoutError:
            raise RuntimeFailure(f"no answer to {what} within {timeout:.0f}s") from None
    finally:
        sock.close()
    return reply.result(fds=True)


def _request(method: str, arg: Any) -> bytes:
    return json.dumps({"method": method, "arg": arg}).encode()


def _recv(sock: socket.socket, what: str) -> bytes:
    try:
        chunk = sock.recv(65536)
    except OSError as e:  # a timeout included
        raise RuntimeFailure(f"no answer to {what}: {e}") from None
    return _checked(chunk, what)


def _checked(chunk: bytes, what: str) -> bytes:
    if not chunk:
        raise RuntimeFailure(f"no answer to {what}: the sandbox closed its control socket")
    return chunk


class _Reply:
    """urpc's answer, one JSON object `{"success", "err", "result"}`, as its bytes come in."""

    def __init__(self, what: str) -> None:
        self.what, self.buf, self.value = what, b"", None

    def feed(self, chunk: bytes) -> bool:
        """True once the whole answer is in."""
        self.buf += chunk
        try:
            self.value = json.JSONDecoder().raw_decode(self.buf.decode())[0]
            return True
        except ValueError:
            if len(self.buf) > _MAX_REPLY:
                raise RuntimeFailure(f"no readable answer to {self.what}") from None
            return False

    def result(self, *, fds: bool) -> Any:
        """The call's result. A failure is `NotAsked` for a method this runsc lacks (and for any
        failure of a call without files: freeze and thaw refuse before doing anything), else `Failed`."""
        reply = self.value
        if not isinstance(reply, dict) or not reply.get("success"):
            err = reply.get("err") if isinstance(reply, dict) else reply
            if fds and err != _UNKNOWN_METHOD:
                raise Failed(str(err))
            raise NotAsked(f"{self.what} refused: {err}")
        return reply.get("result")


class Control:
    """`freeze`, `thaw` and `checkpoint` of the containers under one runsc root (its `StateFiles`):
    freeze and thaw block (run them in a thread), a checkpoint is awaited."""

    def __init__(self, states: StateFiles) -> None:
        self.states = states

    def freeze(self, sandbox_id: str) -> bool:
        """Pause a running sandbox; False when nothing was done (the caller runs `runsc pause`)."""
        with self.states.held(sandbox_id) as state:
            if state is None or state.get("status") != "running":
                return False
            try:
                call(self.states.control_socket(sandbox_id), sandbox_id, "containerManager.Pause")
            except NotAsked as e:
                log.debug("freeze of %s through runsc: %s", sandbox_id, e)
                return False
            self.states.save(sandbox_id, state, "paused")
        return True

    def thaw(self, sandbox_id: str) -> bool:
        """Resume a sandbox this or `runsc pause` froze; False when nothing was done (the caller runs
        `runsc resume`, which refuses a sandbox that is not paused)."""
        with self.states.held(sandbox_id) as state:
            if state is None or state.get("status") != "paused":
                return False
            self.states.save(sandbox_id, state, "running")
            try:
                call(self.states.control_socket(sandbox_id), sandbox_id, "containerManager.Resume")
            except NotAsked as e:
                self.states.save(sandbox_id, state, "paused")
                log.debug("thaw of %s through runsc: %s", sandbox_id, e)
                return False
        return True

    async def checkpoint(self, sandbox_id: str, image_dir: Path, compression: str, timeout: float) -> bool:
        """Write the memory image of a running or frozen sandbox into `image_dir` and leave it as it
        was, as `runsc checkpoint --leave-running --compression=<compression>` does; False when
        nothing was asked (the caller runs that command). `Failed` says why the Sentry refused (it
        runs on; a frozen one stays frozen), RuntimeFailure that no answer came."""
        if not await asyncio.to_thread(self._status_in, sandbox_id, ("running", "paused")):
            return False  # what runsc's CLI checks first
        names = [STATE_FILE] + ([PAGES_META_FILE, PAGES_FILE] if compression == "none" else [])
        files = []
        try:
            for name in names:
                files.append(open(image_dir / name, "xb"))
            await call_async(self.states.control_socket(sandbox_id), sandbox_id, "containerManager.Checkpoint",
                             {"key": None, "metadata": {"compression": compression},
                              "MemoryFileSaveOpts": {"ExcludeCommittedZeroPages": False},
                              "have_pages_file": len(files) > 1, "Resume": True},
                             timeout=timeout, fds=[f.fileno() for f in files])
        except NotAsked as e:
            log.debug("checkpoint of %s through runsc: %s", sandbox_id, e)
            for name in names:
                (image_dir / name).unlink(missing_ok=True)
            return False
        finally:
            for f in files:
                f.close()
        return True

    def _status_in(self, sandbox_id: str, statuses: tuple[str, ...]) -> bool:
        with self.states.held(sandbox_id) as state:
            return state is not None and state.get("status") in statuses
