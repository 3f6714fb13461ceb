"""One cluster view at the gateway: the event stream, the cross-sandbox metrics and the console's
data, gathered from every node.

- `/events`: the gateway tails every node's event log (`GET /internal/events`, all teams, long
  poll) into one in-memory log of its own — one sequence, each event with the `nodeID` it happened
  on (and its `nodeSeq` there), in the order the gateway received them (each node's own order is
  kept). The public `/events` handler (list, long poll, SSE, `tail`) serves it unchanged, so
  clients see one ordered stream. Each gateway replica numbers its own stream: a consumer that
  resumes with `since=` / `Last-Event-ID` should stay on one replica (sticky sessions).
- `/sandboxes/metrics`, `/observability/nodes`, `/observability/lineage`: asked of every live
  node with the caller's API key (nodes authenticate it against the shared store) and merged; a
  node that does not answer within `FAN_OUT_TIMEOUT_S` is left out and named in the
  `X-Agentenv-Partial` header.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from agentenv.observability.events import select_events, wait_past


log = logging.getLogger("agentenv.cluster.view")

FAN_OUT_TIMEOUT_S = 10.0
MEMORY_EVENTS = 20_000
BACKFILL = 1000  # events of each node's history a starting gateway takes in
LONG_POLL_S = 20


class ClusterEvents:
    """The merged event log (the read side of observability.events.EventLog: seq, read, wait)."""

    def __init__(self) -> None:
        self.seq = 0
        self.recent: deque[dict] = deque(maxlen=MEMORY_EVENTS)
        self._changed = asyncio.Condition()
        self.listeners: list[Callable[[str, dict], None]] = []  # (node id, event), e.g. the gateway's routes

    def add(self, node_id: str, events: list[dict]) -> None:
        for ev in events:
            self.seq += 1
            self.recent.append({**ev, "seq": self.seq, "nodeSeq": ev.get("seq"), "nodeID": node_id})
            for listener in self.listeners:
                listener(node_id, ev)
        if events:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def read(self, since: int, *, limit: int = 1000, team_id: str | None = None,
             sandbox_id: str | None = None) -> list[dict]:
        return select_events((e for e in self.recent if e["seq"] > since), limit=limit, team_id=team_id,
                             sandbox_id=sandbox_id)

    async def wait(self, since: int, timeout: float) -> bool:
        return await wait_past(self._changed, lambda: self.seq, since, timeout)


class EventTailer:
    """One long-poll loop per live node, feeding `ClusterEvents`."""

    def __init__(self, orch, client, events: ClusterEvents) -> None:
        self.orch = orch
        self.client = client
        self.events = events
        self._tasks: dict[str, asyncio.Task] = {}
        self._cursor: dict[str, int] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch_nodes(), name="event-tailers")

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._tasks.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch_nodes(self) -> None:
        while True:
            try:
                nodes = {n.node_id: n for n in (await self.orch.nodes(max_age_s=2.0)).values() if n.state != "dead"}
                for node_id, n in nodes.items():
                    t = self._tasks.get(node_id)
                    if t is None or t.done():
                        self._tasks[node_id] = asyncio.create_task(self._tail(node_id), name=f"events-{node_id}")
                for node_id in [k for k in self._tasks if k not in nodes]:
                    self._tasks.pop(node_id).cancel()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the registry may be briefly away
                log.warning("event tailers: cannot list nodes: %s", e)
            await asyncio.sleep(2.0)

    async def _tail(self, node_id: str) -> None:
        while True:
            n = (await self.orch.nodes()).get(node_id)
            if n is None or n.state == "dead":
                return
            since = self._cursor.get(node_id)
            params = {"since": str(since) if since is not None else "-1", "wait": str(LONG_POLL_S),
                      "limit": "1000"}
            try:
                async with self.client.session.get(
                        f"{n.url.rstrip('/')}/internal/events", params=params,
                        headers=self.client.headers,
                        timeout=aiohttp.ClientTimeout(total=LONG_POLL_S + 10, sock_connect=5)) as r:
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}")
                    body = await r.json()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a node away or restarting: try again shortly
                log.info("event tail of node %s: %s", node_id, e or type(e).__name__)
                await asyncio.sleep(2.0)
                continue
            last = int(body.get("lastSeq") or 0)
            if since is not None and last < since:  # the node's log started over (new data dir)
                self._cursor[node_id] = 0
                continue
            self.events.add(node_id, body.get("events") or [])
            self._cursor[node_id] = last


def node_events_route(obs):
    """`GET /internal/events?since=&limit=&wait=` on a node: every team's events (with teamID), for
    the gateways' merged stream. `since=-1`: the last BACKFILL events."""

    async def handler(request: web.Request) -> web.Response:
        q = request.query
        try:
            since = int(q.get("since", "0"))
            limit = max(1, min(int(q.get("limit", "1000")), 5000))
            wait = max(0.0, min(float(q.get("wait", "0")), 55.0))
        except ValueError:
            return web.json_response({"code": 400, "message": "since, limit and wait are numbers"}, status=400)
        ev_log = obs.events
        if since < 0:
            since = max(0, ev_log.seq - BACKFILL)
        events = ev_log.read(since, limit=limit)
        if not events and wait > 0 and await ev_log.wait(max(since, ev_log.seq), wait):
            events = ev_log.read(since, limit=limit)
        last = events[-1]["seq"] if events else ev_log.seq  # below `since`: the log started over
        return web.json_response({"events": events, "lastSeq": last})

    return handler


# ---------------------------------------------------------------------- fan-out reads

def _merge_metrics(parts: list[Any]) -> Any:
    out: dict[str, Any] = {}
    for p in parts:
        out.update((p or {}).get("sandboxes") or {})
    return {"sandboxes": out}


def _merge_nodes(parts: list[Any]) -> Any:
    return sorted((n for p in parts for n in (p or [])), key=lambda n: str(n.get("nodeID")))


def _merge_lineage(parts: list[Any]) -> Any:
    nodes: dict[str, dict] = {}
    edges: list[dict] = []
    seen = set()
    for p in parts:
        for n in (p or {}).get("nodes") or []:
            if n.get("id") not in nodes or nodes[n["id"]].get("state") == "gone":
                nodes[n["id"]] = n
        for e in (p or {}).get("edges") or []:
            key = (e.get("from"), e.get("to"), e.get("kind"))
            if key not in seen:
                seen.add(key)
                edges.append(e)
    return {"nodes": list(nodes.values()), "edges": edges}


FAN_OUT = {"/sandboxes/metrics": _merge_metrics, "/observability/nodes": _merge_nodes,
           "/observability/lineage": _merge_lineage}


async def fan_out_get(orch, client, request: web.Request) -> web.Response:
    """Ask every live node the same GET (the caller's API key) and merge the answers."""
    nodes = [n for n in (await orch.nodes(max_age_s=0.5)).values() if n.state not in ("dead", "fenced")]
    headers = {k: v for k, v in request.headers.items() if k.lower() in ("x-api-key", "accept")}

    async def one(n) -> Any:
        async with client.session.get(f"{n.url.rstrip('/')}{request.rel_url}", headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=FAN_OUT_TIMEOUT_S, sock_connect=5)) as r:
            body = await r.json(content_type=None)
            if r.status != 200:
                return r.status, body
            return 200, body

    results = await asyncio.gather(*(one(n) for n in nodes), return_exceptions=True)
    parts, missing = [], []
    for n, res in zip(nodes, results):
        if isinstance(res, BaseException):
            log.warning("%s on node %s: %s", request.path, n.node_id, res or type(res).__name__)
            missing.append(n.node_id)
        elif res[0] != 200:
            if res[0] in (400, 401, 403):  # the caller's mistake: the same on every node
                return web.json_response(res[1], status=res[0])
            missing.append(n.node_id)
        else:
            parts.append(res[1])
    resp = web.json_response(FAN_OUT[request.path](parts))
    if missing:
        resp.headers["X-Agentenv-Partial"] = ",".join(sorted(missing))
    return resp
