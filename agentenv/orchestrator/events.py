"""Lifecycle events the orchestrator emits; metrics and the event stream subscribe to them.

Every operation request goes through `Orchestrator.handle`, which times it and emits what
happened (`observe`): `Created`, `Paused`, `Resumed`, `Forked`, `Snapshotted`, `Killed`,
`Expired` (before the expiry's pause or kill) and `Failed`. Internal callers (the TTL reaper, a
node's drain, server shutdown, a wake on traffic) go through the same path, so they are observed
too. The reason of a kill or pause is "request" for an API call, "timeout" for the reaper (no
team), "shutdown" inside `shutting_down()`, "traffic" for a wake.

Subscribers are called synchronously, in order; one that raises is logged and skipped.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from agentenv.models import SandboxRecord, SnapshotRecord
from agentenv.orchestrator import operations as ops
from agentenv.orchestrator.trace import operation

log = logging.getLogger("agentenv.orchestrator")

_REASON: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentenv_lifecycle_reason", default=None)


@contextlib.contextmanager
def shutting_down() -> Iterator[None]:
    """Kills and pauses in here happen because the server stops (reason "shutdown")."""
    token = _REASON.set("shutdown")
    try:
        yield
    finally:
        _REASON.reset(token)


@dataclass(frozen=True)
class Created:
    rec: SandboxRecord
    origin: str                     # "template" | "snapshot" | "fork"
    op: str = "create"              # "create" | "restore" (from a snapshot) | "fork"
    duration_s: float | None = None


@dataclass(frozen=True)
class Expired:
    sandbox_id: str
    team_id: str | None
    action: str                     # "pause" | "kill"
    end_at: datetime


@dataclass(frozen=True)
class Paused:
    sandbox_id: str
    team_id: str | None
    reason: str
    mode: str | None
    duration_s: float


@dataclass(frozen=True)
class Resumed:
    sandbox_id: str
    team_id: str | None
    reason: str                     # "request" | "traffic"
    duration_s: float


@dataclass(frozen=True)
class Forked:
    sandbox_id: str
    team_id: str | None
    children: list[SandboxRecord]
    errors: list[BaseException]
    duration_s: float


@dataclass(frozen=True)
class Snapshotted:
    sandbox_id: str
    snap: SnapshotRecord
    duration_s: float


@dataclass(frozen=True)
class Killed:
    sandbox_id: str
    team_id: str | None
    reason: str
    template_id: str | None
    duration_s: float


@dataclass(frozen=True)
class Failed:
    operation: str
    sandbox_id: str | None
    team_id: str | None
    error: BaseException


Event = Created | Expired | Paused | Resumed | Forked | Snapshotted | Killed | Failed


@dataclass
class LifecycleEvents:
    subscribers: list[Callable[[Any], None]] = field(default_factory=list)

    def subscribe(self, fn: Callable[[Any], None]) -> None:
        self.subscribers.append(fn)

    def emit(self, event: Any) -> None:
        for fn in self.subscribers:
            try:
                fn(event)
            except Exception:  # noqa: BLE001 - an observer never breaks an operation
                log.exception("lifecycle event subscriber failed on %s", type(event).__name__)


# ---------------------------------------------------------------------- what each operation emits

Peek = Callable[[str], SandboxRecord | None]
Call = Callable[[], Awaitable[Any]]


def _team(rec: SandboxRecord | None, fallback: str | None) -> str | None:
    return rec.team_id if rec is not None else fallback


async def observe(req: ops.Request, call: Call, peek: Peek, emit: Callable[[Any], None]) -> Any:
    """Run `call` (the handler of `req`), traced, and emit the events it amounts to."""
    with operation(req.op, getattr(req, "sandbox_id", None)):
        fn = _OBSERVERS.get(type(req))
        if fn is None:
            return await call()
        return await fn(req, call, peek, emit)


async def _create(req: ops.CreateSandbox, call: Call, peek: Peek, emit) -> Any:
    t0 = time.monotonic()
    try:
        rec = await call()
    except BaseException as e:
        op = "restore" if req.template.startswith("s") and len(req.template) == 21 else "create"  # a snapshot id
        emit(Failed(op, None, req.team_id, e))
        raise
    emit(Created(rec, "snapshot" if rec.snapshot_id else "template", "restore" if rec.snapshot_id else "create",
                 time.monotonic() - t0))
    return rec


def _reason(req) -> str:
    return _REASON.get() or ("timeout" if req.team_id is None else "request")


async def _pause(req: ops.PauseSandbox, call: Call, peek: Peek, emit) -> Any:
    rec = peek(req.sandbox_id)
    reason = _reason(req)
    if reason == "timeout" and rec is not None:
        emit(Expired(req.sandbox_id, rec.team_id, "pause", rec.end_at))
    t0 = time.monotonic()
    try:
        out = await call()
    except BaseException as e:
        emit(Failed("pause", req.sandbox_id, _team(rec, req.team_id), e))
        raise
    rec = peek(req.sandbox_id) or rec
    emit(Paused(req.sandbox_id, _team(rec, req.team_id), reason, getattr(rec, "pause_mode", None),
                time.monotonic() - t0))
    return out


async def _connect(req: ops.ConnectSandbox, call: Call, peek: Peek, emit) -> Any:
    t0 = time.monotonic()
    try:
        rec, resumed = await call()
    except BaseException as e:
        r = peek(req.sandbox_id)
        if r is not None and r.state.value in ("paused", "resuming"):
            emit(Failed("resume", req.sandbox_id, r.team_id, e))
        raise
    if resumed:
        emit(Resumed(req.sandbox_id, rec.team_id, "request", time.monotonic() - t0))
    return rec, resumed


async def _wake(req: ops.WakeSandbox, call: Call, peek: Peek, emit) -> Any:
    """Wake on traffic (proxy -> auto-resume): one `Resumed` per actual resume."""
    rec = peek(req.sandbox_id)
    t0 = time.monotonic()
    try:
        woke = await call()
    except BaseException as e:
        emit(Failed("resume", req.sandbox_id, _team(rec, None), e))
        raise
    if woke:
        emit(Resumed(req.sandbox_id, _team(rec, None), "traffic", time.monotonic() - t0))
    return woke


async def _fork(req: ops.ForkSandbox, call: Call, peek: Peek, emit) -> Any:
    src = peek(req.sandbox_id)
    t0 = time.monotonic()
    try:
        results = await call()
    except BaseException as e:
        emit(Failed("fork", req.sandbox_id, _team(src, req.team_id), e))
        raise
    children = [r for r in results if not isinstance(r, BaseException)]
    errors = [r for r in results if isinstance(r, BaseException)]
    team = children[0].team_id if children else _team(src, None)
    emit(Forked(req.sandbox_id, team, children, errors, time.monotonic() - t0))
    return results


async def _snapshot(req: ops.CreateSnapshot | ops.CreateCheckpoint, call: Call, peek: Peek, emit) -> Any:
    src = peek(req.sandbox_id)
    t0 = time.monotonic()
    try:
        snap = await call()
    except BaseException as e:
        emit(Failed(req.op, req.sandbox_id, _team(src, req.team_id), e))
        raise
    emit(Snapshotted(req.sandbox_id, snap, time.monotonic() - t0))
    return snap


async def _kill(req: ops.KillSandbox, call: Call, peek: Peek, emit) -> Any:
    rec = peek(req.sandbox_id)
    reason = _reason(req)
    live = rec is not None and rec.state.value not in ("killing", "killed")
    if reason == "timeout" and live:
        emit(Expired(req.sandbox_id, rec.team_id, "kill", rec.end_at))
    t0 = time.monotonic()
    try:
        out = await call()
    except BaseException as e:
        if live:
            emit(Failed("kill", req.sandbox_id, rec.team_id, e))
        raise
    emit(Killed(req.sandbox_id, _team(rec, req.team_id), reason, rec.template_id if rec else None,
                time.monotonic() - t0))
    return out


_OBSERVERS: dict[type, Callable[..., Awaitable[Any]]] = {
    ops.CreateSandbox: _create,
    ops.PauseSandbox: _pause,
    ops.ConnectSandbox: _connect,
    ops.WakeSandbox: _wake,
    ops.ForkSandbox: _fork,
    ops.CreateSnapshot: _snapshot,
    ops.CreateCheckpoint: _snapshot,
    ops.KillSandbox: _kill,
}
