"""Process lifetimes that count only the time the sandbox ran.

A command's timeout bounds the process itself, as in E2B's envd (the request's deadline becomes the
process's). On E2B's Firecracker a paused sandbox's guest clock stands still, so a command started
with `timeout=60` that lives across a pause keeps the rest of its 60 s. gVisor instead moves a
restored sandbox's CLOCK_MONOTONIC forward by the wall time its image spent on disk (its
Timekeeper's `SetClocks`: "as if the app was simply not scheduled"), so every kill timer would count
the pause, and fire the moment the sandbox is restored.

The host knows how long the sandbox was away (the capture's time is kept with the memory image) and
says so in the `/init` that follows a restore (`agentenvAwayMs`, `Lifetimes.shift`): every deadline
moves back by that much. Timers already due fire at the restore, before that `/init` can arrive, so a
timer that fires more than LATE_S late holds its kill for up to HOLD_S, waiting for the host's word;
without it (a sandbox merely starved of CPU for that long), it kills then. A timer less late than
that kills at once, so a command can lose up to LATE_S of its timeout to a pause.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("agentenv.envd")

LATE_S = 2.0   # a kill timer this late: the sandbox was probably restored, its clock moved on
HOLD_S = 10.0  # how long such a kill waits for the host to say how long the sandbox was away


@dataclass(eq=False)
class Deadline:
    """One process's kill timer (`Lifetimes.start`), on the event loop's clock."""

    at: float
    kill: Callable[[], None]
    what: str
    handle: asyncio.TimerHandle | None = None
    held: bool = False


class Lifetimes:
    """Every running process's deadline, movable as a whole when the host says the sandbox was away."""

    def __init__(self) -> None:
        self._live: set[Deadline] = set()

    def start(self, lifetime: float, kill: Callable[[], None], what: str) -> Deadline:
        """Call `kill` once the sandbox has run `lifetime` seconds from now; `cancel` it at the end."""
        d = Deadline(asyncio.get_running_loop().time() + lifetime, kill, what)
        self._live.add(d)
        self._arm(d, d.at)
        return d

    def cancel(self, d: Deadline | None) -> None:
        if d is not None:
            self._live.discard(d)
            if d.handle is not None:
                d.handle.cancel()

    def shift(self, seconds: float) -> None:
        """The sandbox was away `seconds` (restored from an image that old): move every deadline back
        by that much. A deadline still due after that was due while it ran: it kills at once."""
        if seconds <= 0:
            return
        now = asyncio.get_running_loop().time()
        for d in self._live:
            if d.handle is not None:
                d.handle.cancel()
            d.at += seconds
            d.held = d.at <= now
            self._arm(d, d.at)
        if self._live:
            log.info("%d process deadline(s) moved %.3fs later: the sandbox was away that long",
                     len(self._live), seconds)

    def _arm(self, d: Deadline, when: float) -> None:
        d.handle = asyncio.get_running_loop().call_at(when, self._due, d)

    def _due(self, d: Deadline) -> None:
        if d not in self._live:
            return
        loop = asyncio.get_running_loop()
        late = loop.time() - d.at
        if late > LATE_S and not d.held:
            d.held = True
            log.info("the kill timer of %s fired %.1fs late (a restore?): held up to %.0fs for the host's "
                     "word on how long the sandbox was away", d.what, late, HOLD_S)
            self._arm(d, loop.time() + HOLD_S)
            return
        self._live.discard(d)
        log.info("%s reached its timeout: killed", d.what)
        d.kill()
