"""Run an aiohttp app until SIGINT/SIGTERM: the shared skeleton of the cluster roles' processes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

log = logging.getLogger("agentenv.cluster")


async def run_app(app: web.Application, host: str, port: int, *, on_started: Callable[[], Awaitable[None]] | None = None,
                  **runner_options) -> None:
    from agentenv.server import StartupError

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
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        pid = os.getpid()

        # Not loop.add_signal_handler: forked helpers (pyroute2 netns workers) would inherit its fd.
        def on_signal(signum, _frame) -> None:
            if os.getpid() == pid:
                log.info("received %s", signal.Signals(signum).name)
                loop.call_soon_threadsafe(stop.set)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        await stop.wait()
    finally:
        await site.stop()
        await runner.cleanup()
