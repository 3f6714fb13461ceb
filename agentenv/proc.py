"""The subprocess runner: external commands from asyncio with a timeout on every call.

`run_cmd` (runsc, nft, ip, nsenter: captured stdout/stderr, a `CmdResult`) and `run_streamed` (long
jobs in their own session: image builds, downloads; output streamed to a log or line callback,
`CommandError` on failure). Network, storage and runtimes all use this module (it imports nothing
of theirs), so none of them imports another for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

from agentenv.errors import RuntimeFailure

log = logging.getLogger(__name__)


@dataclass
class CmdResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    duration: float


def pid_exists(pid: int) -> bool:
    """Whether process `pid` exists in this pid namespace, a zombie (not yet reaped) included."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    if not pid_exists(pid):
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def run_cmd(
    argv: Sequence[str],
    *,
    timeout: float,
    input: bytes | None = None,
    check: bool = True,
    output_file: IO[bytes] | None = None,
    what: str | None = None,
    errors: str = "replace",
    new_session: bool = False,
) -> CmdResult:
    """Run `argv`, kill it (by PID) on timeout, log the command line and duration at debug level.

    With `output_file`, stdout+stderr go there instead of pipes: needed for commands that leave
    long-lived children holding their stdio (a pipe would never reach EOF). With `new_session`, a
    signal to the caller's process group (Ctrl-C in a terminal, a kill of the group) does not reach
    it: for commands that must not die half-way (runsc saving a container's state).
    """
    argv = [os.fspath(a) for a in argv]
    start = time.monotonic()
    if output_file is not None:
        out = err = output_file
    else:
        out = err = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        start_new_session=new_session,
    )
    try:
        stdout_b, stderr_b = await asyncio.wait_for(proc.communicate(input), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError) as e:
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            await proc.wait()
        dur = time.monotonic() - start
        log.debug("cmd %s: %s after %.3fs", shlex.join(argv), type(e).__name__, dur)
        if isinstance(e, asyncio.CancelledError):
            raise
        raise RuntimeFailure(f"{what or argv[0]} timed out after {timeout:.0f}s: {shlex.join(argv)}") from None
    dur = time.monotonic() - start
    res = CmdResult(
        argv=argv,
        returncode=proc.returncode if proc.returncode is not None else -1,
        stdout=(stdout_b or b"").decode(errors=errors),  # "surrogateescape": file names as os.fsdecode has them
        stderr=(stderr_b or b"").decode(errors="replace"),
        duration=dur,
    )
    log.debug("cmd %s -> rc=%d in %.3fs", shlex.join(argv), res.returncode, dur)
    if check and res.returncode != 0:
        detail = (res.stderr.strip() or res.stdout.strip())[-2000:]
        raise RuntimeFailure(f"{what or argv[0]} failed (rc={res.returncode}): {detail}")
    return res


class CommandError(RuntimeFailure):
    """An external command failed or timed out."""


async def run_streamed(
    argv: Sequence[str | os.PathLike[str]],
    *,
    timeout: float,
    log: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Run argv with a hard timeout; returns combined output (or "" when `log` is given). For long
    jobs (image builds, downloads) whose output is streamed to a log or a progress callback.

    The child gets its own session so a timeout kills the whole group it spawned (by its id),
    never anything else. Output goes to `log` (appended) when given; `on_line` sees every line.
    """
    argv = [os.fspath(a) for a in argv]
    logf = open(log, "ab") if log is not None else None
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        chunks: list[bytes] = []

        async def pump() -> None:
            assert proc.stdout is not None
            while line := await proc.stdout.readline():
                if logf is not None:
                    logf.write(line)
                    logf.flush()
                else:
                    chunks.append(line)
                if on_line is not None:
                    on_line(line.decode("utf-8", "replace").rstrip("\n"))
            await proc.wait()

        try:
            await asyncio.wait_for(pump(), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            if isinstance(exc, asyncio.CancelledError):
                raise
            where = f" (log: {log})" if log else ""
            raise CommandError(f"{argv[0]} timed out after {timeout:.0f}s{where}") from None
        out = b"".join(chunks).decode("utf-8", "replace")
        if proc.returncode != 0:
            where = f"; see {log}" if log else f": {out.strip()[-2000:]}"
            raise CommandError(f"{' '.join(argv[:3])} … exited with {proc.returncode}{where}")
        return out
    finally:
        if logf is not None:
            logf.close()
