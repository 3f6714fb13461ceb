"""Network slots made ahead of demand: a create, resume or fork child adopts one instead of building it.

Building a slot (a netns, two veth pairs, their addresses, routes and neighbours: ~25 netlink calls)
takes ~14 ms on the path of every sandbox that comes up, before its runtime can start in it. A spare
is a slot built while the node is quiet, under a name of its own; `NetworkManager.allocate` renames
it to the sandbox's (one bind mount and one netlink call, 2–5 ms) and installs its rules as usual.
A released slot whose sandbox is gone for sure (its runtime stopped it) becomes a spare again
while there are fewer than `target`: its connection tracking is flushed, its internet switch turned
off and its links put back as before a start (`NetworkManager.release(reuse=True)`; its old rules
stay until the next sandbox's replace them before its `activate`). That spares the kernel deleting
a netns and two veth pairs and building them anew. e2b-dev/infra's orchestrator keeps such pools of
new and of reused slots too. Spares belong to a server process (`SlotNames.spare_netns_name`): a
start or `agentenv gc` removes a dead server's (`NetworkManager.drop_stale_spares`).

Spares are filled only while no sandbox is coming up (a slot handed out and not yet activated or
released) and none was for `QUIET_S`: bringing sandboxes up is what the node's CPU is for, and a
fill during a fork of 16 would slow its children by what it saves them. Under sustained load the
spares run out and `allocate` builds slots as before.
The filling starts at the first allocation (a server that never starts a sandbox builds none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from agentenv.network.slots import NetSlot

log = logging.getLogger(__name__)

QUIET_S = 1.0       # no slot handed out or activated for this long: the node is quiet enough to fill
STUCK_S = 60.0      # a slot handed out this long ago and never activated or released no longer counts
RETRY_S = 5.0       # after a failed build


class SpareSlots:
    """Up to `target` ready slots; `make` builds one, `drop` removes one (both the manager's)."""

    def __init__(self, target: int, make: Callable[[], Awaitable[NetSlot]],
                 drop: Callable[[NetSlot], Awaitable[None]]) -> None:
        self.target = target
        self._make, self._drop = make, drop
        self._ready: list[NetSlot] = []
        self._task: asyncio.Task | None = None
        self._busy_until = 0.0
        self._coming_up: dict[str, float] = {}  # sandbox id -> when its slot was handed out
        self._closed = False

    def __len__(self) -> int:
        return len(self._ready)

    def coming_up(self, sandbox_id: str) -> None:
        """`sandbox_id` got a slot (a spare or a new one): no filling until it is up or gone."""
        now = time.monotonic()
        self._coming_up[sandbox_id] = now
        self._busy_until = now + QUIET_S

    def up(self, sandbox_id: str) -> None:
        """Its slot was activated or released."""
        if self._coming_up.pop(sandbox_id, None) is not None:
            self._busy_until = time.monotonic() + QUIET_S

    def _quiet(self) -> float:
        """0 when the node is quiet enough to fill, else how long to wait before looking again."""
        now = time.monotonic()
        for sid, since in list(self._coming_up.items()):
            if now - since > STUCK_S:
                del self._coming_up[sid]
        if self._coming_up:
            return QUIET_S
        return max(self._busy_until - now, 0.0)

    def wants(self) -> bool:
        """Whether a released slot, reset, would be kept (`put`) rather than removed."""
        return bool(self.target) and not self._closed and len(self._ready) < self.target

    def put(self, slot: NetSlot) -> bool:
        """Keep a released slot, reset for its next sandbox (`NetworkManager.release(reuse=True)`);
        False once closed (the caller removes it)."""
        if self._closed:
            return False
        self._ready.append(slot)
        return True

    def take(self) -> NetSlot | None:
        """A ready slot, or None; either way the filling is (re)armed."""
        slot = self._ready.pop() if self._ready else None
        if self.target and not self._closed and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._fill(), name="network-spares")
        return slot

    async def _fill(self) -> None:
        while len(self._ready) < self.target and not self._closed:
            wait = self._quiet()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            try:
                slot = await self._make()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a create builds its slot itself meanwhile
                log.warning("could not build a spare network slot: %s", e)
                await asyncio.sleep(RETRY_S)
                continue
            self._ready.append(slot)

    async def close(self) -> None:
        """Stop filling and remove every spare."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while self._ready:
            await self._drop(self._ready.pop())
