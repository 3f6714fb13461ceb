"""Choosing and wiring the data plane of `agentenv serve` (settings.data_plane; docs/proxy.md).

`plan` decides where the public listeners live: HAProxy's (with the Python server on a unix socket
behind it) or the Python server's own TCP listener (`data_plane = "python"`, or "auto" without a
`haproxy` binary). `attach` connects a started `DataPlane` to the orchestrator: lifecycle events
mark sandboxes for a route update, and a sandbox about to stop leaves the fast path first.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from agentenv.config import Settings
from agentenv.proxy import hostfiles
from agentenv.proxy.haproxy import DataPlane, HaproxyLayout, haproxy_binary, release_sock_dir, sock_dir_for
from agentenv.proxy.haproxy_conf import SANDBOX_BACKENDS, ClusterListener
from agentenv.proxy.tls import TlsFiles, prepare

log = logging.getLogger(__name__)


class DataPlaneError(Exception):
    """The configured data plane cannot run (a message for the operator)."""


@dataclass
class Plan:
    haproxy: str | None       # the binary, or None: the Python proxy serves traffic on its own listener
    reason: str
    tls: TlsFiles | None = None


def plan(settings: Settings) -> Plan:
    binary = haproxy_binary(settings.haproxy_path)
    if settings.data_plane == "python":
        chosen = Plan(None, "data_plane = python")
    elif binary is None:
        if settings.data_plane == "haproxy":
            raise DataPlaneError(f"data_plane = haproxy but {settings.haproxy_path!r} is not installed "
                                 "(apt-get install haproxy)")
        chosen = Plan(None, "haproxy is not installed: the Python proxy serves sandbox traffic")
    else:
        chosen = Plan(binary, f"haproxy ({binary})")
    if settings.https_bind:
        if chosen.haproxy is None:
            raise DataPlaneError(f"https_bind needs the haproxy data plane ({chosen.reason})")
        if not settings.domain:
            raise DataPlaneError("https_bind needs AGENTENV_DOMAIN (the certificate is for *.<domain>)")
        try:
            chosen.tls = prepare(settings.data_dir / "tls", settings.domain, settings.tls_cert, settings.tls_key)
        except (OSError, ValueError) as e:
            raise DataPlaneError(f"TLS: {e}") from e
    return chosen


def layout(settings: Settings) -> HaproxyLayout:
    return HaproxyLayout(settings.data_dir / "haproxy", sock_dir_for(settings.data_dir))


def gateway_layout(settings: Settings) -> HaproxyLayout:
    """A cluster gateway's: per port (replicas may share a data dir)."""
    return _gateway_layout(settings.data_dir / "gateway-haproxy" / str(settings.port))


def _gateway_layout(base: Path) -> HaproxyLayout:
    return HaproxyLayout(base, sock_dir_for(base))


class GatewayBusy(Exception):
    """Another gateway runs on this port with this data dir."""


def _try_lock(path: Path) -> int | None:
    """An open descriptor of `path` holding its exclusive lock, or None when someone else holds it.
    A holder unlinks the file before it lets go, so a lock taken on a file no longer at `path` is
    taken again on the new one."""
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _let_go(path: Path, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.close(fd)


async def hold_gateway(layout: HaproxyLayout) -> Callable[[], None]:
    """A gateway holds `<port>.lock` next to its HAProxy's dir for as long as it runs, so `agentenv gc`
    tells a running gateway's HAProxy from one a killed gateway left. Returns what lets go (and
    removes the file). `agentenv gc` holds a killed gateway's lock for a moment: waited for."""
    layout.dir.parent.mkdir(parents=True, exist_ok=True)
    lock = layout.dir.with_suffix(".lock")
    for _ in range(50):
        fd = _try_lock(lock)
        if fd is not None:
            return lambda: _let_go(lock, fd)
        await asyncio.sleep(0.1)
    raise GatewayBusy(f"another gateway runs on port {layout.dir.name} with the data dir "
                      f"{layout.dir.parent.parent} ({lock} is locked)")


async def stop_leftover_gateways(settings: Settings) -> list[str]:
    """`agentenv gc`: the HAProxy of each gateway of this data dir that was killed (no gateway holds
    its port's lock), its files and socket dir. A running gateway's are not touched. With
    `haproxy_external` the HAProxy is its own component's: only the gateway's side of the socket dir
    goes."""
    removed = []
    for lock in sorted((settings.data_dir / "gateway-haproxy").glob("*.lock")):
        fd = _try_lock(lock)
        if fd is None:
            continue  # that gateway runs
        try:
            lay = _gateway_layout(lock.with_suffix(""))
            pid = await _stop_left_at(settings, lay)
            if pid is not None:
                removed.append(f"port {lay.dir.name}: pid {pid}")
            if not settings.haproxy_external:  # an external HAProxy goes on running from them
                shutil.rmtree(lay.dir, ignore_errors=True)
        finally:
            _let_go(lock, fd)
    return removed


class OrchestratorRoutes:
    """`haproxy.RouteSource` over the orchestrator: running sandboxes and their slot addresses."""

    def __init__(self, orch: Any) -> None:
        self._orch = orch

    def running_routes(self) -> Any:
        return self._orch.running_routes()

    def route_for(self, sandbox_id: str) -> Any | None:
        rec = self._orch.peek(sandbox_id)
        slot = self._orch.host.slots.get(sandbox_id)
        if rec is None or slot is None or rec.state.value != "running":
            return None
        return SimpleNamespace(host_ip=slot.host_ip, traffic_access_token=rec.traffic_access_token)


class NodeRoutes(OrchestratorRoutes):
    """The routes of a cluster node: none while it is fenced (cut off from the cluster), so every
    request for its sandboxes reaches the Python server, which answers 503 `node_fenced`."""

    def __init__(self, orch: Any, fenced: Callable[[], bool]) -> None:
        super().__init__(orch)
        self._fenced = fenced

    def running_routes(self) -> Any:
        return [] if self._fenced() else super().running_routes()

    def route_for(self, sandbox_id: str) -> Any | None:
        return None if self._fenced() else super().route_for(sandbox_id)


def make(settings: Settings, chosen: Plan, orch: Any, *, source: Any = None,
         cluster: ClusterListener | None = None) -> DataPlane:
    """`source`: where routes come from (default: the orchestrator's running sandboxes);
    `cluster`: a cluster node's mutual-TLS listener on host:port."""
    assert chosen.haproxy is not None
    http_bind = f"{settings.host}:{settings.port}" if ":" not in settings.host else f"[{settings.host}]:{settings.port}"
    return DataPlane(chosen.haproxy, layout(settings), source or OrchestratorRoutes(orch), http_bind=http_bind,
                     https_bind=settings.https_bind, cert=chosen.tls.pem if chosen.tls else None,
                     threads=settings.haproxy_threads, cluster=cluster, external=settings.haproxy_external,
                     host_reads=hostfiles.applies(orch.host.runtimes.values(), settings.sandbox_bandwidth_mbit))


def attach(dp: DataPlane, orch: Any) -> None:
    """Route updates from the orchestrator's lifecycle events; leave the fast path before a stop."""

    def on_event(event: Any) -> None:
        ids = [getattr(event, "sandbox_id", None)]
        rec = getattr(event, "rec", None)
        if rec is not None:
            ids.append(rec.sandbox_id)
        ids += [c.sandbox_id for c in getattr(event, "children", ())]
        dp.routes.mark(*ids)

    async def leave_fast_path(sandbox_id: str) -> None:
        await dp.leave_fast_path(sandbox_id)

    async def reset_connections(sandbox_id: str) -> None:
        await reset_sandbox_connections(dp, orch, sandbox_id)

    orch.events.subscribe(on_event)
    # First HAProxy stops sending new requests (they reach the Python proxy, which waits), then the
    # Python proxy closes its connections, then HAProxy's are reset.
    orch.on_before_stop.insert(0, leave_fast_path)
    orch.on_before_stop.append(reset_connections)


async def reset_sandbox_connections(dp: DataPlane, orch: Any, sandbox_id: str) -> None:
    """Reset HAProxy's connections into one sandbox (its slot address), if it has a slot."""
    slot = orch.host.slots.get(sandbox_id)
    if slot is not None:
        await dp.reset_connections(slot.host_ip)


def app_socket(settings: Settings) -> Path:
    return layout(settings).app_socket


def metrics_hook(dp: DataPlane, metrics: Any) -> Callable[[], Awaitable[None]]:
    """Before a /metrics scrape: add what HAProxy's sandbox backends served since the last one to
    the proxy metrics (`agentenv_proxy_requests_total{port,code}`, `agentenv_proxy_bytes_total`),
    so they count fast-path traffic as they count the Python proxy's."""
    last: dict[str, dict[str, int]] = {}

    async def refresh() -> None:
        try:
            stats = await dp.backend_stats()
        except (OSError, asyncio.TimeoutError) as e:
            log.debug("haproxy statistics unavailable: %s", e)
            return
        for backend, cur in stats.items():
            prev = last.get(backend, {})
            kind = SANDBOX_BACKENDS[backend]
            for key, value in cur.items():
                delta = value - prev.get(key, 0)
                if delta < 0:  # HAProxy restarted: its counters began again
                    delta = value
                if delta <= 0:
                    continue
                if key.startswith("hrsp_"):
                    metrics.proxy_requests.labels(kind, key[5:]).inc(delta)
                else:
                    metrics.proxy_bytes.labels(kind, "in" if key == "bin" else "out").inc(delta)
            last[backend] = cur

    return refresh


async def stop_leftover(settings: Settings) -> list[str]:
    """`agentenv gc`: stop a HAProxy of this data dir left by a server that was killed (its pid).
    Not with `haproxy_external`: that HAProxy is its own component's, not a leftover; its socket dir
    goes only once nothing answers on its runtime API (the component stopped too)."""
    pid = await _stop_left_at(settings, layout(settings))
    return [str(pid)] if pid is not None else []


async def _stop_left_at(settings: Settings, lay: HaproxyLayout) -> int | None:
    """The HAProxy running `lay`'s configuration (its role is not running), stopped, and its socket
    dir removed; its pid, if there was one. With `haproxy_external` only the role's side of the
    socket dir goes (the component's HAProxy is not a leftover)."""
    if settings.haproxy_external:
        release_sock_dir(lay, ours=lay.app_socket, theirs=lay.admin_socket)
        return None
    dp = DataPlane(settings.haproxy_path, lay, OrchestratorRoutes(None), http_bind=None)
    pid = dp.pid()
    if pid is not None:
        await dp.stop_leftover()
    shutil.rmtree(lay.sock_dir, ignore_errors=True)
    return pid


class CertificateWatch:
    """Keeps the served certificate current while the server runs: `tls.prepare` again every
    `interval` seconds and on `poke()` (SIGHUP), and a PEM that changed is handed to `install`
    (HAProxy's runtime API for `serve`, the TLS context for a cluster gateway), without a reload or a
    restart: an operator's renewed certificate (e.g. certbot's), the local CA's leaf near expiry.
    A pair that does not match (a renewal caught half-way) is logged and tried again later; the
    served certificate stays as it was."""

    def __init__(self, settings: Settings, install: Callable[[], Awaitable[None]], pem: Path,
                 interval: float = 60.0, served_by: str = "haproxy") -> None:
        self._settings = settings
        self._install = install
        self._served_by = served_by
        self._pem = pem
        self._interval = interval
        self._poked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._served = pem.read_bytes() if pem.exists() else b""  # what HAProxy has

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tls-certificate-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def poke(self) -> None:
        self._poked.set()

    async def check(self) -> bool:
        """Re-read the certificate; whether HAProxy was given a new one."""
        s = self._settings
        try:
            await asyncio.to_thread(prepare, s.data_dir / "tls", s.domain or "", s.tls_cert, s.tls_key)
        except (OSError, ValueError) as e:
            log.warning("TLS certificate not reloaded: %s (%s keeps serving the previous one)", e, self._served_by)
            return False
        pem = self._pem.read_bytes()
        if pem == self._served:
            return False
        await self._install()
        self._served = pem
        log.info("TLS certificate reloaded into %s (%s)", self._served_by, s.tls_cert or self._pem)
        return True

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._poked.wait(), self._interval)
            except asyncio.TimeoutError:
                pass
            self._poked.clear()
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("TLS certificate reload failed")
