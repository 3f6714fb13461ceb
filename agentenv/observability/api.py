"""HTTP side of observability: E2B's sandbox metrics and logs routes, the event stream, the data the
console needs (node load, lineage), plus mounting `/metrics` and the console on the server's app.

The JSON routes are registered by `agentenv.api.app.setup_api` (they are part of the OpenAPI
contract and share its auth, errors and CORS); `mount_observability` adds what is not the E2B API.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from agentenv.errors import BadRequest, Unavailable, sandbox_not_found
from agentenv.observability.logs import LEVELS
from agentenv.observability.sampler import Sample

MAX_METRIC_IDS = 100
SSE_HEARTBEAT_S = 15.0


def metric_json(s: Sample) -> dict:
    ts = datetime.fromtimestamp(s.ts, timezone.utc)
    return {"timestamp": ts.isoformat().replace("+00:00", "Z"), "timestampUnix": int(s.ts),
            "cpuCount": s.cpu_count, "cpuUsedPct": s.cpu_used_pct, "memUsed": s.mem_used, "memTotal": s.mem_total,
            "memCache": s.mem_cache, "diskUsed": s.disk_used, "diskTotal": s.disk_total}


def _int(q, name: str, default: int | None = None, lo: int | None = None, hi: int | None = None) -> int | None:
    raw = q.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise BadRequest(f"Invalid {name} {raw!r}: expected an integer") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"Invalid {name} {v}: expected {lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}")
    return v


class ObservabilityHandlers:
    def __init__(self, ctx: Any, team_of: Callable[[web.Request], str]) -> None:
        self.ctx = ctx
        self.team_of = team_of

    @property
    def obs(self):
        obs = getattr(self.ctx, "observability", None)
        if obs is None:
            raise Unavailable("observability is not enabled on this server")
        return obs

    async def _live(self, request: web.Request):
        return await self.ctx.orchestrator.get_sandbox(request.match_info["sandboxID"], team_id=self.team_of(request))

    # --- E2B: metrics ---------------------------------------------------------------------------

    async def sandbox_metrics(self, request: web.Request) -> web.Response:
        q = request.query
        start, end = _int(q, "start", lo=0), _int(q, "end", lo=0)
        rec = await self._live(request)
        series = self.obs.sampler.series(rec.sandbox_id, start, end)
        return web.json_response([metric_json(s) for s in series])

    async def sandboxes_metrics(self, request: web.Request) -> web.Response:
        raw = ",".join(request.query.getall("sandbox_ids", []))
        ids = [i.strip() for i in raw.split(",") if i.strip()]
        if len(ids) > MAX_METRIC_IDS:
            raise BadRequest(f"at most {MAX_METRIC_IDS} sandbox_ids per request (got {len(ids)})")
        team = self.team_of(request)
        visible = {r.sandbox_id for r in await self.ctx.orchestrator.list_sandboxes(team_id=team)}
        wanted = [i for i in ids if i in visible] if ids else sorted(visible)
        out = {}
        for sid in wanted:
            s = self.obs.sampler.latest(sid)
            if s is not None:
                out[sid] = metric_json(s)
        return web.json_response({"sandboxes": out})

    # --- E2B: logs ------------------------------------------------------------------------------

    def _log_entries(self, request: web.Request):
        sid = request.match_info["sandboxID"]
        team = self.team_of(request)
        live = sid in {r.sandbox_id for r in self.ctx.orchestrator.records() if r.team_id == team}
        if not live and not self.obs.logs.known(sid, team):
            raise sandbox_not_found(sid)
        return self.obs.logs.entries(sid)

    async def sandbox_logs_v1(self, request: web.Request) -> web.Response:
        q = request.query
        start_ms = _int(q, "start", lo=0)
        limit = _int(q, "limit", 1000, lo=0, hi=10000)
        entries = self._log_entries(request)
        if start_ms is not None:
            entries = [e for e in entries if e.ts.timestamp() * 1000 >= start_ms]
        entries = entries[:limit]
        return web.json_response({"logs": [e.v1() for e in entries], "logEntries": [e.v2() for e in entries]})

    async def sandbox_logs_v2(self, request: web.Request) -> web.Response:
        q = request.query
        cursor = _int(q, "cursor", lo=0)
        limit = _int(q, "limit", 1000, lo=0, hi=10000)
        direction = q.get("direction", "forward")
        if direction not in ("forward", "backward"):
            raise BadRequest(f"Invalid direction {direction!r}: expected 'forward' or 'backward'")
        level = q.get("level")
        if level is not None and level not in LEVELS:
            raise BadRequest(f"Invalid level {level!r}: expected one of {', '.join(LEVELS)}")
        search = q.get("search")
        entries = self._log_entries(request)
        if level is not None:
            entries = [e for e in entries if LEVELS[e.level] >= LEVELS[level]]
        if search:
            entries = [e for e in entries if search in e.message]  # case-sensitive, as E2B's
        if direction == "forward":
            if cursor is not None:
                entries = [e for e in entries if e.ts.timestamp() * 1000 >= cursor]
        else:
            if cursor is not None:
                entries = [e for e in entries if e.ts.timestamp() * 1000 <= cursor]
            entries = list(reversed(entries))
        return web.json_response({"logs": [e.v2() for e in entries[:limit]]})

    # --- the event stream -----------------------------------------------------------------------

    async def events(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        since = _int(q, "since", 0, lo=0) or 0
        limit = _int(q, "limit", 500, lo=1, hi=5000) or 500
        wait = float(_int(q, "wait", 0, lo=0, hi=55) or 0)
        sandbox_id = q.get("sandboxID") or None
        tail = _int(q, "tail", lo=1, hi=5000)
        team = self.team_of(request)
        ev_log = self.obs.events
        if tail is not None:  # the most recent `tail` events (the console's first view)
            events = ev_log.read(0, limit=10**9, team_id=team, sandbox_id=sandbox_id)[-tail:]
            return web.json_response({"events": [{k: v for k, v in e.items() if k != "teamID"} for e in events],
                                      "lastSeq": ev_log.seq})
        if "text/event-stream" in request.headers.get("Accept", ""):
            return await self._sse(request, since, team, sandbox_id)
        events = ev_log.read(since, limit=limit, team_id=team, sandbox_id=sandbox_id)
        if not events and wait > 0:
            deadline = asyncio.get_running_loop().time() + wait
            cursor = max(since, ev_log.seq)  # only new events (another team's don't end the wait)
            while not events:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0 or not await ev_log.wait(cursor, left):
                    break
                events = ev_log.read(since, limit=limit, team_id=team, sandbox_id=sandbox_id)
                cursor = ev_log.seq
        last = events[-1]["seq"] if events else max(since, 0)
        body = {"events": [{k: v for k, v in e.items() if k != "teamID"} for e in events], "lastSeq": last}
        return web.json_response(body)

    async def _sse(self, request: web.Request, since: int, team: str, sandbox_id: str | None) -> web.StreamResponse:
        last_id = request.headers.get("Last-Event-ID", "")
        if last_id.isdigit():
            since = int(last_id)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "Access-Control-Allow-Origin": "*"})
        await resp.prepare(request)
        ev_log = self.obs.events
        cursor = since
        try:
            while True:
                for e in ev_log.read(since, limit=1000, team_id=team, sandbox_id=sandbox_id):
                    data = json.dumps({k: v for k, v in e.items() if k != "teamID"}, separators=(",", ":"))
                    await resp.write(f"id: {e['seq']}\nevent: {e['type']}\ndata: {data}\n\n".encode())
                    since = e["seq"]
                cursor = max(cursor, since, ev_log.seq)
                if not await ev_log.wait(cursor, SSE_HEARTBEAT_S):
                    await resp.write(b": keep-alive\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    # --- console data ---------------------------------------------------------------------------

    async def nodes(self, request: web.Request) -> web.Response:
        orch, settings, obs = self.ctx.orchestrator, self.ctx.settings, self.obs
        recs = [r for r in orch.records() if r.team_id]
        states: dict[str, int] = {}
        for r in recs:
            states[r.state.value] = states.get(r.state.value, 0) + 1
        active = [r for r in recs if r.state.value != "paused"]
        try:
            load = list(os.getloadavg())
        except OSError:
            load = [0.0, 0.0, 0.0]
        mem_total = mem_avail = 0
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        mem_total = int(line.split()[1]) * 1024
                    elif line.startswith("MemAvailable:"):
                        mem_avail = int(line.split()[1]) * 1024
        except OSError:
            pass
        t = obs.sampler.totals
        node = {"nodeID": getattr(settings, "node_id", None) or "local", "status": "ready",
                "runtime": orch.runtime.name, "runtimes": list(orch.runtimes), "sandboxes": states, "capacity": settings.max_sandboxes,
                "active": len(active), "allocatedCPU": sum(r.cpu_count for r in active),
                "allocatedMemoryMB": sum(r.memory_mb for r in active), "cpus": os.cpu_count() or 0,
                "load": load, "memTotal": mem_total, "memAvailable": mem_avail,
                "sandboxCpuCores": round(t.cpu_cores, 3), "sandboxMemUsed": t.mem_used,
                "sandboxDiskUsed": t.disk_used, "snapshots": t.snapshots, "snapshotBytes": t.snapshot_bytes}
        return web.json_response([node])

    async def lineage(self, request: web.Request) -> web.Response:
        """Where every sandbox came from: template, snapshot or fork parent, as nodes and edges."""
        team = self.team_of(request)
        orch = self.ctx.orchestrator
        nodes: dict[str, dict] = {}
        edges: list[dict] = []
        recs = [r for r in orch.records() if r.team_id == team]
        catalog = getattr(orch, "snapshots", None)  # a node's catalog reads the store's manifests (parents)
        snaps = await (catalog.list(team_id=team) if catalog is not None else orch.store.list_snapshots(team_id=team))
        for s in snaps:
            nodes[s.snapshot_id] = {"id": s.snapshot_id, "kind": "snapshot", "label": s.names[0] if s.names else s.snapshot_id,
                                    "createdAt": s.created_at.isoformat(), "checkpoint": s.kind == "checkpoint"}
            if s.source_sandbox_id:
                edges.append({"from": s.source_sandbox_id, "to": s.snapshot_id,
                              "kind": "checkpoint" if s.kind == "checkpoint" else "snapshot"})
            parent = next((a for a in ([s.parent_id] if s.parent_id else []) + s.ancestors
                           if any(o.snapshot_id == a for o in snaps)), None)
            if parent:  # the checkpoint tree (a deleted checkpoint is skipped)
                edges.append({"from": parent, "to": s.snapshot_id, "kind": "parent"})
        for r in recs:
            nodes[r.sandbox_id] = {"id": r.sandbox_id, "kind": "sandbox", "label": r.sandbox_id,
                                   "state": r.state.public if r.state.value in ("running", "paused") else r.state.value,
                                   "templateID": r.template_id, "metadata": r.metadata,
                                   "createdAt": r.created_at.isoformat()}
            own = [s for s in snaps if s.source_sandbox_id == r.sandbox_id and s.kind == "checkpoint"]
            last = max(own, key=lambda s: s.created_at).snapshot_id if own else None
            if r.checkpoint_id and r.checkpoint_id not in (r.snapshot_id, last) and r.checkpoint_id in nodes:
                # its state came from a checkpoint it did not just take: a rollback
                edges.append({"from": r.checkpoint_id, "to": r.sandbox_id, "kind": "rollback"})
            if r.parent_id:
                edges.append({"from": r.parent_id, "to": r.sandbox_id, "kind": "fork"})
            elif r.snapshot_id:
                edges.append({"from": r.snapshot_id, "to": r.sandbox_id, "kind": "restore"})
            else:
                tid = f"template:{r.template_id}"
                nodes.setdefault(tid, {"id": tid, "kind": "template", "label": r.template_id})
                edges.append({"from": tid, "to": r.sandbox_id, "kind": "create"})
        for e in edges:  # an ancestor that is gone (killed) still shows, greyed out
            if e["from"] not in nodes:
                nodes[e["from"]] = {"id": e["from"], "kind": "sandbox", "label": e["from"], "state": "gone"}
        return web.json_response({"nodes": list(nodes.values()), "edges": edges})


def api_routes(ctx: Any, team_of: Callable[[web.Request], str]) -> list[tuple[str, str, Callable]]:
    """(method, path, handler) of the observability routes, for setup_api to register.

    `/sandboxes/metrics` must be registered before `/sandboxes/{sandboxID}`.
    """
    h = ObservabilityHandlers(ctx, team_of)
    return [
        ("GET", "/sandboxes/metrics", h.sandboxes_metrics),
        ("GET", "/sandboxes/{sandboxID}/metrics", h.sandbox_metrics),
        ("GET", "/sandboxes/{sandboxID}/logs", h.sandbox_logs_v1),
        ("GET", "/v2/sandboxes/{sandboxID}/logs", h.sandbox_logs_v2),
        ("GET", "/events", h.events),
        ("GET", "/observability/nodes", h.nodes),
        ("GET", "/observability/lineage", h.lineage),
    ]


def mount_observability(app: web.Application, obs: Any, api_ctx: Any) -> None:
    """On the server's app: /metrics (Prometheus) and the console; the API routes get `obs`."""
    from agentenv.observability.metrics import mount_metrics

    api_ctx.observability = obs
    settings = obs.settings

    async def api_key_ok(request: web.Request) -> bool:
        try:
            await api_ctx.auth.authenticate(request.headers.get("X-API-KEY"))
            return True
        except Exception:  # noqa: BLE001
            return False

    mount_metrics(app, obs.metrics.registry, bearer_token=settings.metrics_bearer_token, also_allow=api_key_ok,
                  before_scrape=obs.before_scrape)
    if settings.console:
        from agentenv.console import mount_console

        mount_console(app)

