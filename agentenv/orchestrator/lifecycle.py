"""The one place where sandbox lifecycle transitions are defined.

Every operation (create, pause, resume, snapshot, fork, kill, expiry) asks `Lifecycle.begin` for a
transition; an illegal one is rejected with a 409 that names the current state. A per-sandbox lock
serialises concurrent requests on the same sandbox, so two pauses (or a fork racing a kill) can never
interleave: the second one sees the state the first one left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator

from agentenv.errors import Conflict
from agentenv.models import SandboxState as S

# state -> operation -> (transient state while it runs, final state on success)
TRANSITIONS: dict[S, dict[str, tuple[S, S]]] = {
    S.RUNNING: {
        "pause": (S.PAUSING, S.PAUSED),
        "snapshot": (S.SNAPSHOTTING, S.RUNNING),
        "fork": (S.FORKING, S.RUNNING),
        "kill": (S.KILLING, S.KILLED),
        "expire": (S.KILLING, S.KILLED),
        "expire_pause": (S.PAUSING, S.PAUSED),
    },
    S.PAUSED: {
        "resume": (S.RESUMING, S.RUNNING),
        "kill": (S.KILLING, S.KILLED),
    },
    S.CREATING: {},
    S.FAILED: {"kill": (S.KILLING, S.KILLED)},
    S.LOST: {"kill": (S.KILLING, S.KILLED)},
}

# Cluster node loss: defined with the states (models.py), where the state stores apply it.
from agentenv.models import SURVIVES_NODE_LOSS, after_node_loss  # noqa: E402,F401

# Wording for the 409s, keyed by (state, operation); a generic message covers the rest.
_MESSAGES: dict[tuple[S, str], str] = {
    (S.PAUSED, "pause"): "Sandbox {id} is already paused",
    (S.RUNNING, "resume"): "Sandbox {id} is already running",
    (S.PAUSED, "fork"): "Sandbox {id} is paused; resume it before forking",
    (S.PAUSED, "snapshot"): "Sandbox {id} is paused; resume it before taking a snapshot",
    (S.FORKING, "snapshot"): "Sandbox {id} is being forked; try again when the fork is done",
    (S.SNAPSHOTTING, "fork"): "Sandbox {id} is being snapshotted; try again when the snapshot is done",
}


def check(state: S, op: str, sandbox_id: str) -> tuple[S, S]:
    """Return (transient, final) for `op` from `state`, or raise Conflict."""
    allowed = TRANSITIONS.get(state, {})
    if op in allowed:
        return allowed[op]
    msg = _MESSAGES.get((state, op))
    if msg is None:
        msg = "Cannot {op} sandbox {id}: it is {state}"
    raise Conflict(msg.format(id=sandbox_id, op=op, state=state.value), error_code="sandbox_invalid_state")


class Lifecycle:
    """Per-sandbox locks. Hold `lock(id)` around read-check-transition-persist sequences."""

    def __init__(self) -> None:
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    @contextlib.asynccontextmanager
    async def lock(self, sandbox_id: str) -> AsyncIterator[None]:
        lk = self._locks[sandbox_id]
        async with lk:
            yield

    def forget(self, sandbox_id: str) -> None:
        lk = self._locks.get(sandbox_id)
        if lk is not None and not lk.locked():
            self._locks.pop(sandbox_id, None)
