"""Hooks metrics and events onto the orchestrator, the traffic proxy and the snapshot store.

The orchestrator emits typed lifecycle events (agentenv/orchestrator/events.py: created, paused,
resumed, forked, snapshotted, killed, expired, failed) for every operation, whoever asked for it
(API, TTL reaper, drain, shutdown, wake on traffic); `instrument_orchestrator` subscribes the
metrics and the event stream to them, so the lifecycle code stays free of metrics and every role
that composes an orchestrator gets the same series and events. Failures are counted by the
error's `error_code`. The proxy and the snapshot store are still wrapped (they have no events).
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentenv.errors import AgentEnvError

if TYPE_CHECKING:
    from agentenv.observability import Observability

_ENVD_PORT = "49983"
_JUPYTER_PORT = "49999"


def failure_reason(e: BaseException) -> str:
    if isinstance(e, AgentEnvError):
        return (getattr(e, "error_code", None) or type(e).__name__).lower()
    return "internal"


def instrument_orchestrator(orch: Any, obs: "Observability") -> None:
    """Subscribe metrics and the event stream to the orchestrator's lifecycle events."""
    from agentenv.orchestrator import events as ev

    m = obs.metrics
    emit = obs.events.emit

    def rec_fields(rec) -> dict:
        return {"templateID": rec.template_id, "snapshotID": rec.snapshot_id, "parentID": rec.parent_id}

    def on_event(e: Any) -> None:
        if isinstance(e, ev.Failed):
            reason = failure_reason(e.error)
            m.failed_op(e.operation, reason)
            if isinstance(e.error, AgentEnvError) and e.error.status < 500 and reason != "sandbox_lost":
                return  # a refused request (404, 409, 400...) is not a lifecycle failure of the sandbox
            emit("failed", e.sandbox_id, team_id=e.team_id, operation=e.operation, reason=reason,
                 message=(getattr(e.error, "message", None) or str(e.error))[:500])
        elif isinstance(e, ev.Created):
            m.observe_op(e.op, e.duration_s)
            emit("created", e.rec.sandbox_id, team_id=e.rec.team_id, origin=e.origin,
                 durationS=round(e.duration_s, 4), **rec_fields(e.rec))
        elif isinstance(e, ev.Expired):
            emit("expired", e.sandbox_id, team_id=e.team_id, action=e.action, endAt=e.end_at.isoformat())
        elif isinstance(e, ev.Paused):
            m.observe_op("pause", e.duration_s)
            emit("paused", e.sandbox_id, team_id=e.team_id, reason=e.reason, mode=e.mode,
                 durationS=round(e.duration_s, 4))
        elif isinstance(e, ev.Resumed):
            m.observe_op("resume", e.duration_s)
            emit("resumed", e.sandbox_id, team_id=e.team_id, reason=e.reason, durationS=round(e.duration_s, 4))
        elif isinstance(e, ev.Forked):
            m.observe_op("fork", e.duration_s)
            m.fork_children.labels("ok").inc(len(e.children))
            if e.errors:
                m.fork_children.labels("error").inc(len(e.errors))
                for err in e.errors:
                    m.failed_op("fork", failure_reason(err))
            emit("forked", e.sandbox_id, team_id=e.team_id, children=[c.sandbox_id for c in e.children],
                 failed=len(e.errors) or None, durationS=round(e.duration_s, 4))
            for c in e.children:
                emit("created", c.sandbox_id, team_id=c.team_id, origin="fork", **rec_fields(c))
        elif isinstance(e, ev.Snapshotted):
            snap = e.snap
            m.observe_op("snapshot", e.duration_s)
            emit("snapshotted", e.sandbox_id, team_id=snap.team_id, snapshotID=snap.snapshot_id,
                 names=snap.names or None, sizeBytes=snap.size_bytes, memory=snap.memory_digest is not None,
                 durationS=round(e.duration_s, 4))
        elif isinstance(e, ev.Killed):
            m.observe_op("kill", e.duration_s)
            emit("killed", e.sandbox_id, team_id=e.team_id, reason=e.reason, templateID=e.template_id)

    orch.events.subscribe(on_event)


def _port_kind(request: web.BaseRequest) -> str:
    port = request.headers.get("E2b-Sandbox-Port")
    if port is None:
        host = request.host.split(".", 1)[0]
        port = host.split("-", 1)[0] if "-" in host else _ENVD_PORT  # signed /files URLs go to envd
    return "envd" if port == _ENVD_PORT else "jupyter" if port == _JUPYTER_PORT else "user"


def instrument_proxy(proxy: Any, obs: "Observability") -> None:
    m = obs.metrics
    original = proxy.handle
    m.count_host_files(lambda: proxy.stats.files_from_host, lambda: proxy.stats.files_to_host)

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
