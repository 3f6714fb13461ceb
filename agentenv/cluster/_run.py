"""Run an aiohttp app until SIGINT/SIGTERM: the shared skeleton of the cluster roles' processes."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

log = logging.getLogger("agentenv.cluster")


def start_role(settings, role: str):
    """What every cluster role does first: insist on the shared token, configure its logs, and
    return the (not yet opened) cluster state store."""
    from agentenv.cluster.node import configure_role_logging, open_cluster_store

    from agentenv.cluster import tls

    try:
        tls.check(settings)
    except ValueError as e:
        raise SystemExit(f"agentenv {role}: {e}") from None
    if tls.enabled(settings):
        for name in ("node_url", "scheduler_url"):
            url = getattr(settings, name) or ""
            if url.startswith("http://"):
                raise SystemExit(f"agentenv {role}: with cluster TLS, {name} must be an https:// URL (got {url})")
    if not tls.enabled(settings) and not settings.cluster_token:
        raise SystemExit(f"agentenv {role} needs cluster TLS (AGENTENV_CLUSTER_CA_FILE, _CERT_FILE, _KEY_FILE; "
                         "`agentenv cluster ca init`) or AGENTENV_CLUSTER_TOKEN (shared by gateway, scheduler and "
                         "nodes)")
    configure_role_logging(settings)
    return open_cluster_store(settings)


Listen = Callable[[web.AppRunner], Awaitable[tuple[web.BaseSite, Callable[[], Awaitable[None]] | None]]]


async def run_app(app: web.Application, host: str, port: int, *, grace_s: float,
                  on_started: Callable[[], Awaitable[None]] | None = None, ssl_context=None,
                  listen: Listen | None = None, **runner_options) -> None:
    """`listen`: opens the app's listener(s) itself (a node's HAProxy data plane in front of a unix
    socket) and returns the site and what stops the rest; default: a TCP listener on host:port.
    `grace_s`: how long requests in flight (streams included) may go on once the listener closed
    (`Settings.shutdown_grace_s`)."""
    from agentenv.server import StartupError, StopSignal

    stop = StopSignal()  # before anything starts: a signal during startup still stops in order
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=grace_s,
                           **runner_options)
    await runner.setup()
    site: web.BaseSite | None = None
    stop_listener: Callable[[], Awaitable[None]] | None = None
    try:
        if listen is not None:
            site, stop_listener = await listen(runner)
        else:
            site = web.TCPSite(runner, host, port, reuse_address=True, ssl_context=ssl_context)
            try:
                await site.start()
            except OSError as e:
                raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
        if on_started is not None:
            await on_started()
        await stop.wait()
    finally:
        if stop_listener is not None:
            await stop_listener()
        if site is not None:
            await site.stop()
        await runner.cleanup()
