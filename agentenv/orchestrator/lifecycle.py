"""The one place where sandbox lifecycle transitions are defined, and the only writer of a state.

Every operation (create, pause, resume, snapshot, fork, kill, expiry) asks `Lifecycle.begin` for a
transition; an illegal one is rejected with a 409 that names the current state. A per-sandbox lock
serialises concurrent requests on the same sandbox, so two pauses (or a fork racing a kill) can never
interleave: the second one sees the state the first one left.

`Lifecycle` also holds the node's live records (the state store is the durable copy) and is the
only code that assigns `SandboxRecord.state` (tests/test_import_graph.py checks it): a new sandbox
enters as CREATING (`enter`), a failed start leaves as FAILED (`fail`), an operation moves to its
transient state (`begin`; `claim` also persists it, for a resume), back where it was when it is
refused (`rollback`, `unclaim`) and to its final state when it is done (`settle`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator

from agentenv.errors import Conflict, sandbox_not_found
from agentenv.models import SURVIVES_NODE_LOSS, SandboxRecord, after_node_loss
from agentenv.models import SandboxState as S

# Cluster node loss is defined with the states (models.py), where the state stores apply it.
__all__ = ["TRANSITIONS", "SURVIVES_NODE_LOSS", "after_node_loss", "check", "Lifecycle"]

# state -> operation -> (transient state while it runs, final state on success)
TRANSITIONS: dict[S, dict[str, tuple[S, S]]] = {
    S.RUNNING: {
        "pause": (S.PAUSING, S.PAUSED),
        "snapshot": (S.SNAPSHOTTING, S.RUNNING),
        "fork": (S.FORKING, S.RUNNING),
        "checkpoint": (S.SNAPSHOTTING, S.RUNNING),
        "rollback": (S.RESUMING, S.RUNNING),
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

# Wording for the 409s, keyed by (state, operation); a generic message covers the rest.
_MESSAGES: dict[tuple[S, str], str] = {
    (S.PAUSED, "pause"): "Sandbox {id} is already paused",
    (S.RUNNING, "resume"): "Sandbox {id} is already running",
    (S.PAUSED, "fork"): "Sandbox {id} is paused; resume it before forking",
    (S.PAUSED, "snapshot"): "Sandbox {id} is paused; resume it before taking a snapshot",
    (S.FORKING, "snapshot"): "Sandbox {id} is being forked; try again when the fork is done",
    (S.SNAPSHOTTING, "fork"): "Sandbox {id} is being snapshotted; try again when the snapshot is done",
    (S.PAUSED, "checkpoint"): "Sandbox {id} is paused; resume it before taking a checkpoint",
    (S.PAUSED, "rollback"): "Sandbox {id} is paused; resume it before rolling it back",
    (S.SNAPSHOTTING, "rollback"): "Sandbox {id} is being captured; roll it back when the capture is done",
    (S.FORKING, "rollback"): "Sandbox {id} is being forked; roll it back when the fork is done",
    (S.RESUMING, "checkpoint"): "Sandbox {id} is being restored (rollback or resume); try again when it is done",
    (S.RESUMING, "rollback"): "Sandbox {id} is already being rolled back or resumed; try again when it is done",
    (S.FORKING, "checkpoint"): "Sandbox {id} is being forked; try again when the fork is done",
    (S.SNAPSHOTTING, "checkpoint"): "Sandbox {id} is being captured; try again when the capture is done",
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
    """Per-sandbox locks, the live records, and every state change.

    Hold `lock(id)` around read-check-transition-persist sequences."""

    def __init__(self, store=None) -> None:
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.store = store
        self._records: dict[str, SandboxRecord] = {}

    @contextlib.asynccontextmanager
    async def lock(self, sandbox_id: str) -> AsyncIterator[None]:
        lk = self._locks[sandbox_id]
        async with lk:
            yield

    def forget(self, sandbox_id: str) -> None:
        lk = self._locks.get(sandbox_id)
        if lk is not None and not lk.locked():
            self._locks.pop(sandbox_id, None)

    # ------------------------------------------------------------------ reads

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        return self._records.get(sandbox_id)

    def records(self) -> list[SandboxRecord]:
        return list(self._records.values())

    def live(self, sandbox_id: str, team_id: str | None) -> SandboxRecord:
        """The record of a sandbox that is not being killed (and is `team_id`'s), else 404."""
        rec = self._records.get(sandbox_id)
        if rec is None or (team_id is not None and rec.team_id != team_id) or rec.state in (S.KILLED, S.KILLING):
            raise sandbox_not_found(sandbox_id)
        return rec

    # ------------------------------------------------------------------ writes

    def enter(self, rec: SandboxRecord) -> None:
        """A new sandbox (create, fork child) is CREATING from here on (no await: admission binds it)."""
        rec.state = S.CREATING
        self._records[rec.sandbox_id] = rec

    def adopt(self, rec: SandboxRecord, state: S | None = None) -> None:
        """Hold a record that exists elsewhere already (restart reconcile, a paused sandbox moved here)."""
        if state is not None:
            rec.state = state
        self._records[rec.sandbox_id] = rec

    def begin(self, rec: SandboxRecord, op: str) -> tuple[S, S]:
        """Check `op` from the current state and move to its transient state; (before, final)."""
        before = rec.state
        transient, final = check(rec.state, op, rec.sandbox_id)
        rec.state = transient
        return before, final

    async def claim(self, rec: SandboxRecord, before: S) -> None:
        """Persist the transient state `begin` set, by a write only the sandbox's owner makes: in a
        cluster, a resume that another node's adoption overtook is refused (409, back to `before`),
        and while the store says RESUMING no node can adopt the sandbox (`claim_sandbox` takes only
        PAUSED ones). A claimed operation that fails goes back with `unclaim`."""
        try:
            written = await self.store.put_sandbox(rec)
        except BaseException:
            rec.state = before
            raise
        if not written:
            rec.state = before
            raise Conflict(f"Sandbox {rec.sandbox_id} was taken over by another node; try again",
                           error_code="sandbox_changing_state")

    async def unclaim(self, rec: SandboxRecord, before: S) -> None:
        """A claimed operation failed: back to `before`, in the store too."""
        rec.state = before
        await self.store.put_sandbox(rec)

    def rollback(self, rec: SandboxRecord, before: S) -> None:
        """An operation refused before anything happened: back to where it was (not persisted: the
        store never saw the transient state)."""
        rec.state = before

    def mark(self, rec: SandboxRecord, state: S) -> None:
        """Set a state without persisting it (the caller persists it with more fields, or not at all)."""
        rec.state = state

    async def settle(self, rec: SandboxRecord, state: S | None = None) -> None:
        """Land in `state` (None: keep the current one) and persist the record."""
        if state is not None:
            rec.state = state
        await self.store.put_sandbox(rec)

    async def persist(self, rec: SandboxRecord) -> None:
        await self.store.put_sandbox(rec)

    def drop(self, sandbox_id: str) -> SandboxRecord | None:
        """No longer on this node (its durable record is the caller's business: `remove`)."""
        return self._records.pop(sandbox_id, None)

    async def remove(self, rec: SandboxRecord, state: S = S.KILLED) -> None:
        """The sandbox is gone: `state` (KILLED, or FAILED for a start that failed), out of the live
        view and deleted from the store."""
        rec.state = state
        self._records.pop(rec.sandbox_id, None)
        await self.store.delete_sandbox(rec.sandbox_id)

    def fail(self, rec: SandboxRecord) -> None:
        """A start (or a capture's restore) failed: FAILED, out of the live view at once (no await:
        admission unbinds it); the caller deletes the durable record after the teardown."""
        rec.state = S.FAILED
        self._records.pop(rec.sandbox_id, None)
