"""A cluster gateway's data plane: HAProxy in front of `agentenv gateway` (docs/cluster.md,
"The gateway's data plane").

As on a single server and on a node (`proxy/haproxy.py`), a supervised HAProxy owns the gateway's
public listeners (the plain one, and HTTPS with HTTP/2 when `https_bind` is set) and the gateway's
Python server answers it on a unix socket. A request for a running sandbox whose node HAProxy knows
goes from HAProxy straight to that node's listener, unchanged, in the cluster's mutual TLS: the
gateway's certificate, the node's verified against the cluster CA and the node id
(`haproxy_conf.NodeHop`). The node's own HAProxy then routes it into the sandbox and checks a private
sandbox's token. Everything else reaches the gateway's Python server exactly as without HAProxy: the
control API, paused sandboxes (wake on traffic), unknown and lost ones, signed `/files` URLs without
a host, and the first requests for a sandbox the routes do not have yet (whose lookup then adds it).

Routes follow the nodes' lifecycle events, which the gateway tails anyway for its merged `/events`
(`view.EventTailer`): a sandbox created or resumed on a node is added, one paused, killed or failed
is removed. A sandbox this gateway pauses, kills or moves leaves the routes before the call goes to
its node, and one the Python hop has just resolved is added at once. Every `_RECONCILE_S` the
routes are compared with the shared store (the running sandboxes of live nodes), which repairs
anything an event did not say (a node that died, a tail that restarted). A route that is stale for
a moment is harmless: its node answers for a sandbox it no longer runs (wakes it, or the 502 the
SDKs expect), as the Python hop's two-second route cache did.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import shutil
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aiohttp import web
from yarl import URL

from agentenv.config import Settings
from agentenv.models import SandboxState
from agentenv.proxy import dataplane
from agentenv.proxy.haproxy import DataPlane, RuntimeApi, haproxy_binary
from agentenv.proxy.haproxy_conf import NodeHop

log = logging.getLogger("agentenv.cluster.gateway")

_RECONCILE_S = 10.0
_RUNNING = {"created", "resumed"}
_STOPPED = {"paused", "killed", "failed"}


class GatewayRoutes:
    """`haproxy.RouteSource` of a gateway: running sandbox id -> the id of the node that runs it."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}

    @staticmethod
    def _route(sandbox_id: str, node_id: str) -> Any:
        return SimpleNamespace(sandbox_id=sandbox_id, host_ip=node_id, traffic_access_token=None)

    def running_routes(self) -> list[Any]:
        return [self._route(sid, node) for sid, node in self.owner.items()]

    def route_for(self, sandbox_id: str) -> Any | None:
        node = self.owner.get(sandbox_id)
        return None if node is None else self._route(sandbox_id, node)


class NodeAddresses:
    """HAProxy's nodes map (node id -> "<ip>/<port>/<name>", `_address`), equal to the live nodes:
    changed through the runtime API, and its file rewritten, which a restarted HAProxy loads."""

    def __init__(self, api: RuntimeApi, path: Path) -> None:
        self._api = api
        self._path = path
        self.have: dict[str, str] = {}

    def write_file(self) -> None:
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text("".join(f"{k} {v}\n" for k, v in self.have.items()))
        tmp.replace(self._path)

    async def sync(self, want: dict[str, str]) -> None:
        cmds = [f"del map {self._path} {n}" for n in self.have if n not in want]
        cmds += [f"{'set' if n in self.have else 'add'} map {self._path} {n} {addr}"
                 for n, addr in want.items() if self.have.get(n) != addr]
        if not cmds:
            return
        self.have = dict(want)
        self.write_file()
        errors = [o.strip() for o in await self._api.run(cmds) if o.strip()]
        if errors:
            log.warning("haproxy runtime API (nodes map): %s", "; ".join(errors[:3]))


_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


async def _address(node_id: str, url: str) -> str | None:
    """The nodes map's value for a node: "<ip>/<port>/<name>" of its listener (a host name resolved
    now), or None if it cannot be. <name> is what its certificate must prove: the URL's host name
    (a certificate for a node reached by name carries that name), or for a node reached by IP
    address its node id (HAProxy never checks IP addresses; a certificate with no DNS name is
    checked on its CN, which `agentenv cluster cert` sets to the node id)."""
    u = URL(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    host = u.host or ""
    try:
        ip, name = str(ipaddress.ip_address(host)), node_id
    except ValueError:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("node %s: cannot resolve %s (%s): its sandboxes go through the Python hop", node_id, host, e)
            return None
        if not infos:
            return None
        ip, name = str(infos[0][4][0]), host
    if not _NAME.match(name):
        log.warning("node %s: %r cannot be checked by haproxy: its sandboxes go through the Python hop", node_id, name)
        return None
    return f"{ip}/{port}/{name}"


class GatewayDataPlane:
    """The gateway's supervised HAProxy, its routes and nodes maps, and the refresh that keeps them."""

    def __init__(self, settings: Settings, orch: Any, chosen: dataplane.Plan, reloader: Any = None) -> None:
        from agentenv.cluster import tls

        self._settings = settings
        self._orch = orch
        self._chosen = chosen
        self._reloader = reloader
        self.layout = dataplane.gateway_layout(settings)
        hop = NodeHop(None, None)
        if tls.enabled(settings):
            hop = NodeHop(self.layout.dir / "cluster.pem", Path(settings.cluster_ca_file))
        self._hop = hop
        self.routes = GatewayRoutes()
        host = settings.host if ":" not in settings.host else f"[{settings.host}]"
        self.dp = DataPlane(chosen.haproxy or "haproxy", self.layout, self.routes,
                            http_bind=f"{host}:{settings.port}", https_bind=settings.https_bind,
                            cert=chosen.tls.pem if chosen.tls else None, threads=settings.haproxy_threads,
                            hop=hop, external=settings.haproxy_external)
        self.nodes = NodeAddresses(self.dp.api, self.layout.nodes_map)
        self._task: asyncio.Task[None] | None = None
        self._watch: dataplane.CertificateWatch | None = None
        self._touched: set[str] = set()   # changed by an event or a call while the store was read
        self._reconcile_now = asyncio.Event()
        self._reconciled_at = 0.0
        self._release: Callable[[], None] | None = None  # the port's lock (dataplane.hold_gateway)

    # ------------------------------------------------------------------ routes

    def noted(self, sandbox_id: str, node_id: str) -> None:
        """The Python hop resolved a running sandbox: HAProxy carries its next requests."""
        if self.routes.owner.get(sandbox_id) != node_id:
            self.routes.owner[sandbox_id] = node_id
            self._touched.add(sandbox_id)
            self.dp.routes.mark(sandbox_id)
        if node_id not in self.nodes.have and time.monotonic() - self._reconciled_at > 1.0:
            self._reconcile_now.set()  # a node that joined since the last reconcile: learn its address

    def on_node_event(self, node_id: str, event: dict) -> None:
        """A node's lifecycle event (`view.ClusterEvents` listener): routes follow it at once."""
        sandbox_id, kind = event.get("sandboxID"), event.get("type")
        if not sandbox_id:
            return
        if kind in _RUNNING:
            self.noted(sandbox_id, node_id)
        elif kind in _STOPPED and self.routes.owner.get(sandbox_id) == node_id:
            del self.routes.owner[sandbox_id]
            self._touched.add(sandbox_id)
            self.dp.routes.mark(sandbox_id)

    async def forget(self, sandbox_id: str) -> None:
        """This gateway pauses, kills or moves the sandbox: off the fast path before its node hears of it."""
        if self.routes.owner.pop(sandbox_id, None) is not None:
            self._touched.add(sandbox_id)
            try:
                await self.dp.routes.sync({sandbox_id})
            except (OSError, asyncio.TimeoutError) as e:
                log.warning("could not take %s out of haproxy's routes: %s", sandbox_id, e)

    async def _want(self) -> tuple[dict[str, str], dict[str, str]]:
        """(sandbox -> node, node -> address) from the store: running sandboxes of live nodes."""
        nodes = {n.node_id: n for n in (await self._orch.nodes(max_age_s=1.0)).values()
                 if n.state != "dead"}
        addresses: dict[str, str] = {}
        for node_id, n in nodes.items():
            addr = await _address(node_id, n.url)
            if addr is not None:
                addresses[node_id] = addr
        owner = {rec.sandbox_id: rec.node_id
                 for rec in await self._orch.store.list_sandboxes(states=[SandboxState.RUNNING])
                 if rec.node_id in addresses}
        return owner, addresses

    async def refresh(self) -> None:
        """Reconcile with the store; what events and calls changed meanwhile stays as they said."""
        self._touched = set()
        self._reconciled_at = time.monotonic()
        owner, addresses = await self._want()
        await self.nodes.sync(addresses)
        for sid in self._touched:
            if sid in self.routes.owner:
                owner[sid] = self.routes.owner[sid]
            else:
                owner.pop(sid, None)
        self.routes.owner = owner
        await self.dp.routes.sync()

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._reconcile_now.wait(), _RECONCILE_S)
            except asyncio.TimeoutError:
                pass
            self._reconcile_now.clear()
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the store or HAProxy is away: the next round tries again
                log.warning("gateway routes not refreshed: %s", e)

    # ------------------------------------------------------------------ process

    async def start(self, runner: web.AppRunner) -> web.BaseSite:
        from agentenv.cluster import tls
        from agentenv.server import StartupError, on_signals, start_behind

        try:
            self._release = await dataplane.hold_gateway(self.layout)
        except dataplane.GatewayBusy as e:
            raise StartupError(str(e)) from None
        self.layout.dir.mkdir(parents=True, exist_ok=True)
        if self._hop.pem is not None:
            tls.write_pem(self._settings, self._hop.pem)
        try:
            owner, addresses = await self._want()
        except Exception as e:  # noqa: BLE001 - the store is away: start empty, the refresh fills it
            log.warning("gateway routes: the store did not answer at start (%s)", e)
            owner, addresses = {}, {}
        self.routes.owner = owner
        self.nodes.have = addresses
        self.nodes.write_file()
        site = await start_behind(self._settings, self.dp, runner)
        self._task = asyncio.create_task(self._run(), name="gateway-routes")
        if self._chosen.tls is not None:
            self._watch = dataplane.CertificateWatch(self._settings, self.dp.install_certificate, self._chosen.tls.pem)
            self._watch.start()
            on_signals((signal.SIGHUP,), self._watch.poke, ": reloading the TLS certificate")
        if self._reloader is not None and self._hop.pem is not None:
            async def new_certificate() -> None:  # the gateway's own, presented to the nodes
                tls.write_pem(self._settings, self._hop.pem)
                await self.dp.install_certificate(self._hop.pem)
                log.info("cluster certificate reloaded into haproxy (the hop to the nodes)")

            self._reloader.on_reload.append(new_certificate)
        return site

    async def stop(self) -> None:
        """HAProxy first (it owns the listeners), then the rest: a refresh cut off in the middle of a
        store query must not keep the gateway from stopping (bounded wait)."""
        await self.dp.stop()
        if not self.dp.external:  # an external HAProxy goes on running from them
            shutil.rmtree(self.layout.dir, ignore_errors=True)  # config, maps and a copy of the key
        if self._release is not None:
            self._release()
            self._release = None
        if self._watch is not None:
            await self._watch.stop()
        if self._task is not None:
            self._task.cancel()
            _, pending = await asyncio.wait({self._task}, timeout=5)
            if pending:
                log.warning("gateway routes: the refresh did not stop within 5 s")


def listener(settings: Settings, orch: Any, reloader: Any = None):
    """The gateway's `listen` hook for `cluster._run.run_app` and the local CA clients must trust:
    HAProxy (`data_plane` auto with haproxy installed, or haproxy), else the Python listeners
    (`gateway_https`). Returns (listen, local CA or None, the data plane or None)."""
    from agentenv.cluster import gateway_https
    from agentenv.server import StartupError

    binary = haproxy_binary(settings.haproxy_path)
    if settings.data_plane == "python" or (binary is None and settings.data_plane == "auto"):
        log.info("data plane: the gateway's Python proxy (%s)", "data_plane = python" if binary else
                 "haproxy is not installed")
        listen, ca = gateway_https.listener(settings)
        return listen, ca, None
    try:
        chosen = dataplane.plan(settings)
    except dataplane.DataPlaneError as e:
        raise StartupError(str(e)) from None
    log.info("data plane: %s", chosen.reason)
    gdp = GatewayDataPlane(settings, orch, chosen, reloader)

    async def listen(runner: web.AppRunner):
        site = await gdp.start(runner)
        return site, gdp.stop

    return listen, chosen.tls.ca if chosen.tls else None, gdp


__all__ = ["GatewayDataPlane", "GatewayRoutes", "listener"]
