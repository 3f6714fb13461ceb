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

    if not settings.cluster_token:
        raise SystemExit(f"agentenv {role} needs AGENTENV_CLUSTER_TOKEN (shared by gateway, scheduler and nodes)")
    configure_role_logging(settings)
    return open_cluster_store(settings)


async def run_app(app: web.Application, host: str, port: int, *, on_started: Callable[[], Awaitable[None]] | None = None,
                  **runner_options) -> None:
    from agentenv.server import StartupError, wait_for_stop_signal

    runner = web.AppRunner(app, access_log=None, handle_signals=False, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        try:
            await site.start()
        except OSError as e:
            raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
        if on_started is not None:
            await on_started()
        await wait_for_stop_signal()
    finally:
        await site.stop()
        await runner.cleanup()
