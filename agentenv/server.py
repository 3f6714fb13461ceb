"""The single-node server: wires the seams together and serves one HTTP listener.

One listener carries both planes, as the E2B SDKs expect when E2B_API_URL and E2B_SANDBOX_URL
point at the same address: requests addressed to a sandbox (E2b-Sandbox-Id header, a
`<port>-<id>.<domain>` host, a `/proxy/<id>/<port>/` path, or a signed /files URL) go to the traffic
proxy; everything else is the control API.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentenv.config import Settings

if TYPE_CHECKING:  # imported lazily at run time: `agentenv doctor` and friends stay light
    from agentenv.api.auth import ApiKeyAuth
    from agentenv.orchestrator.service import Orchestrator
    from agentenv.proxy.traffic import TrafficProxy
    from agentenv.state.base import StateStore
    from agentenv.storage.images import ImageStore

log = logging.getLogger("agentenv.server")


async def build_runtimes(settings: Settings) -> dict:
    """The runtimes this server serves, the default (`settings.runtime`) first, then
    `settings.extra_runtimes`; resolved by agentenv.runtimes.select.

    `auto` picks the strongest isolation the host proves it can run; an explicit choice that cannot
    run is a startup error (never a silent fallback).
    """
    from agentenv.runtimes import select

    try:
        sel = await select.choose(settings)
        log.info("runtime: %s (asked: %s) - %s", sel.runtime, sel.requested, sel.reason)
        names = [sel.runtime]
        for extra in filter(None, settings.extra_runtimes.split(",")):
            if extra not in names:
                names.append((await select.choose(settings, extra)).runtime)
                log.info("also serving runtime %s (AGENTENV_EXTRA_RUNTIMES)", extra)
    except select.RuntimeUnavailable as e:
        raise StartupError(e.message) from None
    return {name: select.build(settings, name) for name in names}


@dataclass
class Components:
    settings: Settings
    store: StateStore
    auth: ApiKeyAuth
    images: ImageStore
    orchestrator: Orchestrator
    proxy: TrafficProxy
    observability: Any = None  # agentenv.observability.Observability
    data_plane: Any = None  # agentenv.proxy.haproxy.DataPlane when HAProxy serves sandbox traffic


async def build(settings: Settings, *, store=None, publish_paused: bool = False) -> Components:
    """Wire one node. `store` (cluster nodes): a node-scoped view of the shared state store."""
    from agentenv.api.auth import ApiKeyAuth
    from agentenv.network.manager import NetworkManager
    from agentenv.orchestrator.service import Orchestrator
    from agentenv.proxy import hostfiles
    from agentenv.proxy.traffic import TrafficProxy
    from agentenv.state import store_for
    from agentenv.storage.artifacts import ArtifactCache
    from agentenv.storage.images import ImageStore
    from agentenv.storage.rootfs import RootfsManager
    from agentenv.storage.snapshots import S3SnapshotStore, store_from_settings

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    runtimes = await build_runtimes(settings)   # first: a runtime that cannot run is a clean startup error
    if store is None:
        store = store_for(settings)
    await store.open()
    auth = ApiKeyAuth(store)
    images = ImageStore(settings)
    snapshot_store = store_from_settings(settings)
    if isinstance(snapshot_store, S3SnapshotStore):
        await snapshot_store.ensure_bucket()
    default_runtime, *extra_runtimes = runtimes.values()
    orch = Orchestrator(settings, store, images, RootfsManager(settings.paths, settings.disk_quota), NetworkManager(settings, spare_slots=settings.network_spare_slots),
                        default_runtime, ArtifactCache(settings.data_dir, snapshot_store),
                        extra_runtimes=extra_runtimes, publish_paused=publish_paused)
    host_files = (hostfiles.HostFiles(orch.host.shared_rootfs, orch.host.host_token)
                  if hostfiles.applies(orch.host.runtimes.values(), settings.sandbox_bandwidth_mbit) else None)
    proxy = TrafficProxy(orch, domain=settings.sandbox_domain(), host_files=host_files)
    orch.on_before_stop.append(proxy.close_sandbox_connections)
    from agentenv.observability import Observability

    obs = Observability(settings, orch).attach(proxy=proxy, snapshot_store=orch.artifacts.store)
    return Components(settings, store, auth, images, orch, proxy, obs)


def make_app(c: Components) -> web.Application:
    from agentenv.api.app import setup_api

    @web.middleware
    async def sandbox_traffic(request: web.Request, handler):
        if c.proxy.matches(request):
            return await c.proxy.handle(request)
        return await handler(request)

    # client_max_size bounds JSON bodies of the control API; proxied bodies are streamed.
    app = web.Application(middlewares=[sandbox_traffic], client_max_size=16 * 1024 * 1024)
    if c.observability is not None:
        from agentenv.observability import http_metrics_middleware

        app.middlewares.append(http_metrics_middleware(c.observability))
    api = setup_api(app, c.orchestrator, c.auth, c.settings)
    if c.observability is not None:
        from agentenv.observability.api import mount_observability

        mount_observability(app, c.observability, api)
    return app


def _print_banner(settings: Settings, api_key: str | None, ca: Path | None = None) -> None:
    url = settings.api_url()
    lines = ["", "agentenv is serving. Point the E2B SDKs at it:", "",
             f"E2B_API_URL={url}", f"E2B_SANDBOX_URL={url}"]
    key = f"E2B_API_KEY={api_key}" if api_key else "E2B_API_KEY=<create one with: agentenv keys create>"
    lines.append(key)
    if settings.https_bind and settings.domain:
        lines += ["", "or, over HTTPS by name (wildcard DNS *.{0} -> this host):".format(settings.domain), "",
                  f"E2B_DOMAIN={settings.domain}", key]
        if ca is not None:
            lines += [f"# the local CA to trust: {ca}",
                      f"SSL_CERT_FILE={ca}  NODE_EXTRA_CA_CERTS={ca}  (curl --cacert {ca})"]
    lines.append("")
    print("\n".join(lines), flush=True)


def plan_data_plane(settings: Settings):
    from agentenv.proxy import dataplane

    try:
        return dataplane.plan(settings)
    except dataplane.DataPlaneError as e:
        raise StartupError(str(e)) from None


async def start_haproxy(settings: Settings, chosen, c: Components, runner: web.AppRunner, *,
                         source=None, cluster=None):
    """HAProxy owns the public listeners; the Python server answers it on a unix socket.
    `source`, `cluster`: a cluster node's routes and listener (`dataplane.make`)."""
    from agentenv.proxy import dataplane

    dp = dataplane.make(settings, chosen, c.orchestrator, source=source, cluster=cluster)
    dataplane.attach(dp, c.orchestrator)
    site = await start_behind(settings, dp, runner)
    c.data_plane = dp
    if c.observability is not None:
        c.observability.scrape_hooks.append(dataplane.metrics_hook(dp, c.observability.metrics))
    return site, dp


async def start_behind(settings: Settings, dp, runner: web.AppRunner) -> web.UnixSite:
    """The server's unix socket, then the HAProxy in front of it (`serve`, a node, a gateway);
    a HAProxy that does not start is a StartupError, with nothing left running."""
    from agentenv.errors import AgentEnvError

    sock = dp.layout.app_socket
    sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock.unlink(missing_ok=True)
    site = web.UnixSite(runner, str(sock))
    await site.start()
    try:
        await dp.start()
    except (AgentEnvError, OSError) as e:
        await dp.stop()
        await site.stop()
        where = f"{settings.host}:{settings.port}" + (f" / {settings.https_bind}" if settings.https_bind else "")
        raise StartupError(f"cannot listen on {where}: the data plane (haproxy) did not start: {e} "
                           "(a port in use? set AGENTENV_PORT / --port; AGENTENV_DATA_PLANE=python serves "
                           "without haproxy)") from e
    return site


class StartupError(Exception):
    """The server could not start (port in use, ...): a message for the user, no traceback."""


async def _bootstrap_key(c: Components, settings: Settings) -> str | None:
    """The key to print: the configured bootstrap key, or one created on the very first start."""
    if settings.bootstrap_api_key:
        await c.auth.ensure_key(settings.bootstrap_api_key, "bootstrap")
        return settings.bootstrap_api_key
    key_file = settings.data_dir / "api-key"
    if not await c.auth.list_keys():
        api_key, _ = await c.auth.create_key("default")
        key_file.write_text(api_key + "\n")
        os.chmod(key_file, 0o600)
        return api_key
    return key_file.read_text().strip() if key_file.exists() else None


def on_signals(signals: tuple[signal.Signals, ...], callback: Callable[[], None], why: str = "") -> None:
    """Run `callback` in the running loop when one of `signals` reaches this process.

    Not loop.add_signal_handler: it routes signals through a wakeup fd that forked helpers
    (pyroute2's netns workers) inherit, so a SIGTERM sent to such a child would stop the server;
    the pid check ignores signals a forked child received.
    """
    loop = asyncio.get_running_loop()
    server_pid = os.getpid()

    def on_signal(signum, _frame) -> None:
        if os.getpid() == server_pid:
            log.info("received %s%s", signal.Signals(signum).name, why)
            loop.call_soon_threadsafe(callback)

    for sig in signals:
        signal.signal(sig, on_signal)


class StopRequested(Exception):
    """SIGINT/SIGTERM arrived while a role was still starting a step that can be abandoned."""


class StopSignal:
    """SIGINT/SIGTERM as an event. Made before a role starts anything: a signal that arrives during
    its startup then ends it in order (the role's own cleanup runs), where the default action would
    kill the process half-started and leave its sandboxes, mounts and helpers behind."""

    def __init__(self) -> None:
        from agentenv.observability import taskdump

        self.event = asyncio.Event()
        on_signals((signal.SIGINT, signal.SIGTERM), self.event.set)
        loop = asyncio.get_running_loop()  # SIGUSR1: what every task waits on, in the log
        on_signals((signal.SIGUSR1,), lambda: taskdump.dump_tasks(loop))

    async def wait(self) -> None:
        await self.event.wait()

    async def unless_stopped(self, aw: Awaitable[Any]) -> Any:
        """Await `aw`, abandoning it (cancelled) with StopRequested if a stop signal comes first."""
        if self.event.is_set():
            raise StopRequested
        work = asyncio.ensure_future(aw)
        stopped = asyncio.create_task(self.event.wait())
        try:
            await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise StopRequested
        return work.result()


async def serve(settings: Settings, *, progress=None) -> None:
    from agentenv.proxy import LISTENER_OPTIONS
    from agentenv.runtimes._reaper import become_subreaper, reap_forever

    from agentenv.observability.logs import configure_logging

    configure_logging(logging.getLevelName(logging.getLogger().level), settings.log_format)
    stop = StopSignal()
    become_subreaper()
    reaper = asyncio.create_task(reap_forever(), name="orphan-reaper")
    c = await build(settings)
    runner: web.AppRunner | None = None
    site: web.BaseSite | None = None
    data_plane = None
    cert_watch = None
    started = False
    store_gc = None
    try:
        # Images first: the first create must not pay for a debootstrap.
        # A stop signal abandons them (a first start may debootstrap for minutes); what follows is
        # short and always finishes, so the cleanup below knows what it has to stop.
        await stop.unless_stopped(c.images.ensure_base(progress))
        await stop.unless_stopped(c.images.ensure_tools(progress))
        api_key = await _bootstrap_key(c, settings)
        chosen = plan_data_plane(settings)
        await c.orchestrator.start()
        started = True
        store_gc = _store_collector(c)
        store_gc.start()
        if c.observability is not None:
            await c.observability.start()

        runner = web.AppRunner(make_app(c), access_log=None, handle_signals=False,
                               shutdown_timeout=settings.shutdown_grace_s, **LISTENER_OPTIONS)
        await runner.setup()
        if chosen.haproxy is not None:
            site, data_plane = await start_haproxy(settings, chosen, c, runner)
        else:
            site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
            try:
                await site.start()
            except OSError as e:
                site = None
                raise StartupError(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e} "
                                   "(set AGENTENV_PORT / --port to another port)") from e
        if data_plane is not None and chosen.tls is not None:
            from agentenv.proxy.dataplane import CertificateWatch

            cert_watch = CertificateWatch(settings, data_plane.install_certificate, chosen.tls.pem)
            cert_watch.start()
            on_signals((signal.SIGHUP,), cert_watch.poke, ": reloading the TLS certificate")
        log.info("data plane: %s", chosen.reason)
        _print_banner(settings, api_key, chosen.tls.ca if chosen.tls else None)

        await stop.wait()
    except StopRequested:
        log.info("stopped while starting")
    finally:
        # Runs on every exit, including a failed start: an unclosed store would keep its worker
        # thread alive and the process would never exit.
        log.info("shutting down")
        if cert_watch is not None:
            await cert_watch.stop()
        if data_plane is not None:
            await data_plane.stop()
        if site is not None:
            await site.stop()
        if store_gc is not None:
            await store_gc.stop()
        if started:
            await c.orchestrator.stop()
        if c.observability is not None:
            await c.observability.stop()
        await c.proxy.close()
        if runner is not None:
            await runner.cleanup()
        await c.store.close()
        reaper.cancel()


def _store_collector(c: Components):
    """The snapshot store's periodic GC on a single server: the state store's rows, the store's
    manifests and what this server holds in memory (warm images, pool, restores) are its roots."""
    from agentenv.storage.storegc import StoreCollector, state_roots

    orch = c.orchestrator
    store = orch.artifacts.store

    async def roots():
        r = await state_roots(c.store, store)
        r.merge(await orch.artifacts_in_use(), "this server's sandboxes, warm images and pool")
        return r

    return StoreCollector(store, roots, interval_s=c.settings.store_gc_interval_s,
                          grace_s=c.settings.store_gc_grace_s, after=orch.gc_artifacts)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Third-party chatter (netlink message dumps, SQL threads) stays out of our debug logs.
    for noisy in ("pyroute2", "aiosqlite", "asyncio", "botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger().level))
