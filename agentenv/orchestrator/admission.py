"""Admission: node capacity and each team's concurrent-sandbox quota.

A start (create, resume, fork child) is admitted before anything happens and counted from that
moment: by its reservation until its record exists, then by the record (`bind`).

- Node capacity is this node's business: checked and reserved in memory, with no await in between,
  so concurrent starts cannot both take the node's last place.
- The team quota holds across every node sharing the state store (a cluster's PostgreSQL, or a
  single node's SQLite, through the same code): `StateStore.reserve_team` counts the team's
  sandboxes of every node plus the reservations of starts in flight and adds this start's, in one
  transaction under a per-team lock. A start binds its reservation to its sandbox id before its
  record is written, so the store counts it once (the reservation until the record counts, then
  the record); the reservation is released when the admission ends (started, failed or refused).
  A node's leftover reservations go when it starts again or is declared dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from agentenv.config import Settings
from agentenv.errors import TooManyRequests, Unavailable
from agentenv.models import QUOTA_EXEMPT, SandboxRecord, SandboxState

log = logging.getLogger("agentenv.orchestrator")

# States whose sandboxes do not count against a team's quota (starts do: their record stands for them).
_NOT_COUNTED = tuple(QUOTA_EXEMPT)
# ... nor against the node's capacity (a dying sandbox still holds the node's resources).
_NOT_ON_NODE = (SandboxState.PAUSED, SandboxState.KILLED, SandboxState.FAILED)


@dataclass
class _Admitted:
    """An admission in flight: `left` of its sandboxes have no record yet (`Admission.bind`)."""

    team_id: str
    left: int
    unbound: list[str]  # its team reservations in the store not bound to a sandbox yet


# The admission the current task's starts belong to (fork children: copied into their tasks).
_ADMISSION: contextvars.ContextVar[_Admitted | None] = contextvars.ContextVar("agentenv_admission", default=None)


class Admission:
    def __init__(self, settings: Settings, store, records: Callable[[], Iterable[SandboxRecord]]) -> None:
        self.settings = settings
        self.store = store
        self._records = records
        # team -> sandboxes being created/resumed/forked (admitted, not yet settled): counted both by the
        # team's quota and by the node's capacity from the moment they are admitted.
        self._reserved: dict[str, int] = {}
        self._unreleased: list[str] = []  # store reservations whose release failed: retried

    @property
    def starting(self) -> int:
        """Admitted sandbox starts (creates, resumes, fork children) that have no record yet."""
        return sum(self._reserved.values())

    def node_active(self) -> int:
        """Sandboxes that hold (or are about to hold) this node's resources: every record that is not
        paused (starting, running, dying) plus admitted starts without a record yet. A start counts
        once: its admission stands for it until its record exists (`bind`)."""
        return sum(1 for r in self._records() if r.state not in _NOT_ON_NODE) + self.starting

    def team_active(self, team_id: str) -> int:
        """Sandboxes counted against the team's quota: not paused (nor dying), plus admitted starts
        without a record yet."""
        settled = sum(1 for r in self._records() if r.team_id == team_id and r.state not in _NOT_COUNTED)
        return settled + self._reserved.get(team_id, 0)

    def bind(self) -> str | None:
        """A start of the current admission now has a counted record (CREATING, or RESUMING): the
        record counts for it from here on, not the admission. Called with no await between the
        record change and this call, so nothing counts it twice or not at all on this node. Returns
        the store reservation to bind to the sandbox (`bind_shared`) before its record is written."""
        adm = _ADMISSION.get()
        if adm is not None and adm.left > 0:
            adm.left -= 1
            self._unreserve(adm.team_id, 1)
            return adm.unbound.pop() if adm.unbound else None
        return None

    def unbind(self, reservation: str | None = None) -> None:
        """Undo `bind` for a start whose record went away while its admission still stands (its
        store reservation counts again: its sandbox's record no longer does)."""
        adm = _ADMISSION.get()
        if adm is not None:
            adm.left += 1
            self._reserved[adm.team_id] = self._reserved.get(adm.team_id, 0) + 1
            if reservation is not None:
                adm.unbound.append(reservation)

    async def bind_shared(self, reservation: str | None, sandbox_id: str) -> None:
        """Tell the store which sandbox a reservation is for, so that its record, once written,
        stands for it. A failure only over-counts the team until the admission ends."""
        if reservation is None:
            return
        try:
            await self.store.bind_reservation(reservation, sandbox_id)
        except Exception as e:  # noqa: BLE001 - conservative: the reservation keeps counting
            log.warning("could not bind the team reservation of %s: %s", sandbox_id, e)

    def _unreserve(self, team_id: str, n: int) -> None:
        left = self._reserved.get(team_id, 0) - n
        if left > 0:
            self._reserved[team_id] = left
        else:
            self._reserved.pop(team_id, None)

    def _admit(self, n: int = 1) -> None:
        if self.node_active() + n > self.settings.max_sandboxes:
            raise Unavailable(f"node is at capacity ({self.settings.max_sandboxes} sandboxes); retry later",
                              error_code="capacity_exhausted")

    async def _team_limit(self, team_id: str) -> int:
        team = await self.store.get_team(team_id)
        if team is not None and team.max_sandboxes is not None:
            return team.max_sandboxes
        return self.settings.max_sandboxes_per_team

    async def _release(self, ids: list[str]) -> None:
        ids = ids + self._unreleased
        self._unreleased = []
        try:
            await self.store.release_reservations(ids)
        except Exception as e:  # noqa: BLE001 - retried with the next release; they expire anyway
            log.warning("could not release %d team reservation(s): %s", len(ids), e)
            self._unreleased.extend(ids)

    async def clear(self) -> None:
        """A node starting: its reservations of a previous run (a crash) stop counting."""
        n = await self.store.clear_reservations(self.settings.node_id)
        if n:
            log.info("released %d team reservation(s) left by this node's previous run", n)

    @contextlib.asynccontextmanager
    async def admit(self, team_id: str, n: int = 1) -> AsyncIterator[None]:
        """Node capacity + the team's concurrent-sandbox quota (over every node) for `n` more
        sandboxes, held until they are up (or failed)."""
        limit = await self._team_limit(team_id)
        self._admit(n)
        self._reserved[team_id] = self._reserved.get(team_id, 0) + n  # no await since the check
        try:
            ids, active = await self.store.reserve_team(team_id, self.settings.node_id, n, limit)
        except BaseException:
            self._unreserve(team_id, n)
            raise
        if not ids:
            self._unreserve(team_id, n)
            raise TooManyRequests(
                f"Team sandbox limit reached: at most {limit} concurrent sandboxes "
                f"({active} running{f', {n} requested' if n > 1 else ''}). Kill or pause one first.",
                error_code="team_sandbox_limit", headers={"Should-Retry": "false"})
        adm = _Admitted(team_id, n, list(ids))
        token = _ADMISSION.set(adm)
        try:
            yield
        finally:
            _ADMISSION.reset(token)
            self._unreserve(team_id, adm.left)
            await asyncio.shield(self._release(ids))
