"""Running external commands (runsc, nft, nsenter) from asyncio with a timeout on every call."""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import time
from dataclasses import dataclass
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


async def run_cmd(
    argv: Sequence[str],
    *,
    timeout: float,
    input: bytes | None = None,
    check: bool = True,
    output_file: IO[bytes] | None = None,
    what: str | None = None,
) -> CmdResult:
    """Run `argv`, kill it (by PID) on timeout, log the command line and duration at debug level.

    With `output_file`, stdout+stderr go there instead of pipes: needed for commands that leave
    long-lived children holding their stdio (a pipe would never reach EOF).
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
        stdout=(stdout_b or b"").decode(errors="replace"),
        stderr=(stderr_b or b"").decode(errors="replace"),
        duration=dur,
    )
    log.debug("cmd %s -> rc=%d in %.3fs", shlex.join(argv), res.returncode, dur)
    if check and res.returncode != 0:
        detail = (res.stderr.strip() or res.stdout.strip())[-2000:]
        raise RuntimeFailure(f"{what or argv[0]} failed (rc={res.returncode}): {detail}")
    return res
