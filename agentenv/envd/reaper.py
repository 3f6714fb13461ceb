"""Reaping of orphaned zombies.

Inside the sandbox envd is PID 1, so every orphan is re-parented to it and would stay a zombie forever.
asyncio reaps the processes envd manages (waiting on their specific pids); this reaper only touches
zombie children that are *not* managed, so it never steals an exit status. It runs on SIGCHLD and
periodically, and skips a round while a spawn is in flight (a fresh child may not be registered yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal

log = logging.getLogger("agentenv.envd")

SCAN_INTERVAL = 5.0
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Adopt orphans of our descendants like PID 1 does (for running envd outside a sandbox)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def zombie_children(parent: int) -> list[int]:
    out: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        rest = data.rsplit(b")", 1)[-1].split()
        if len(rest) >= 2 and rest[0] == b"Z" and int(rest[1]) == parent:
            out.append(int(name))
    return out


class OrphanReaper:
    def __init__(self, manager) -> None:
        self._manager = manager
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            self._loop.add_signal_handler(signal.SIGCHLD, self.reap)
        self._schedule()

    def _schedule(self) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_later(SCAN_INTERVAL, self._tick)

    def _tick(self) -> None:
        self.reap()
        self._schedule()

    def reap(self) -> None:
        if self._manager.spawning:
            return
        managed = self._manager.managed_pids()
        for pid in zombie_children(os.getpid()):
            if pid in managed:
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
                log.debug("reaped orphan %d", pid)
            except ChildProcessError:
                pass

    def stop(self) -> None:
        if self._timer:
            self._timer.cancel()
        if self._loop:
            with contextlib.suppress(Exception):
                self._loop.remove_signal_handler(signal.SIGCHLD)
