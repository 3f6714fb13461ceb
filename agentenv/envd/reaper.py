"""Reaping of orphaned zombies.

Inside the sandbox envd is PID 1, so every orphan is re-parented to it and would stay a zombie forever.
asyncio reaps the processes envd manages (waiting on their specific pids); this reaper only touches
zombie children that are *not* managed, so it never steals an exit status. It runs shortly after a
SIGCHLD and periodically, and skips a round while a spawn is in flight (a fresh child may not be
registered yet).

A round reads the stat file of every process in the sandbox, a few ms on the event loop's thread in
gVisor and more the more processes run. Each command's own exit raises a SIGCHLD too, so the rounds
that SIGCHLDs ask for are coalesced: at most one per ORPHAN_DELAY, run after it, off the path of the
command whose exit asked for it.
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
ORPHAN_DELAY = 0.5  # a SIGCHLD's round runs this much later, one for all SIGCHLDs meanwhile
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
        self._soon: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            self._loop.add_signal_handler(signal.SIGCHLD, self._sigchld)
        self._schedule()

    def _sigchld(self) -> None:
        assert self._loop is not None
        if self._soon is None:
            self._soon = self._loop.call_later(ORPHAN_DELAY, self._reap_soon)

    def _reap_soon(self) -> None:
        self._soon = None
        self.reap()

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
        for timer in (self._timer, self._soon):
            if timer:
                timer.cancel()
        if self._loop:
            with contextlib.suppress(Exception):
                self._loop.remove_signal_handler(signal.SIGCHLD)
