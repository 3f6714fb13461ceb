"""`agentenv gateway`: the cluster's public API and sandbox-traffic entry.

The gateway serves the very same control API as a single node (`api/app.py`, validated against
`api/openapi.yaml`) by handing it `ClusterOrchestrator`, which implements the orchestrator's
operations by routing them: creates go where the scheduler places them, calls on a sandbox go to
the node that owns it (the binding is the sandbox's row in the shared state store), list calls
fan out to every live node and are merged and paged here. Sandbox traffic (envd, user ports,
WebSocket streams) is streamed by the usual `TrafficProxy` to the owning node's listener, which
proxies it into the sandbox.

Cross-node moves happen on resume: a paused sandbox whose node is gone or draining (or full) is
adopted by the node the scheduler picks, which pulls its layers and memory image from the S3
snapshot store. A sandbox whose node died while it ran is reported as lost (410) until killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from yarl import URL

from agentenv.cluster.builds import template_build
from agentenv.cluster.internal import Client
from agentenv.config import Settings
from agentenv.errors import AgentEnvError, Gone, Unavailable, sandbox_not_found
from agentenv.models import NodeRecord, SandboxRecord, SandboxState, SnapshotRecord, TemplateRecord, rfc3339
from agentenv.runtimes import select as runtime_select

log = logging.getLogger("agentenv.cluster.gateway")

LIST_TIMEOUT_S = 30.0
# The old node's release of a moved sandbox is best effort (it also notices on its next heartbeat):
# a node the network lost must not hold the move (and the SDK call behind it) for the client's 600 s.
RELEASE_TIMEOUT_S = 10.0
# Node answers after which another node is tried for the same create.
_RETRY_ELSEWHERE = {"capacity_exhausted", "node_unreachable", "node_fenced"}
# A resume whose move lost the race for the sandbox (another caller moved or resumed it first)
# looks again this many times.
_MOVE_ATTEMPTS = 3


@dataclass
class _Route:
    """Duck-types proxy.traffic.SandboxRoute; host_ip is the owning node's listener host."""

    sandbox_id: str
    host_ip: str | None
    state: str
    envd_access_token: str | None
    traffic_access_token: str | None
    node_port: int = 80


class ClusterOrchestrator:
    """What `api.app` needs from an orchestrator, implemented by routing to the nodes."""

    def __init__(self, settings: Settings, store, client: Client) -> None:
        self.settings = settings
        self.store = store
        self.client = client
        self.scheduler_url = (settings.scheduler_url or "").rstrip("/")
        self._nodes: dict[str, NodeRecord] = {}
        self._nodes_at = 0.0
        self._routes: dict[str, tuple[float, _Route]] = {}
        self._running: list[_Route] = []
        self._running_at = 0.0
        self.on_moved: list = []  # awaited with a sandbox id whose traffic must reconnect (pause, kill, move)
        self.on_route: list = []  # called with (sandbox id, node id) of a running sandbox the hop resolved
        # sandbox id -> its lock while anyone holds or awaits it (they keep it alive)
        self._moving: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, sandbox_id: str) -> AsyncIterator[None]:
        """One resume or move of a sandbox at a time through this gateway: the next caller finds it
        running and goes to its node. Across gateway replicas, the resuming node's claim in the
        store (RESUMING, which no node can adopt) keeps a second node from taking it; this lock
        spares the callers of one replica the moves and refusals of that race."""
        lock = self._moving.get(sandbox_id)
        if lock is None:
            lock = self._moving[sandbox_id] = asyncio.Lock()
        async with lock:
            yield

    # ------------------------------------------------------------------ nodes and bindings

    async def nodes(self, max_age_s: float = 0.5) -> dict[str, NodeRecord]:
        if time.monotonic() - self._nodes_at > max_age_s:
            self._nodes = {n.node_id: n for n in await self.store.list_nodes()}
            self._nodes_at = time.monotonic()
        return self._nodes

    async def _alive(self, node_id: str, max_age_s: float = 0.5) -> NodeRecord | None:
        n = (await self.nodes(max_age_s)).get(node_id)
        if n is None or n.state == "dead":
            return None
        return n

    async def _record(self, sandbox_id: str, team_id: str | None) -> SandboxRecord:
        rec = await self.store.get_sandbox(sandbox_id)
        if rec is None or (team_id is not None and rec.team_id != team_id) or rec.state in (
                SandboxState.KILLED, SandboxState.KILLING):
            raise sandbox_not_found(sandbox_id)
        return rec

    def _lost(self, rec: SandboxRecord) -> Gone:
        return Gone(f"Sandbox {rec.sandbox_id} was lost: its node {rec.node_id} stopped responding while it was "
                    f"{'running' if rec.state == SandboxState.LOST else rec.state.value} (kill it to remove the record)",
                    error_code="sandbox_lost")

    async def _owner(self, rec: SandboxRecord) -> NodeRecord:
        """The live node that holds `rec`, or the right error (lost; node unreachable)."""
        if rec.state == SandboxState.LOST:
            raise self._lost(rec)
        node = await self._alive(rec.node_id)
        if node is None:
            raise Unavailable(f"Sandbox {rec.sandbox_id} is on node {rec.node_id}, which is not responding; retry "
                              "later", error_code="node_unreachable", headers={"Retry-After": "2"})
        return node

    async def _on_owner(self, sandbox_id: str, team_id: str | None, method: str, **kw: Any) -> Any:
        rec = await self._record(sandbox_id, team_id)
        node = await self._owner(rec)
        return await self.client.rpc(node.url, method, sandbox_id=sandbox_id, team_id=team_id, **kw)

    async def _place(self, **req: Any) -> dict:
        if not self.scheduler_url:
            raise Unavailable("no scheduler configured (AGENTENV_SCHEDULER_URL)")
        return await self.client.post(f"{self.scheduler_url}/internal/place", req, what="the scheduler")

    def _release(self, reservation: int) -> None:
        async def go() -> None:
            try:
                await self.client.post(f"{self.scheduler_url}/internal/release", {"reservation": reservation},
                                       what="the scheduler")
            except AgentEnvError as e:
                log.warning("could not release reservation %s: %s", reservation, e.message)

        asyncio.get_running_loop().create_task(go())

    async def _placed(self, req: dict, method: str, **kw: Any) -> Any:
        """Place `req`, run `method` on the chosen node; try another node if that one is full or away."""
        exclude: list[str] = []
        for _attempt in range(3):
            placed = await self._place(**req, exclude=exclude)
            try:
                return await self.client.rpc(placed["url"], method, **kw)
            except AgentEnvError as e:
                if e.error_code not in _RETRY_ELSEWHERE or req.get("kind") == "fork":
                    raise
                log.info("node %s refused %s (%s); placing elsewhere", placed["node_id"], method, e.error_code)
                exclude.append(placed["node_id"])
                last = e
            finally:
                self._release(placed["reservation"])
        raise last

    # ------------------------------------------------------------------ the orchestrator's API

    async def list_templates(self) -> list[TemplateRecord]:
        return await self.store.list_templates()

    async def create_sandbox(self, *, team_id: str, template: str, **kw: Any) -> SandboxRecord:
        tmpl, build = await template_build(self.store, template)
        cpu, mem, layers = self.settings.default_cpu_count, self.settings.default_memory_mb, []
        # the runtime it must run under, so that only nodes serving it are candidates (the node
        # still decides, and refuses with the reason what it cannot serve)
        runtime = runtime_select.normalise((kw.get("metadata") or {}).get(runtime_select.METADATA_KEY))
        runtime = None if runtime == "auto" else runtime
        if tmpl is not None:
            cpu, mem = tmpl.cpu_count, tmpl.memory_mb
            if build is not None:  # its memory image fixes the runtime; nodes caching its layers score better
                cpu, mem, layers, runtime = build.cpu_count, build.memory_mb, list(build.layers), build.runtime
            runtime = runtime or tmpl.runtime
        else:
            snap = await self.store.get_snapshot(template)
            if snap is not None and snap.team_id == team_id:
                cpu, mem, layers = snap.cpu_count, snap.memory_mb, list(snap.layers)
                runtime = (snap.runtime if snap.memory_digest else None) or runtime or snap.runtime
        return await self._placed({"kind": "create", "cpu": cpu, "memory_mb": mem, "layers": layers,
                                   "runtime": runtime, "wait_s": self.settings.admission_wait_s},
                                  "create_sandbox", team_id=team_id, template=template, **kw)

    async def list_sandboxes(self, *, team_id: str) -> list[SandboxRecord]:
        """Fan out to every live node; merged (a sandbox moving between nodes is listed once)."""
        nodes = [n for n in (await self.nodes(max_age_s=0.2)).values() if n.state != "dead"]
        # a node cut off the network (not yet declared dead) must not hold the list up
        results = await asyncio.gather(*(asyncio.wait_for(self.client.rpc(n.url, "list_sandboxes", team_id=team_id),
                                                          LIST_TIMEOUT_S) for n in nodes), return_exceptions=True)
        merged: dict[str, SandboxRecord] = {}
        for n, res in zip(nodes, results):
            if isinstance(res, BaseException):
                log.warning("listing sandboxes of node %s failed: %s", n.node_id, res)
                continue
            for rec in res:
                merged.setdefault(rec.sandbox_id, rec)
        # Paused sandboxes of dead nodes are still resumable (their state is in the snapshot store).
        alive = {n.node_id for n in nodes}
        for rec in await self.store.list_sandboxes(team_id=team_id, states=[SandboxState.PAUSED]):
            if rec.node_id not in alive:
                merged.setdefault(rec.sandbox_id, rec)
        return list(merged.values())

    async def get_sandbox(self, sandbox_id: str, *, team_id: str) -> SandboxRecord:
        rec = await self._record(sandbox_id, team_id)
        if rec.state == SandboxState.PAUSED and await self._alive(rec.node_id) is None:
            return rec
        return await self._on_owner(sandbox_id, team_id, "get_sandbox")

    async def kill_sandbox(self, sandbox_id: str, *, team_id: str | None) -> None:
        rec = await self._record(sandbox_id, team_id)
        if rec.state == SandboxState.LOST:
            await self.store.delete_sandbox(sandbox_id)  # nothing left to stop: its node is gone
        elif rec.state == SandboxState.PAUSED and await self._alive(rec.node_id) is None:
            async with self._one_at_a_time(sandbox_id):
                node = await self._move(rec)  # another node deletes its published state properly
                await self.client.rpc(node["url"], "kill_sandbox", sandbox_id=sandbox_id, team_id=team_id)
        else:
            await self._on_owner(sandbox_id, team_id, "kill_sandbox")
        await self._moved(sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout: int, *, team_id: str) -> None:
        await self._on_owner(sandbox_id, team_id, "set_timeout", timeout=timeout)

    async def update_network(self, sandbox_id: str, update: dict, *, team_id: str) -> None:
        await self._on_owner(sandbox_id, team_id, "update_network", update=update)

    async def refresh(self, sandbox_id: str, duration: int, *, team_id: str) -> None:
        await self._on_owner(sandbox_id, team_id, "refresh", duration=duration)

    async def pause_sandbox(self, sandbox_id: str, *, team_id: str | None, memory: bool = True) -> None:
        await self._moved(sandbox_id)
        await self._on_owner(sandbox_id, team_id, "pause_sandbox", memory=memory)

    async def _move(self, rec: SandboxRecord) -> dict:
        """Have the node the scheduler picks adopt paused `rec` (unless its own node is still the best)."""
        placed = await self._place(kind="resume", cpu=rec.cpu_count, memory_mb=rec.memory_mb, layers=rec.layers,
                                   node=rec.node_id, runtime=rec.runtime, wait_s=self.settings.admission_wait_s)
        try:
            if placed["node_id"] != rec.node_id:
                await self.client.rpc(placed["url"], "adopt_sandbox", sandbox_id=rec.sandbox_id, from_node=rec.node_id)
                # read now, not from the 0.5 s cache: a node declared dead a moment ago may be cut
                # off, and a call to it would wait for its timeout
                old = await self._alive(rec.node_id, max_age_s=0)
                if old is not None:  # best effort: it also notices on its next heartbeat
                    try:
                        await self.client.rpc(old.url, "release_sandbox", sandbox_id=rec.sandbox_id,
                                              timeout_s=RELEASE_TIMEOUT_S)
                    except AgentEnvError as e:
                        log.info("release of %s on %s: %s", rec.sandbox_id, rec.node_id, e.message)
                log.info("moved paused sandbox %s from %s to %s", rec.sandbox_id, rec.node_id, placed["node_id"])
            return placed
        finally:
            self._release(placed["reservation"])

    async def connect_sandbox(self, sandbox_id: str, timeout: int, *, team_id: str) -> tuple[SandboxRecord, bool]:
        async with self._one_at_a_time(sandbox_id):  # until it runs: the next caller finds it RUNNING
            attempt = 1
            while True:
                rec = await self._record(sandbox_id, team_id)
                if rec.state != SandboxState.PAUSED:
                    res = await self._on_owner(sandbox_id, team_id, "connect_sandbox", timeout=timeout)
                    return res[0], bool(res[1])
                try:
                    placed = await self._move(rec)
                    await self._moved(sandbox_id)
                    res = await self.client.rpc(placed["url"], "connect_sandbox", sandbox_id=sandbox_id,
                                                timeout=timeout, team_id=team_id)
                    return res[0], bool(res[1])
                except AgentEnvError as e:
                    # another gateway replica moved or resumed it after we read the record (the
                    # node's claim of the resume lost to another node's adoption): look again
                    if e.status == 409 and e.error_code == "sandbox_changing_state" and attempt < _MOVE_ATTEMPTS:
                        attempt += 1
                        log.info("resume of %s: %s; looking again", sandbox_id, e.message)
                        continue
                    raise

    async def fork_sandbox(self, sandbox_id: str, *, team_id: str, count: int | None = None,
                           timeout: int | None = None) -> list:
        rec = await self._record(sandbox_id, team_id)
        owner = await self._owner(rec)
        placed = await self._place(kind="fork", cpu=rec.cpu_count, memory_mb=rec.memory_mb, count=count or 1,
                                   node=owner.node_id, wait_s=self.settings.admission_wait_s)
        try:
            return await self.client.rpc(owner.url, "fork_sandbox", sandbox_id=sandbox_id, team_id=team_id,
                                         count=count, timeout=timeout)
        finally:
            self._release(placed["reservation"])

    async def create_snapshot(self, sandbox_id: str, *, team_id: str, name: str | None = None,
                              memory: bool = True) -> SnapshotRecord:
        return await self._on_owner(sandbox_id, team_id, "create_snapshot", name=name, memory=memory)

    async def create_checkpoint(self, sandbox_id: str, *, team_id: str, name: str | None = None,
                                metadata: dict[str, str] | None = None) -> SnapshotRecord:
        return await self._on_owner(sandbox_id, team_id, "create_checkpoint", name=name, metadata=metadata)

    async def rollback_sandbox(self, sandbox_id: str, checkpoint_id: str, *, team_id: str) -> SandboxRecord:
        return await self._on_owner(sandbox_id, team_id, "rollback_sandbox", checkpoint_id=checkpoint_id)

    async def list_checkpoints(self, sandbox_id: str, *, team_id: str) -> list[SnapshotRecord]:
        try:  # the owner knows the sandbox; a killed one's checkpoints are in the shared store
            node = await self._owner(await self._record(sandbox_id, team_id))
        except AgentEnvError:
            node = await self._any_node()
        return await self.client.rpc(node.url, "list_checkpoints", sandbox_id=sandbox_id, team_id=team_id)

    async def checkpoint_tree(self, checkpoint_id: str, *, team_id: str) -> tuple[str, list[SnapshotRecord]]:
        root, recs = await self.client.rpc((await self._any_node()).url, "checkpoint_tree",
                                           checkpoint_id=checkpoint_id, team_id=team_id)
        return root, recs

    async def _any_node(self) -> NodeRecord:
        nodes = [n for n in (await self.nodes()).values() if n.state != "dead"]
        if not nodes:
            raise Unavailable("no node is up", error_code="cluster_full", headers={"Retry-After": "5"})
        return min(nodes, key=lambda n: n.sandboxes)

    async def list_snapshots(self, *, team_id: str, sandbox_id: str | None = None,
                             name: str | None = None) -> list[SnapshotRecord]:
        return await self.client.rpc((await self._any_node()).url, "list_snapshots", team_id=team_id,
                                     sandbox_id=sandbox_id, name=name)

    async def get_snapshot(self, snapshot_id_or_name: str, *, team_id: str) -> SnapshotRecord:
        return await self.client.rpc((await self._any_node()).url, "get_snapshot",
                                     snapshot_id_or_name=snapshot_id_or_name, team_id=team_id)

    async def delete_snapshot(self, snapshot_id_or_name: str, *, team_id: str) -> None:
        await self.client.rpc((await self._any_node()).url, "delete_snapshot",
                              snapshot_id_or_name=snapshot_id_or_name, team_id=team_id)

    # ------------------------------------------------------------------ traffic routing

    async def _moved(self, sandbox_id: str) -> None:
        self._routes.pop(sandbox_id, None)
        for cb in self.on_moved:
            await cb(sandbox_id)

    async def resolve(self, sandbox_id: str) -> _Route | None:
        hit = self._routes.get(sandbox_id)
        if hit is not None and time.monotonic() - hit[0] < 2.0:
            return hit[1]
        rec = await self.store.get_sandbox(sandbox_id)
        node = await self._alive(rec.node_id) if rec is not None else None
        if rec is None or node is None or rec.state == SandboxState.LOST:
            self._routes.pop(sandbox_id, None)
            return None
        url = URL(node.url)
        route = _Route(sandbox_id, url.host, "running", rec.envd_access_token, rec.traffic_access_token,
                       url.port or 80)
        self._routes[sandbox_id] = (time.monotonic(), route)
        if rec.state == SandboxState.RUNNING:
            for cb in self.on_route:
                cb(sandbox_id, rec.node_id)
        if len(self._routes) > 50_000:
            self._routes.clear()
        return route

    async def load_running_routes(self, max_age_s: float = 1.0) -> None:
        """Every running sandbox of the cluster (from the store, at most `max_age_s` old), for the
        signed /files URLs, which name no sandbox: the proxy matches the signature against each
        one's envd token and sends the request to its owner."""
        if time.monotonic() - self._running_at <= max_age_s:
            return
        nodes = await self.nodes()
        routes = []
        for rec in await self.store.list_sandboxes(states=[SandboxState.RUNNING]):
            node = nodes.get(rec.node_id)
            if node is None or node.state == "dead" or not rec.envd_access_token:
                continue
            url = URL(node.url)
            routes.append(_Route(rec.sandbox_id, url.host, "running", rec.envd_access_token,
                                 rec.traffic_access_token, url.port or 80))
        self._running, self._running_at = routes, time.monotonic()

    def running_routes(self):
        """The running sandboxes `load_running_routes` read, and those routed recently."""
        recent = {r.sandbox_id: r for _t, r in self._routes.values()}
        return list({**{r.sandbox_id: r for r in self._running}, **recent}.values())

    async def forward_get(self, request, sandbox_id: str):
        """A sandbox-scoped read the node answers from its own data (metrics, logs): relayed as is.

        The node authenticates the same API key against the shared store."""
        from aiohttp import web

        rec = await self._record(sandbox_id, None)
        node = await self._owner(rec)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("x-api-key", "accept")}
        async with self.client.session.get(f"{node.url}{request.rel_url}", headers=headers) as resp:
            body = await resp.read()
            return web.Response(body=body, status=resp.status, content_type=resp.content_type)

    @staticmethod
    def port_override(route: _Route, port: int) -> tuple[str, int]:
        """Sandbox traffic goes to the owning node's listener (its proxy reads the same headers)."""
        return route.host_ip or "127.0.0.1", route.node_port


def _node_hop_proxy_class():
    """The traffic proxy for the gateway -> node hop.

    The node's proxy closes its connections into a sandbox with a reset (no TIME_WAIT inside the
    sandbox); between the gateway and a node that reason does not exist, and a reset closing a
    pooled connection races with the node still reading it. Plain closes here.
    """
    import aiohttp

    from agentenv.proxy.traffic import _NO_AUTO_HEADERS, TRAFFIC_TOKEN_HEADER, TrafficProxy

    class NodeHopProxy(TrafficProxy):
        node_ssl = None  # cluster TLS: the hop goes over HTTPS with the gateway's client certificate
        # The node checks a private sandbox's traffic token again (its fast path cannot know that the
        # gateway did): it goes on with the request.
        strip_request = TrafficProxy.strip_request - {TRAFFIC_TOKEN_HEADER.lower()}

        def _hop(self, url):
            return url.with_scheme("https") if self.node_ssl is not None else url

        async def _proxy_http(self, request, flight, url, target):
            return await super()._proxy_http(request, flight, self._hop(url), target)

        async def _proxy_websocket(self, request, flight, url, target):
            return await super()._proxy_websocket(request, flight, self._hop(url), target)

        def _session(self, sandbox_id: str) -> aiohttp.ClientSession:
            session = self._sessions.get(sandbox_id)
            if session is None or session.closed:
                session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self._idle_timeout,
                                                   ssl=self.node_ssl if self.node_ssl is not None else True),
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout),
                    auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                    skip_auto_headers=_NO_AUTO_HEADERS, trust_env=False, requote_redirect_url=False)
                self._sessions[sandbox_id] = session
            return session

    return NodeHopProxy


async def run_gateway(settings: Settings) -> None:
    from aiohttp import web

    from agentenv.api.app import setup_api
    from agentenv.api.auth import ApiKeyAuth
    from agentenv.cluster._run import run_app, start_role
    from agentenv.proxy import LISTENER_OPTIONS
    from agentenv.server import _print_banner

    store = start_role(settings, "gateway")
    await store.open()
    from agentenv.cluster import tls

    client_ctx = tls.client_context(settings) if tls.enabled(settings) else None
    reloader = tls.Reloader(settings, client_ctx) if client_ctx is not None else None
    client = Client.for_settings(settings, ssl_context=client_ctx)
    orch = ClusterOrchestrator(settings, store, client)
    proxy = _node_hop_proxy_class()(orch, domain=settings.sandbox_domain(), port_override=orch.port_override)
    proxy.node_ssl = client_ctx
    orch.on_moved.append(proxy.close_sandbox_connections)
    auth = ApiKeyAuth(store)
    api_key = None
    if settings.bootstrap_api_key:
        await auth.ensure_key(settings.bootstrap_api_key, "bootstrap")
        api_key = settings.bootstrap_api_key

    import re

    from agentenv.api.app import CORS_HEADERS, _error_response
    from agentenv.cluster.view import FAN_OUT, ClusterEvents, EventTailer, fan_out_get

    node_reads = re.compile(r"^/(?:v2/)?sandboxes/([a-z0-9]+)/(?:metrics|logs)$")

    from agentenv.cluster.builds import BuildRouter

    builds = BuildRouter(orch, auth)  # template builds: to the node the scheduler picks, or that runs them
    events = ClusterEvents()
    tailer = EventTailer(orch, client, events)

    @web.middleware
    async def sandbox_traffic(request: web.Request, handler):
        if proxy.matches(request):
            if request.path == "/files" and request.query.get("signature"):
                await orch.load_running_routes()  # signed URLs name no sandbox: any running one may match
            return await proxy.handle(request)
        m = node_reads.match(request.path) if request.method == "GET" else None
        fan_out = request.method == "GET" and request.path in FAN_OUT
        template_route = builds.matches(request)
        if m is not None or fan_out or template_route:  # answered by nodes: metrics, logs, lineage, builds
            try:
                if template_route:
                    resp = await builds.handle(request)
                else:
                    await auth.authenticate(request.headers.get("X-API-KEY"))
                    resp = await (fan_out_get(orch, client, request) if fan_out
                                  else orch.forward_get(request, m.group(1)))
            except AgentEnvError as e:
                resp = _error_response(e.status, e.to_json())
                resp.headers.update(e.headers)
            resp.headers.update(CORS_HEADERS)
            return resp
        return await handler(request)

    app = web.Application(middlewares=[sandbox_traffic], client_max_size=16 * 1024 * 1024)
    ctx = setup_api(app, orch, auth, settings)
    ctx.observability = SimpleNamespace(events=events)  # the public /events handler over the merged log
    from agentenv.observability.roles import mount_role_metrics

    mount_role_metrics(app, settings, role="gateway", list_nodes=store.list_nodes)
    if settings.console:
        from agentenv.console import mount_console

        mount_console(app)
    from agentenv.cluster import gateway_dataplane

    try:
        listen, local_ca, data_plane = gateway_dataplane.listener(settings, orch, reloader)  # HAProxy, HTTPS
        if data_plane is not None:  # off HAProxy's fast path first, then the Python hop's connections
            orch.on_moved.insert(0, data_plane.forget)
            orch.on_route.append(data_plane.noted)
            events.listeners.append(data_plane.on_node_event)

        async def on_started() -> None:
            tailer.start()
            if reloader is not None:
                reloader.start()
            _print_banner(settings, api_key, local_ca)

        await run_app(app, settings.host, settings.port, grace_s=settings.shutdown_grace_s, on_started=on_started,
                      listen=listen, **LISTENER_OPTIONS)
    finally:
        if reloader is not None:
            await reloader.stop()
        await tailer.stop()
        await proxy.close()
        await client.close()
        await store.close()


__all__ = ["ClusterOrchestrator", "run_gateway", "rfc3339"]
