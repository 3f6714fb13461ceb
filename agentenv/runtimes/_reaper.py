"""Prompt reaping of runsc's orphaned helper processes.

`runsc run --detach` leaves its sandbox and gofer processes orphaned; when one exits, `runsc delete`
waits until the pid is gone, which includes being reaped. Some hosts' PID 1 reaps orphans only every
couple of seconds (measured: 2.0 s here), so every stop, pause and checkpoint paid ~2 s. The server
therefore becomes a child subreaper (orphans of its descendants reparent to it) and reaps those
orphans itself. It only reaps processes named runsc-*: children that asyncio spawned and is
waiting for (their exit codes matter) are never touched.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
# runsc re-executes /proc/self/exe for its sandbox and gofer processes, so the kernel names them
# "exe"; a zombie has no cmdline left, but keeps this name. Nothing else we run is called that.
ORPHAN_COMM = "exe"


def become_subreaper() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("cannot become a child subreaper: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def process_name(pid: int) -> str:
    """The kernel's name of `pid` (its `comm`), or '' when it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def reap_once() -> int:
    """Reap exited runsc helpers; stops at the first waitable child that is someone else's to reap."""
    reaped = 0
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if info is None or process_name(info.si_pid) != ORPHAN_COMM:
            return reaped
        try:
            os.waitpid(info.si_pid, os.WNOHANG)
            reaped += 1
        except ChildProcessError:
            return reaped


def reap_killed(pids: list[int], timeout: float = 1.0) -> int:
    """Wait (blocking: run it in a thread) until the runsc helpers `pids`, just SIGKILLed, have
    exited, reaping those that are this process's children; returns how many were. A pid that is not
    a child (someone else reaps it, or `reap_forever` already did) is not waited for."""
    deadline = time.monotonic() + timeout
    left, reaped = set(pids), 0
    while left:
        for pid in list(left):
            try:
                done, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                left.discard(pid)
                continue
            if done:
                left.discard(pid)
                reaped += 1
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    return reaped


async def reap_forever(interval: float = 0.05) -> None:
    while True:
        try:
            reap_once()
        except Exception:  # noqa: BLE001 - a reaper must never die
            log.exception("orphan reaper iteration failed")
        await asyncio.sleep(interval)
