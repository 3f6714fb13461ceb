"""`agentenv node`: one host's orchestrator, runtime and sandbox traffic, as a member of a cluster.

It is the single-node server (same orchestrator, API, traffic proxy) with three differences:
- its state store is the cluster's PostgreSQL, seen through `NodeScopedStore`: it lists, writes
  and deletes only its own sandboxes, and never overwrites one another node has taken over;
- a pause publishes the sandbox's state to the S3 snapshot store, so any node can resume it;
- it heartbeats its capacity and load into the node registry, and serves the internal RPC the
  gateway uses (`POST /internal/rpc/<method>`, cluster token required).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from aiohttp import web

from agentenv.cluster import codec
from agentenv.cluster.fence import Fence
from agentenv.cluster.internal import Client, cluster_auth, error_response
from agentenv.config import Settings
from agentenv.errors import AgentEnvError, Unavailable
from agentenv.orchestrator import operations
from agentenv.models import NodeRecord, SandboxRecord, SandboxState, utcnow

log = logging.getLogger("agentenv.cluster.node")


class NodeScopedStore:
    """The shared cluster store as one node sees it (wraps a `ClusterStateStore`).

    While the node is fenced (`cluster/fence.py`) its sandbox writes are dropped: the cluster's
    truth stays as the cluster left it, and the node writes its own back when it rejoins."""

    def __init__(self, inner, node_id: str, factory=None, lane_factory=None) -> None:
        self.inner = inner
        self.node_id = node_id
        self.fenced = False
        self._factory = factory  # a fresh, unopened store (reconnect)
        self._lane_factory = lane_factory  # a fresh, unopened one-connection store: the heartbeat's own
        self._lane = None

    async def heartbeat(self, rec) -> None:
        """The node's heartbeat write. With `lane_factory`, on a connection of its own: under load the
        shared pool can be saturated for longer than the lease (every connection busy, the rest
        queued), and a healthy node must not fence itself because its heartbeat waited in that queue.
        The lane still proves what the lease means: this node reaches the state store."""
        if self._lane_factory is None:
            await self.inner.put_node(rec)
            return
        if self._lane is None:
            lane = self._lane_factory()
            await lane.open(upgrade=False)  # the node's own store migrated the database at its start
            self._lane = lane
        await self._lane.put_node(rec)

    async def close_lane(self) -> None:
        lane, self._lane = self._lane, None
        if lane is not None:
            await _close_quietly(lane)

    def __getattr__(self, name: str) -> Any:  # templates, keys, snapshots, nodes: shared as they are
        return getattr(self.inner, name)

    async def put_sandbox(self, rec: SandboxRecord) -> bool:
        if self.fenced:
            log.debug("fenced: not writing %s (%s)", rec.sandbox_id, rec.state.value)
            return False
        return await self.inner.put_sandbox_of(rec, self.node_id)

    async def delete_sandbox(self, sandbox_id: str) -> None:
        if self.fenced:
            log.debug("fenced: not deleting %s", sandbox_id)
            return
        await self.inner.delete_sandbox_of(sandbox_id, self.node_id)

    async def list_sandboxes(self, *, team_id: str | None = None, states: list[SandboxState] | None = None,
                             node_id: str | None = None) -> list[SandboxRecord]:
        return await self.inner.list_sandboxes(team_id=team_id, states=states, node_id=self.node_id)

    async def reserve_team(self, team_id: str, node_id: str, n: int, limit: int) -> tuple[list[str], int]:
        if self.fenced:  # it answers nothing while fenced; a start racing the fence must not be admitted
            raise Unavailable(f"node {self.node_id} is fenced", error_code="node_fenced", headers={"Retry-After": "2"})
        return await self.inner.reserve_team(team_id, self.node_id, n, limit)

    async def clear_reservations(self, node_id: str) -> int:
        return await self.inner.clear_reservations(self.node_id)

    async def claim_sandbox(self, sandbox_id: str, from_node: str) -> bool:
        return await self.inner.claim_sandbox(sandbox_id, from_node, self.node_id)

    async def reconnect(self) -> None:
        """Replace the store by a freshly connected one (after the network lost the old one's
        connections, queries on them can hang for minutes); the old one closes in the background."""
        if self._factory is None:
            return
        fresh = self._factory()
        try:
            await fresh.open()
        except BaseException:
            asyncio.get_running_loop().create_task(_close_quietly(fresh))
            raise
        old, self.inner = self.inner, fresh
        asyncio.get_running_loop().create_task(_close_quietly(old))
        lane, self._lane = self._lane, None  # the heartbeat's connection too: opened afresh on its next use
        if lane is not None:
            asyncio.get_running_loop().create_task(_close_quietly(lane))


    def abandon(self) -> None:
        """Drop the store's connections at once (on fencing): a write still queued on a connection
        the network cut must not land when the network comes back, after the node rejoined."""
        _terminate(self.inner)
        if self._lane is not None:
            _terminate(self._lane)


def _terminate(store) -> None:
    # SQLStateStore.terminate() cuts every driver connection (asyncpg) now, without a round trip.
    for obj in (store, getattr(store, "_pool", None)):
        terminate = getattr(obj, "terminate", None)
        if callable(terminate):
            try:
                terminate()
            except Exception:  # noqa: BLE001
                log.exception("terminating the state store's connections")
            return


async def _close_quietly(store) -> None:
    try:  # what still runs on it finishes; connections the network lost are cut
        await asyncio.wait_for(store.close(), 60)
    except (Exception, asyncio.CancelledError):  # noqa: BLE001 - connections to a lost peer: cut them
        _terminate(store)


def _meminfo_mb() -> tuple[int, int]:
    """(total, in use) in MB, from /proc/meminfo."""
    vals: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            vals[k] = int(v.split()[0])
    total = vals.get("MemTotal", 0) // 1024
    return total, total - vals.get("MemAvailable", 0) // 1024


class NodeAgent:
    """Heartbeats + internal RPC around one orchestrator."""

    # Orchestrator operations the gateway may call (keyword arguments only): the typed request table.
    RPC = operations.RPC

    def __init__(self, settings: Settings, components, *, client_ssl=None) -> None:
        self.settings = settings
        self.c = components
        self.orch = components.orchestrator
        self.store: NodeScopedStore = components.store
        self.node_id = settings.node_id
        self.url = (settings.node_url or settings.api_url()).rstrip("/")
        if client_ssl is not None and self.url.startswith("http://"):  # cluster TLS: its listener is HTTPS
            self.url = "https://" + self.url[len("http://"):]
        self.draining = False
        self.started_at = utcnow()
        self._task: asyncio.Task | None = None
        # heartbeats only; each call is bounded by the lease (`Fence.renew`), this only backs it up
        self.client = Client.for_settings(settings, timeout=max(settings.fence_after_s(), 1.0),
                                          ssl_context=client_ssl)
        self.fence = Fence(self)

    def status(self) -> NodeRecord:
        count, cpu, mem = self.orch.usage()
        total_mb, used_mb = _meminfo_mb()
        ncpu = os.cpu_count() or 1
        layers_dir = self.orch.artifacts.root / "layers"
        cached = sorted(p.name for p in layers_dir.iterdir() if not p.name.startswith(".")) if layers_dir.exists() else []
        return NodeRecord(
            node_id=self.node_id, url=self.url,
            state="fenced" if self.fence.fenced else "draining" if self.draining else "active", cpu_count=ncpu,
            memory_mb=total_mb, max_sandboxes=self.settings.max_sandboxes, sandboxes=count, alloc_cpu=cpu,
            alloc_memory_mb=mem, load=round(os.getloadavg()[0] / ncpu, 3), used_memory_mb=used_mb,
            cached_layers=cached, runtimes=list(self.orch.runtimes), started_at=self.started_at)

    async def heartbeat(self) -> None:
        """Renew the lease (`fence.Fence`); when the state store took it, reconcile with it: paused
        sandboxes another node took over are released, a fenced node rejoins."""
        if await self.fence.renew() == "store":
            await self.fence.reconcile()

    async def pause_running(self, timeout: float) -> tuple[list[str], list[str]]:
        """Termination drain: pause every running sandbox into the snapshot store (a node pause
        publishes), so another node resumes it. Returns (paused, failed); failed ones stop with the node."""
        ids = sorted(self.orch.running_ids())
        paused: list[str] = []
        failed: list[str] = []
        if not ids:
            return paused, failed
        log.info("node %s drain: pausing %d running sandbox(es) into the snapshot store", self.node_id, len(ids))
        sem = asyncio.Semaphore(4)  # captures are CPU- and IO-heavy; don't start them all at once

        async def one(sid: str) -> None:
            async with sem:
                try:
                    await self.orch.pause_sandbox(sid, team_id=None)
                    paused.append(sid)
                except Exception as e:  # noqa: BLE001 - one sandbox must not stop the drain of the rest
                    failed.append(sid)
                    log.warning("node %s drain: cannot pause %s (%s); it stops with the node", self.node_id, sid, e)

        tasks = [asyncio.create_task(one(sid)) for sid in ids]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        failed += [sid for sid in ids if sid not in paused and sid not in failed]
        log.info("node %s drain: %d paused, %d not", self.node_id, len(paused), len(failed))
        return paused, failed

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self.heartbeat()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the database may be briefly away: keep trying
                log.warning("heartbeat failed: %s", e)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        self.fence.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.fence.stop()

    # ------------------------------------------------------------------ internal HTTP

    async def rpc(self, request: web.Request) -> web.Response:
        kwargs = codec.decode(await request.json())
        try:
            req = operations.from_rpc(request.match_info["method"], kwargs)
            result = await self.orch.handle(req)
        except AgentEnvError as e:
            return error_response(e)
        return web.json_response(codec.encode(result))

    async def drain(self, request: web.Request) -> web.Response:
        who = request.get("cluster_peer")  # cluster TLS: a node certificate drains its own node only
        if who is not None and who[0] == "node" and who[1] != self.node_id:
            return web.json_response({"code": 403, "message": f"node {who[1]} cannot drain node {self.node_id}"},
                                     status=403)
        body = await request.json() if request.can_read_body else {}
        self.draining = bool(body.get("draining", True))
        await self.heartbeat()
        log.info("node %s %s", self.node_id, "draining" if self.draining else "accepting sandboxes again")
        return web.json_response(codec.encode(self.status()))

    async def status_handler(self, request: web.Request) -> web.Response:
        return web.json_response(codec.encode(self.status()))

    def add_routes(self, app: web.Application) -> None:
        app.middlewares.insert(0, cluster_auth(self.settings, self.c.proxy.matches))
        app.middlewares.insert(0, self.fence.middleware())
        app.router.add_post("/internal/rpc/{method}", self.rpc)
        app.router.add_post("/internal/drain", self.drain)
        app.router.add_get("/internal/status", self.status_handler)
        if self.c.observability is not None:  # the gateways' merged event stream (cluster/view.py)
            from agentenv.cluster.view import node_events_route

            app.router.add_get("/internal/events", node_events_route(self.c.observability))


def _data_plane_listener(settings: Settings, c, agent: NodeAgent, reloader):
    """The node's listener through HAProxy (`data_plane`, as `serve`: docs/proxy.md), or None for
    the Python server's own. With cluster TLS, HAProxy speaks the same mutual TLS (the node's
    certificate, the cluster CA); only gateway, scheduler and admin certificates reach sandboxes on
    its fast path, and a fenced node routes nothing there."""
    from agentenv.cluster import tls
    from agentenv.proxy import dataplane
    from agentenv.proxy.haproxy_conf import ClusterListener
    from agentenv.server import StartupError, plan_data_plane, start_haproxy

    if settings.https_bind:
        raise StartupError("https_bind is for `agentenv serve`; a node's listener is its cluster listener "
                           "(put TLS for clients on the gateways' load balancer)")
    chosen = plan_data_plane(settings)
    log.info("data plane: %s", chosen.reason)
    if chosen.haproxy is None:
        return None
    cluster = None
    if tls.enabled(settings):
        pem = tls.write_pem(settings, dataplane.layout(settings).dir / "cluster.pem")
        cluster = ClusterListener(pem, Path(settings.cluster_ca_file), tuple(sorted(tls.OTHER_ROLES)))
    source = dataplane.NodeRoutes(c.orchestrator, lambda: agent.fence.fenced)

    async def listen(runner):
        site, dp = await start_haproxy(settings, chosen, c, runner, source=source, cluster=cluster)

        async def cut(sandbox_id: str) -> None:  # fenced: off the fast path, HAProxy's connections reset
            await dp.leave_fast_path(sandbox_id)
            await dataplane.reset_sandbox_connections(dp, c.orchestrator, sandbox_id)

        agent.fence.on_fenced.append(cut)
        if reloader is not None and cluster is not None:
            async def new_certificate() -> None:
                tls.write_pem(settings, cluster.pem)
                await dp.install_certificate(cluster.pem)
                log.info("cluster certificate reloaded into haproxy")

            reloader.on_reload.append(new_certificate)
        return site, dp.stop

    return listen


def configure_role_logging(settings: Settings) -> None:
    """Same log format as `serve` (JSON lines by default)."""
    from agentenv.observability.logs import configure_logging

    configure_logging(logging.getLevelName(logging.getLogger().level), settings.log_format)


def open_cluster_store(settings: Settings, *, max_size: int = 10):
    from agentenv.state.postgres import PostgresStateStore, is_postgres_url

    if not is_postgres_url(settings.database_url):
        raise SystemExit("cluster roles need AGENTENV_DATABASE_URL=postgresql://... (the shared state store)")
    return PostgresStateStore(settings.database_url, min_size=1, max_size=max_size)


async def run_node(settings: Settings, *, progress=None) -> None:
    from agentenv.cluster._run import run_app, start_role
    from agentenv.proxy import LISTENER_OPTIONS
    from agentenv.runtimes._reaper import become_subreaper, reap_forever
    from agentenv.server import build, make_app

    shared = start_role(settings, "node")
    become_subreaper()
    reaper = asyncio.create_task(reap_forever(), name="orphan-reaper")
    try:
        settings.fence_timing()
    except ValueError as e:
        raise SystemExit(f"agentenv node: {e}") from None
    store = NodeScopedStore(shared, settings.node_id, factory=lambda: open_cluster_store(settings),
                            lane_factory=lambda: open_cluster_store(settings, max_size=1))
    c = await build(settings, store=store, publish_paused=True)
    from agentenv.cluster import tls

    server_ctx = tls.server_context(settings) if tls.enabled(settings) else None
    client_ctx = tls.client_context(settings) if server_ctx is not None else None
    reloader = tls.Reloader(settings, server_ctx, client_ctx) if server_ctx is not None else None
    agent = NodeAgent(settings, c, client_ssl=client_ctx)
    c.orchestrator.recover_fenced = agent.fence.recover
    started = False
    try:
        await c.images.ensure_base(progress)
        await c.images.ensure_tools(progress)
        await c.orchestrator.start()
        started = True
        if c.observability is not None:
            await c.observability.start()
        app = make_app(c)
        agent.add_routes(app)

        async def on_started() -> None:
            await agent.heartbeat()
            agent.start()
            if reloader is not None:
                reloader.start()
            print(f"agentenv node {settings.node_id} is serving at {agent.url}", flush=True)

        listen = _data_plane_listener(settings, c, agent, reloader)
        await run_app(app, settings.host, settings.port, grace_s=settings.shutdown_grace_s, on_started=on_started,
                      ssl_context=server_ctx, listen=listen, **LISTENER_OPTIONS)
    finally:
        log.info("node %s shutting down", settings.node_id)
        if reloader is not None:
            await reloader.stop()
        await agent.stop()
        if started:
            agent.draining = True
            await agent.fence.renew()  # nothing new is placed here while we stop
            if settings.drain_on_stop:
                await agent.pause_running(settings.drain_timeout_s)
            await c.orchestrator.stop()
            if c.observability is not None:
                await c.observability.stop()
            try:  # left cleanly: its paused sandboxes (published) resume elsewhere; nothing is lost
                await asyncio.wait_for(store.set_node_state(settings.node_id, "dead"), 10)
            except Exception:  # noqa: BLE001
                pass
        await agent.client.close()
        await c.proxy.close()
        await store.close_lane()
        await store.inner.close()
        reaper.cancel()
