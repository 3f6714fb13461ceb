"""Start a user's process with `vfork`: switch this thread's credentials, not the process's.

envd runs as root and starts each command as the requested user. Given `user=`/`group=`, CPython's
`subprocess` must `fork`: a vfork child that called glibc's `setuid` would change the credentials
of every thread of envd too (glibc applies them to all threads of a process). Under gVisor's systrap
platform a fork of envd costs a copy of its address space: `bash -l -c true` as `user` took 31 ms
p50 that way against 16 ms with the credentials switched here first (in a sandbox;
`docs/benchmarks.md`).

Linux keeps credentials per thread; only glibc makes them process-wide. So `spawn_as` switches the
calling thread's groups, gid and uid with the raw syscalls (`users.ThreadCreds`, root stays the
*saved* uid so the thread can switch back), and lets asyncio's `subprocess_exec` call `Popen`
without `user=`, which uses `vfork`: the child inherits the thread's credentials, and its `execve`
makes the saved ids the user's too and drops every capability. asyncio calls `Popen` in the
synchronous first step of `subprocess_exec`, before its first suspension (CPython 3.11–3.13):
`spawn_as` runs that step as the user, switches back before anything else can run on the thread,
then hands the rest of the coroutine to the event loop, and checks the child's real uid. (The
child watcher's thread that 3.11 starts in that step inherits the user's credentials: all it does is
`waitpid` on its own process's child and wake the loop.)
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import types
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

from agentenv.envd.users import ThreadCreds, User, thread_creds_supported

T = TypeVar("T")

class SpawnError(OSError):
    pass


@functools.cache
def available() -> bool:
    """Whether `spawn_as` works here: root, a known architecture, a CPython whose `subprocess_exec`
    spawns in its first step."""
    return os.geteuid() == 0 and thread_creds_supported() and (3, 11) <= sys.version_info[:2] <= (3, 13)


@functools.cache
def _creds() -> ThreadCreds:
    return ThreadCreds()


@types.coroutine
def _resume(coro: Coroutine[Any, Any, T], yielded: Any) -> Generator[Any, Any, T]:
    """Go on with a coroutine whose first step already ran and yielded `yielded` (a future)."""
    while True:
        try:
            sent = yield yielded
        except BaseException as exc:  # noqa: BLE001 - cancellation and the like go to the coroutine
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as stop:
                return stop.value


def _real_uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None   # reaped already
    return None


async def spawn_as(user: User, start: Coroutine[Any, Any, T]) -> T:
    """Await `start`, a `loop.subprocess_exec(...)` without `user=`, so that its process starts as
    `user` (uid, gid, groups). Returns what `start` returns: (transport, protocol)."""
    creds = _creds()
    done = False
    try:
        creds.become(user, real=True)
        try:
            yielded = start.send(None)   # asyncio's Popen runs in this step
        except StopIteration as stop:
            done, result = True, stop.value
    except BaseException:
        start.close()
        raise
    finally:
        try:
            creds.restore()
        except OSError:
            os._exit(70)   # the event loop's thread must never go on as the user
    if not done:
        result = await _resume(start, yielded)
    pid = result[0].get_pid()
    real = _real_uid(pid)
    if real is not None and real != user.uid:   # never expected (a CPython that spawns later)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        raise SpawnError(0, f"process {pid} started with uid {real}, not {user.uid}")
    return result
