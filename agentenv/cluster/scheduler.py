"""`agentenv scheduler`: where a sandbox goes, and which nodes are gone.

Placement (`Placement.place`) filters and scores the nodes of the registry (heartbeats in the state
store) instead of taking turns:

- hard limits (admission control): the node is active (not draining, not dead, heartbeat fresh),
  it serves the runtime the sandbox needs (when one is named), its active sandboxes + the placements in flight stay within its `max_sandboxes`, the memory the
  sandboxes may use stays within its physical memory x `memory_overcommit`, and the memory actually
  in use leaves room for the new sandbox. No node passes -> a typed 503 (`cluster_full`) with
  Retry-After, never an overloaded node;
- score (lower wins): how full the node is (the largest of its sandbox-count, allocated-vCPU and
  allocated-memory fractions), plus its actually used CPU (load average per core) and memory,
  minus a bonus for the fraction of the requested layers it already caches (creating from a
  snapshot, resuming a paused sandbox elsewhere);
- fork children go to the source's node (they restore from its local capture) or get the 503.

Placements in flight are reserved until the gateway reports them done, so a burst of creates
spreads out before the next heartbeats show the new load. The liveness sweep marks nodes whose
heartbeats stopped dead and their sandboxes lost (`ClusterStateStore.expire_nodes`, one
transaction, one scheduler at a time). A node whose heartbeats are late but which still answers
its status route is busy (its event loop starved by its sandboxes), not dead: it is spared.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import aiohttp
from aiohttp import web

from agentenv.cluster import codec
from agentenv.cluster.internal import Client, cluster_auth, error_response
from agentenv.config import Settings
from agentenv.errors import AgentEnvError, BadRequest, Unavailable
from agentenv.models import NodeRecord, utcnow

log = logging.getLogger("agentenv.cluster.scheduler")


@dataclass
class Request:
    kind: str = "create"  # create | resume | fork | build (a template build: placed like a create)
    cpu: int = 2
    memory_mb: int = 1024
    count: int = 1
    layers: list[str] = field(default_factory=list)
    node: str | None = None  # fork: the source's node; resume: the node that paused it
    runtime: str | None = None  # the runtime the sandbox must run under (None: any node's default)
    exclude: list[str] = field(default_factory=list)  # nodes that already refused this request
    wait_s: float = 0.0  # how long to wait for room before answering 503


@dataclass
class _Reservation:
    node_id: str
    count: int
    cpu: int
    memory_mb: int
    expires: float
    # Set when the gateway reports the start done: from then on the reservation no longer counts
    # as a start in flight, but its load still does until a heartbeat of the node newer than this
    # shows the new sandbox (otherwise the node looks emptier than it is and takes every next one).
    done_at: datetime | None = None


class Placement:
    """Scores nodes; keeps the reservations of placements in flight (in memory, per scheduler)."""

    def __init__(self, *, dead_after_s: float, max_starting: int = 4, memory_overcommit: float = 4.0,
                 cpu_overcommit: float = 8.0, reservation_ttl_s: float = 120.0) -> None:
        self.dead_after_s = dead_after_s
        self.max_starting = max_starting
        self.memory_overcommit = memory_overcommit
        self.cpu_overcommit = cpu_overcommit
        self.reservation_ttl_s = reservation_ttl_s
        self._reservations: dict[int, _Reservation] = {}
        self._ids = itertools.count(1)

    def _pending(self, n: NodeRecord) -> tuple[int, int, int, int]:
        """(starts in flight, sandboxes, vCPUs, MiB) reserved on `n` beyond what its heartbeat shows."""
        now = time.monotonic()
        for rid in [r for r, v in self._reservations.items()
                    if v.expires < now or (v.node_id == n.node_id and v.done_at and n.heartbeat_at > v.done_at)]:
            del self._reservations[rid]
        rs = [r for r in self._reservations.values() if r.node_id == n.node_id]
        return (sum(r.count for r in rs if r.done_at is None), sum(r.count for r in rs),
                sum(r.cpu for r in rs), sum(r.memory_mb for r in rs))

    def fits(self, n: NodeRecord, req: Request) -> str | None:
        """None if `n` can take `req` now, else why not."""
        if n.state != "active":
            return n.state
        if (utcnow() - n.heartbeat_at) > timedelta(seconds=self.dead_after_s):
            return "no recent heartbeat"
        if req.runtime and n.runtimes and req.runtime not in n.runtimes:
            return f"does not serve the {req.runtime} runtime"
        starting, p_count, _p_cpu, p_mem = self._pending(n)
        if n.sandboxes + p_count + req.count > n.max_sandboxes:
            return f"at capacity ({n.sandboxes + p_count}/{n.max_sandboxes} sandboxes)"
        if starting and starting + req.count > self.max_starting:
            return f"busy starting {starting} sandboxes"
        if n.alloc_memory_mb + p_mem + req.memory_mb * req.count > n.memory_mb * self.memory_overcommit:
            return "memory fully allocated"
        if n.used_memory_mb + req.memory_mb // 4 * req.count > n.memory_mb * 0.95:
            return "memory in use"
        return None

    def score(self, n: NodeRecord, req: Request) -> float:
        _starting, p_count, p_cpu, p_mem = self._pending(n)
        fullness = max((n.sandboxes + p_count) / max(n.max_sandboxes, 1),
                       (n.alloc_cpu + p_cpu) / max(n.cpu_count * self.cpu_overcommit, 1),
                       (n.alloc_memory_mb + p_mem) / max(n.memory_mb * self.memory_overcommit, 1))
        used = 0.5 * min(n.load, 2.0) + 0.5 * n.used_memory_mb / max(n.memory_mb, 1)
        cached = (len(set(req.layers) & set(n.cached_layers)) / len(req.layers)) if req.layers else 0.0
        return fullness + 0.25 * used - 0.3 * cached

    def place(self, nodes: list[NodeRecord], req: Request) -> tuple[NodeRecord, int]:
        """The chosen node and a reservation id; raises the typed 503 when no node fits."""
        if req.count < 1:
            raise BadRequest("count must be >= 1")
        candidates = [n for n in nodes if n.node_id not in req.exclude]
        if req.kind == "fork":
            candidates = [n for n in candidates if n.node_id == req.node]
        refusals = {n.node_id: self.fits(n, req) for n in candidates}
        ok = [n for n in candidates if refusals[n.node_id] is None]
        if not ok:
            raise self._full(req, refusals)
        if req.kind == "resume" and req.node and any(n.node_id == req.node for n in ok):
            best = next(n for n in ok if n.node_id == req.node)  # its files are still there
        else:
            best = min(ok, key=lambda n: (self.score(n, req), n.node_id))
        rid = next(self._ids)
        self._reservations[rid] = _Reservation(best.node_id, req.count, req.cpu * req.count,
                                               req.memory_mb * req.count, time.monotonic() + self.reservation_ttl_s)
        return best, rid

    def release(self, rid: int) -> None:
        """The start is over: its load counts until the node's next heartbeat shows it."""
        r = self._reservations.get(rid)
        if r is not None:
            r.done_at = utcnow()
            r.expires = min(r.expires, time.monotonic() + max(3 * self.dead_after_s, 30.0))

    @staticmethod
    def _full(req: Request, refusals: dict[str, str | None]) -> Unavailable:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(refusals.items())) or "no nodes registered"
        what = "the source sandbox's node" if req.kind == "fork" else "no node"
        starting = bool(refusals) and all((v or "").startswith("busy starting") for v in refusals.values())
        return Unavailable(f"Cluster is full: {what} can take {req.count} more sandbox(es) now ({why}); "
                           "retry after the Retry-After delay", error_code="cluster_full",
                           headers={"Retry-After": "1" if starting else "3", "Should-Retry": "true"})


class SchedulerService:
    def __init__(self, settings: Settings, store, *, ssl_context=None) -> None:
        self.settings = settings
        self.store = store
        self.placement = Placement(dead_after_s=settings.node_dead_after_s,
                                   max_starting=settings.max_starting_per_node)
        self._room = asyncio.Condition()
        self._nodes: list[NodeRecord] = []
        self._nodes_at = 0.0
        self._lock = asyncio.Lock()
        self._sweeper: asyncio.Task | None = None
        # probes of nodes whose heartbeats are late
        self._client = Client.for_settings(settings, timeout=30.0, ssl_context=ssl_context)

    async def nodes(self, max_age_s: float = 0.25) -> list[NodeRecord]:
        """The registry, re-read at most every `max_age_s` (placements come in bursts)."""
        if time.monotonic() - self._nodes_at > max_age_s:
            self._nodes = await self.store.list_nodes()
            self._nodes_at = time.monotonic()
        return self._nodes

    async def place(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            req = Request(**{k: v for k, v in body.items() if k in Request.__dataclass_fields__})
            node, rid = await self._place_waiting(req)
        except AgentEnvError as e:
            return error_response(e)
        except TypeError as e:
            return error_response(BadRequest(f"bad placement request: {e}"))
        return web.json_response({"node_id": node.node_id, "url": node.url, "reservation": rid})

    async def _place_waiting(self, req: Request) -> tuple[NodeRecord, int]:
        """Place now, or wait (up to req.wait_s) for a release or a heartbeat to make room.

        Waiting requests park here, cheaply, instead of clients polling; each wakes on every
        release and re-checks. When the wait is over the typed 503 goes back with Retry-After.
        """
        deadline = time.monotonic() + min(max(req.wait_s, 0.0), 300.0)
        while True:
            try:
                async with self._lock:  # one decision at a time: each sees the previous reservation
                    return self.placement.place(await self.nodes(), req)
            except Unavailable:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                async with self._room:
                    try:  # heartbeats change the picture too: look again at least every second
                        await asyncio.wait_for(self._room.wait(), timeout=min(left, 1.0))
                    except asyncio.TimeoutError:
                        pass

    async def release(self, request: web.Request) -> web.Response:
        self.placement.release(int((await request.json()).get("reservation", 0)))
        self._nodes_at = 0.0  # the finished start shows in the node's next heartbeat
        async with self._room:
            self._room.notify_all()
        return web.Response(status=204)

    async def relay_heartbeat(self, request: web.Request) -> web.Response:
        """A node that cannot reach the state store heartbeats here; written for it (its lease,
        docs/cluster.md "Fencing"), so a node cut off from the store only is not declared dead."""
        rec = codec.decode(await request.json())
        if not isinstance(rec, NodeRecord):
            return error_response(BadRequest("a heartbeat is a node record"))
        who = request.get("cluster_peer")  # cluster TLS: a node heartbeats for itself only
        if who is not None and who[1] != rec.node_id:
            return web.json_response({"code": 403, "message": f"node {who[1]} cannot heartbeat for {rec.node_id}"},
                                     status=403)
        await self.store.put_node(rec)
        return web.Response(status=204)

    async def list_nodes(self, request: web.Request) -> web.Response:
        return web.json_response(codec.encode(await self.store.list_nodes()))

    async def _answers(self, n: NodeRecord) -> bool:
        """Whether a node with late heartbeats still answers `GET /internal/status`."""
        try:
            async with self._client.session.get(
                    f"{n.url.rstrip('/')}/internal/status", headers=self._client.headers,
                    timeout=aiohttp.ClientTimeout(total=max(1.0, self.settings.node_dead_after_s / 2))) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def sweep(self) -> dict[str, list[str]]:
        dead_after = timedelta(seconds=self.settings.node_dead_after_s)
        late = [n for n in await self.store.list_nodes()
                if n.state != "dead" and utcnow() - n.heartbeat_at > dead_after]
        spare = []
        for n, ok in zip(late, await asyncio.gather(*(self._answers(n) for n in late))):
            if ok:
                spare.append(n.node_id)
                log.warning("node %s: no heartbeat for %.0fs, but it answers: busy, not declared dead", n.node_id,
                            (utcnow() - n.heartbeat_at).total_seconds())
        lost = await self.store.expire_nodes(self.settings.node_dead_after_s, spare=spare)
        for node_id, ids in lost.items():
            log.warning("node %s stopped heartbeating: declared dead, %d sandbox(es) lost: %s", node_id, len(ids),
                        ", ".join(ids[:20]))
        if lost:
            self._nodes_at = 0.0
        return lost

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                log.warning("liveness sweep failed: %s", e)
            await asyncio.sleep(min(self.settings.heartbeat_interval_s, self.settings.node_dead_after_s / 3))

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="liveness-sweep")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await self._client.close()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[cluster_auth(self.settings)])
        app.router.add_post("/internal/place", self.place)
        app.router.add_post("/internal/release", self.release)
        app.router.add_get("/internal/nodes", self.list_nodes)
        app.router.add_post("/internal/heartbeat", self.relay_heartbeat)
        app.router.add_get("/health", lambda _r: web.Response(text="ok"))
        from agentenv.observability.roles import mount_role_metrics

        mount_role_metrics(app, self.settings, role="scheduler", list_nodes=self.store.list_nodes)
        return app


async def run_scheduler(settings: Settings) -> None:
    from agentenv.cluster._run import run_app, start_role

    store = start_role(settings, "scheduler")
    try:
        settings.fence_timing()  # the nodes' lease must lapse before this scheduler's deadline
    except ValueError as e:
        raise SystemExit(f"agentenv scheduler: {e}") from None
    await store.open()
    from agentenv.cluster import tls

    server_ctx = tls.server_context(settings) if tls.enabled(settings) else None
    client_ctx = tls.client_context(settings) if server_ctx is not None else None
    svc = SchedulerService(settings, store, ssl_context=client_ctx)
    store_gc = _store_collector(settings, store)
    reloader = tls.Reloader(settings, server_ctx, client_ctx) if server_ctx is not None else None
    try:
        async def on_started() -> None:
            svc.start()
            store_gc.start()
            if reloader is not None:
                reloader.start()
            scheme = "https" if server_ctx is not None else "http"
            print(f"agentenv scheduler is serving at {scheme}://{settings.host}:{settings.port}", flush=True)

        await run_app(svc.app(), settings.host, settings.port, grace_s=settings.shutdown_grace_s, on_started=on_started,
                      ssl_context=server_ctx)
    finally:
        if reloader is not None:
            await reloader.stop()
        await store_gc.stop()
        await svc.stop()
        await store.close()


def _store_collector(settings: Settings, state):
    """The snapshot store's periodic GC runs here, on the one scheduler, never on nodes (they would
    sweep the shared store against each other); its roots are the store's manifests and the
    cluster's state store (every node's sandboxes, builds and catalog)."""
    from agentenv.storage.snapshots import store_from_settings
    from agentenv.storage.storegc import StoreCollector, state_roots

    snapshots = store_from_settings(settings)
    return StoreCollector(snapshots, lambda: state_roots(state, snapshots),
                          interval_s=settings.store_gc_interval_s, grace_s=settings.store_gc_grace_s)
