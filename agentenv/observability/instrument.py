"""Hooks metrics and events onto the orchestrator, the traffic proxy and the snapshot store.

Why wrapping instead of metric calls inside the orchestrator: the lifecycle code stays about
lifecycle, and every role that composes an orchestrator (single node, cluster node agent) gets
the same series and events by calling `instrument_orchestrator` once. Each public entry point is
wrapped on the *instance* (so internal callers, e.g. the TTL reaper calling `kill_sandbox`, are
observed too); the wrapper times it, counts failures by the error's `error_code`, and writes the
lifecycle event.

Why an event is `expired`: the TTL reaper acts with `team_id=None` and no API request around it;
`stop()` (server shutdown) marks its kills with reason `shutdown` through a context variable.
"""

from __future__ import annotations

import contextvars
import functools
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentenv.errors import AgentEnvError

if TYPE_CHECKING:
    from agentenv.observability import Observability

_REASON: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentenv_lifecycle_reason", default=None)
_ENVD_PORT = "49983"
_JUPYTER_PORT = "49999"


def failure_reason(e: BaseException) -> str:
    if isinstance(e, AgentEnvError):
        return (getattr(e, "error_code", None) or type(e).__name__).lower()
    return "internal"


def instrument_orchestrator(orch: Any, obs: "Observability") -> None:
    m = obs.metrics
    emit = obs.events.emit

    def rec_fields(rec) -> dict:
        return {"templateID": rec.template_id, "snapshotID": rec.snapshot_id, "parentID": rec.parent_id}

    def timed(name: str):
        def deco(wrapper):
            original = getattr(orch, name)

            @functools.wraps(original)
            async def run(*args, **kwargs):
                return await wrapper(original, *args, **kwargs)

            setattr(orch, name, run)
            return run
        return deco

    def fail(op: str, e: BaseException, sandbox_id: str | None, team_id: str | None) -> None:
        reason = failure_reason(e)
        m.failed_op(op, reason)
        if isinstance(e, AgentEnvError) and e.status < 500 and reason != "sandbox_lost":
            return  # a refused request (404, 409, 400...) is not a lifecycle failure of the sandbox
        emit("failed", sandbox_id, team_id=team_id, operation=op, reason=reason,
             message=(getattr(e, "message", None) or str(e))[:500])

    @timed("create_sandbox")
    async def _create(original, *args, **kwargs):
        t0 = time.monotonic()
        try:
            rec = await original(*args, **kwargs)
        except BaseException as e:
            tmpl = str(kwargs.get("template", ""))
            op = "restore" if tmpl.startswith("s") and len(tmpl) == 21 else "create"  # a snapshot id
            fail(op, e, None, kwargs.get("team_id"))
            raise
        op = "restore" if rec.snapshot_id else "create"
        m.observe_op(op, time.monotonic() - t0)
        emit("created", rec.sandbox_id, team_id=rec.team_id, origin="snapshot" if rec.snapshot_id else "template",
             durationS=round(time.monotonic() - t0, 4), **rec_fields(rec))
        return rec

    @timed("pause_sandbox")
    async def _pause(original, sandbox_id, *args, team_id=None, **kwargs):
        rec = orch.peek(sandbox_id)
        reason = _REASON.get() or ("timeout" if team_id is None else "request")
        if reason == "timeout" and rec is not None:
            emit("expired", sandbox_id, team_id=rec.team_id, action="pause", endAt=rec.end_at.isoformat())
        t0 = time.monotonic()
        try:
            out = await original(sandbox_id, *args, team_id=team_id, **kwargs)
        except BaseException as e:
            fail("pause", e, sandbox_id, rec.team_id if rec else team_id)
            raise
        m.observe_op("pause", time.monotonic() - t0)
        rec = orch.peek(sandbox_id) or rec
        emit("paused", sandbox_id, team_id=rec.team_id if rec else team_id, reason=reason,
             mode=getattr(rec, "pause_mode", None), durationS=round(time.monotonic() - t0, 4))
        return out

    @timed("connect_sandbox")
    async def _connect(original, sandbox_id, *args, **kwargs):
        t0 = time.monotonic()
        try:
            rec, resumed = await original(sandbox_id, *args, **kwargs)
        except BaseException as e:
            r = orch.peek(sandbox_id)
            if r is not None and r.state.value in ("paused", "resuming"):
                fail("resume", e, sandbox_id, r.team_id)
            raise
        if resumed:
            m.observe_op("resume", time.monotonic() - t0)
            emit("resumed", sandbox_id, team_id=rec.team_id, reason="request",
                 durationS=round(time.monotonic() - t0, 4))
        return rec, resumed

    @timed("resume_on_traffic")
    async def _wake(original, sandbox_id, *args, **kwargs):
        """Wake on traffic (proxy -> auto-resume): one `resumed` event per actual resume."""
        rec = orch.peek(sandbox_id)
        t0 = time.monotonic()
        try:
            woke = await original(sandbox_id, *args, **kwargs)
        except BaseException as e:
            fail("resume", e, sandbox_id, rec.team_id if rec else None)
            raise
        if woke:
            m.observe_op("resume", time.monotonic() - t0)
            emit("resumed", sandbox_id, team_id=rec.team_id if rec else None, reason="traffic",
                 durationS=round(time.monotonic() - t0, 4))
        return woke

    @timed("fork_sandbox")
    async def _fork(original, sandbox_id, *args, **kwargs):
        src = orch.peek(sandbox_id)
        t0 = time.monotonic()
        try:
            results = await original(sandbox_id, *args, **kwargs)
        except BaseException as e:
            fail("fork", e, sandbox_id, src.team_id if src else kwargs.get("team_id"))
            raise
        took = time.monotonic() - t0
        m.observe_op("fork", took)
        children = [r for r in results if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        m.fork_children.labels("ok").inc(len(children))
        if errors:
            m.fork_children.labels("error").inc(len(errors))
            for e in errors:
                m.failed_op("fork", failure_reason(e))
        team = children[0].team_id if children else (src.team_id if src else None)
        emit("forked", sandbox_id, team_id=team, children=[c.sandbox_id for c in children],
             failed=len(errors) or None, durationS=round(took, 4))
        for c in children:
            emit("created", c.sandbox_id, team_id=c.team_id, origin="fork", **rec_fields(c))
        return results

    @timed("create_snapshot")
    async def _snapshot(original, sandbox_id, *args, **kwargs):
        src = orch.peek(sandbox_id)
        t0 = time.monotonic()
        try:
            snap = await original(sandbox_id, *args, **kwargs)
        except BaseException as e:
            fail("snapshot", e, sandbox_id, src.team_id if src else kwargs.get("team_id"))
            raise
        m.observe_op("snapshot", time.monotonic() - t0)
        emit("snapshotted", sandbox_id, team_id=snap.team_id, snapshotID=snap.snapshot_id, names=snap.names or None,
             sizeBytes=snap.size_bytes, memory=snap.memory_digest is not None,
             durationS=round(time.monotonic() - t0, 4))
        return snap

    @timed("kill_sandbox")
    async def _kill(original, sandbox_id, *args, team_id=None, **kwargs):
        rec = orch.peek(sandbox_id)
        reason = _REASON.get() or ("timeout" if team_id is None else "request")
        live = rec is not None and rec.state.value not in ("killing", "killed")
        if reason == "timeout" and live:
            emit("expired", sandbox_id, team_id=rec.team_id, action="kill", endAt=rec.end_at.isoformat())
        t0 = time.monotonic()
        try:
            out = await original(sandbox_id, *args, team_id=team_id, **kwargs)
        except BaseException as e:
            if live:
                fail("kill", e, sandbox_id, rec.team_id)
            raise
        m.observe_op("kill", time.monotonic() - t0)
        emit("killed", sandbox_id, team_id=rec.team_id if rec else team_id, reason=reason,
             templateID=rec.template_id if rec else None)
        return out

    @timed("stop")
    async def _stop(original, *args, **kwargs):
        token = _REASON.set("shutdown")
        try:
            return await original(*args, **kwargs)
        finally:
            _REASON.reset(token)


def _port_kind(request: web.BaseRequest) -> str:
    port = request.headers.get("E2b-Sandbox-Port")
    if port is None:
        host = request.host.split(".", 1)[0]
        port = host.split("-", 1)[0] if "-" in host else _ENVD_PORT  # signed /files URLs go to envd
    return "envd" if port == _ENVD_PORT else "jupyter" if port == _JUPYTER_PORT else "user"


def instrument_proxy(proxy: Any, obs: "Observability") -> None:
    m = obs.metrics
    original = proxy.handle

    @functools.wraps(original)
    async def handle(request: web.Request) -> web.StreamResponse:
        kind = _port_kind(request)
        m.proxy_active.inc()
        t0 = time.perf_counter()
        code = "error"
        resp = None
        try:
            resp = await original(request)
            code = f"{resp.status // 100}xx"
            return resp
        finally:
            m.proxy_active.dec()
            m.proxy_duration.labels(kind).observe(time.perf_counter() - t0)
            m.proxy_requests.labels(kind, code).inc()
            m.proxy_bytes.labels(kind, "in").inc(getattr(request.content, "total_bytes", 0) or 0)
            if resp is not None:
                m.proxy_bytes.labels(kind, "out").inc(resp.body_length or 0)

    proxy.handle = handle


def instrument_snapshot_store(store: Any, obs: "Observability") -> None:
    m = obs.metrics
    put, get = store.put_blob, store.get_blob

    @functools.wraps(put)
    async def put_blob(kind, digest, src, *a, **kw):
        t0 = time.perf_counter()
        await put(kind, digest, src, *a, **kw)
        m.snapshot_transfer_seconds.labels("upload").observe(time.perf_counter() - t0)
        try:
            m.snapshot_transfer_bytes.labels("upload").inc(src.stat().st_size)
        except OSError:
            pass

    @functools.wraps(get)
    async def get_blob(kind, digest, dst, *a, **kw):
        t0 = time.perf_counter()
        await get(kind, digest, dst, *a, **kw)
        m.snapshot_transfer_seconds.labels("download").observe(time.perf_counter() - t0)
        try:
            m.snapshot_transfer_bytes.labels("download").inc(dst.stat().st_size)
        except OSError:
            pass

    store.put_blob, store.get_blob = put_blob, get_blob


def http_metrics_middleware(obs: "Observability"):
    """Control-API requests by route template; sets the request id every log record carries."""
    import uuid

    from agentenv.observability.logs import REQUEST_ID

    m = obs.metrics

    @web.middleware
    async def middleware(request: web.Request, handler):
        rid = request.headers.get("X-Request-Id", "")
        rid = rid if (0 < len(rid) <= 64 and rid.isprintable()) else uuid.uuid4().hex[:16]
        token = REQUEST_ID.set(rid)
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        t0 = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            if not resp.prepared:
                resp.headers.setdefault("X-Request-Id", rid)
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            REQUEST_ID.reset(token)
            if not name.startswith("/console/static"):
                m.http_requests.labels(name, request.method, str(status)).inc()
                m.http_duration.labels(name, request.method).observe(time.perf_counter() - t0)

    return middleware
