"""Where an operation's time goes: named spans per step, summed up per operation.

`operation("create", sid)` opens a trace for the current task (and the tasks it starts: fork
children inherit it through their context); `span("runtime.restore", sid)` times one step inside it.
When the operation ends, one log line (logger `agentenv.trace`, DEBUG: `AGENTENV_LOG_LEVEL=debug`)
lists every step with its milliseconds, and the trace is kept in a small ring (`recent()`) for
debugging. DEBUG, not INFO, because INFO lines naming a sandbox go into that sandbox's logs. Cost: two `perf_counter` calls and a list append per step.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections import deque
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

log = logging.getLogger("agentenv.trace")
T = TypeVar("T")

_CURRENT: contextvars.ContextVar["Trace | None"] = contextvars.ContextVar("agentenv_trace", default=None)
_RECENT: deque["Trace"] = deque(maxlen=200)


@dataclass
class Span:
    name: str
    sandbox_id: str | None
    start_s: float      # since the operation began
    duration_s: float


@dataclass
class Trace:
    op: str
    sandbox_id: str | None
    started: float = field(default_factory=time.perf_counter)
    duration_s: float | None = None
    spans: list[Span] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict:
        return {"operation": self.op, "sandboxID": self.sandbox_id, "durationMs": _ms(self.duration_s),
                "error": self.error,
                "spans": [{"name": s.name, "sandboxID": s.sandbox_id, "startMs": _ms(s.start_s),
                           "durationMs": _ms(s.duration_s)} for s in self.spans]}


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 2)


@contextlib.contextmanager
def span(name: str, sandbox_id: str | None = None) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        took = time.perf_counter() - t0
        tr = _CURRENT.get()
        if tr is not None:
            tr.spans.append(Span(name, sandbox_id, t0 - tr.started, took))
        log.debug("span %s %s %.1fms", name, sandbox_id or "-", took * 1e3)


async def timed(name: str, sandbox_id: str | None, aw: Awaitable[T]) -> T:
    """`await aw` inside `span(name, sandbox_id)`."""
    with span(name, sandbox_id):
        return await aw


@contextlib.contextmanager
def operation(op: str, sandbox_id: str | None = None) -> Iterator[Trace]:
    """Trace `op`; nested operations (a resume inside a wake) add their spans to the outer one."""
    outer = _CURRENT.get()
    if outer is not None:
        with span(op, sandbox_id):
            yield outer
        return
    tr = Trace(op, sandbox_id)
    token = _CURRENT.set(tr)
    try:
        yield tr
    except BaseException as e:
        tr.error = type(e).__name__
        raise
    finally:
        _CURRENT.reset(token)
        tr.duration_s = time.perf_counter() - tr.started
        _RECENT.append(tr)
        if log.isEnabledFor(logging.DEBUG):
            steps = ", ".join(f"{s.name}={s.duration_s * 1e3:.0f}ms" for s in tr.spans)
            log.debug("trace %s %s %.0fms%s: %s", op, tr.sandbox_id or "-", tr.duration_s * 1e3,
                     f" ({tr.error})" if tr.error else "", steps or "no steps")


def name_sandbox(sandbox_id: str) -> None:
    """The current operation made this sandbox (a create learns its id after the trace began)."""
    tr = _CURRENT.get()
    if tr is not None and tr.sandbox_id is None:
        tr.sandbox_id = sandbox_id


def recent(limit: int = 50) -> list[dict]:
    """The last traces, newest first (for a debug view)."""
    return [t.to_json() for t in list(_RECENT)[-limit:][::-1]]
