"""envd HTTP server: routes, access-token middleware, /health /init /envs /metrics, and the runner.

The app also runs the sudo-over-envd Unix socket service (`agentenv.envd.sudo`) on the same loop: at
$AGENTENV_ENVD_SUDO_SOCKET if set (empty disables it), else /run/agentenv/sudo.sock when envd is PID 1.

Checkpoint safety (gVisor): `runsc checkpoint` is refused while any non-listening TCP endpoint exists in
the sandbox, including TIME_WAIT, which only the side that closes first enters. envd therefore never
closes a connection first: the idle keep-alive timeout is effectively infinite, unread request bodies are
drained (long lingering time) instead of cutting the connection, no handler asks for `Connection: close`,
and SO_LINGER is left alone. Connections close only when the client closes them (or sends
`Connection: close` / a malformed request, which the host side must avoid before a checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

from aiohttp import web

from agentenv.envd import clock, filesystem, files, netstat, process
from agentenv.envd.oom import OomGuard
from agentenv.envd.reaper import OrphanReaper
from agentenv.envd.sudo import SudoServer, server_socket_path
from agentenv.envd.state import STATE_KEY, UNAUTHORIZED_MESSAGE, EnvdState, get_state

log = logging.getLogger("agentenv.envd")

# Effectively "never": envd must not be the side that closes an idle connection (see module docstring).
KEEPALIVE_TIMEOUT = 10.0**9
LINGERING_TIME = 3600.0
# /files checks a signature or the token itself; the last two check the host token
_OPEN_PATHS = {"/health", "/files", "/init", "/agentenv/connections", files.STAGED_PATH}

_CORS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, POST, PUT, DELETE, OPTIONS",
    "Access-Control-Allow-Headers": "*",
    "Access-Control-Expose-Headers": "*",
    "Access-Control-Max-Age": "7200",
}


def unauthorized() -> web.Response:
    return web.json_response({"code": 401, "message": UNAUTHORIZED_MESSAGE}, status=401)


@web.middleware
async def access_middleware(request: web.Request, handler) -> web.StreamResponse:
    if request.method == "OPTIONS":
        return web.Response(status=204, headers=_CORS)
    state = get_state(request)
    if request.path not in _OPEN_PATHS and not state.token_ok(request.headers.get("X-Access-Token")):
        return unauthorized()
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        # the router's own 404/405 (an unknown route or method): a JSON error like every other answer
        headers = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}
        message = f"{exc.reason}: {request.method} {request.path}"
        return web.json_response({"code": exc.status, "message": message}, status=exc.status, headers=headers)
    except Exception as exc:  # noqa: BLE001
        # aiohttp's own 500 page would also force-close the connection (see module docstring).
        log.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response({"code": 500, "message": str(exc) or type(exc).__name__}, status=500)


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.setdefault("Access-Control-Allow-Origin", "*")
    response.headers.setdefault("Access-Control-Expose-Headers", "*")


async def health(request: web.Request) -> web.Response:
    return web.Response(status=204)


async def connections(request: web.Request) -> web.Response:
    """Host-only: TCP endpoints that would block a checkpoint (see netstat.py)."""
    if not get_state(request).from_host(request):
        return unauthorized()
    peer = request.transport.get_extra_info("peername") if request.transport else None
    busy = netstat.blocking_endpoints(exclude_remote=(peer[0], peer[1]) if peer else None)
    return web.json_response({"connections": busy})


async def init(request: web.Request) -> web.Response:
    """(Re)configure token, env and defaults. Later calls need the current token or the host token."""
    state = get_state(request)
    if state.initialized and state.access_token:
        if not (
            state.token_ok(request.headers.get("X-Access-Token"))
            or state.from_host(request)
        ):
            return unauthorized()
    raw = await request.read()
    try:
        body = await request.json() if raw.strip() else {}
    except ValueError:
        return web.json_response({"code": 400, "message": "invalid JSON body"}, status=400)
    if not isinstance(body, dict):
        return web.json_response({"code": 400, "message": "body must be a JSON object"}, status=400)
    # agentenv's own field: how long the sandbox was away before this restore (`envd/lifetime.py`)
    away_ms = body.get("agentenvAwayMs")
    if away_ms is not None and (isinstance(away_ms, bool) or not isinstance(away_ms, (int, float)) or away_ms < 0):
        return web.json_response({"code": 400, "message": "agentenvAwayMs must be a number of milliseconds >= 0"},
                                 status=400)
    if "accessToken" in body:
        state.access_token = body["accessToken"] or None
    if "envVars" in body:
        env = body["envVars"] or {}
        if not isinstance(env, dict):
            return web.json_response({"code": 400, "message": "envVars must be an object"}, status=400)
        state.env_vars = {str(k): str(v) for k, v in env.items()}
    if body.get("defaultUser"):
        state.default_user = str(body["defaultUser"])
    if body.get("defaultWorkdir"):
        state.default_workdir = str(body["defaultWorkdir"])
    stamp = body.get("timestamp")
    host_time = clock.parse_timestamp(stamp)
    if host_time is not None:  # a restored microVM's clock lags by the time its image was stored
        clock.sync(host_time)
    if away_ms and (stamp is None or stamp != state.away_applied):
        # process timeouts count the time the sandbox ran, not the time it was away; the host resends
        # an /init whose answer it did not get (the same body, `timestamp` included): moved once
        request.app[process.MANAGER_KEY].lifetimes.shift(away_ms / 1000)
        state.away_applied = stamp
    state.initialized = True
    log.info("initialized (token=%s, %d env vars, user=%s)", bool(state.access_token), len(state.env_vars), state.default_user)
    return web.Response(status=204)


async def envs(request: web.Request) -> web.Response:
    return web.json_response(get_state(request).env_vars)


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    values = [int(v) for v in parts[:8]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values), idle


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    return out


async def metrics(request: web.Request) -> web.Response:
    total1, idle1 = _cpu_times()
    await asyncio.sleep(0.1)
    total2, idle2 = _cpu_times()
    dt = total2 - total1
    cpu_pct = round(100.0 * (dt - (idle2 - idle1)) / dt, 2) if dt > 0 else 0.0
    mem = _meminfo()
    mem_total = mem.get("MemTotal", 0)
    mem_used = mem_total - mem.get("MemAvailable", mem.get("MemFree", 0))
    disk = os.statvfs("/")
    disk_total = disk.f_blocks * disk.f_frsize
    disk_used = (disk.f_blocks - disk.f_bfree) * disk.f_frsize
    return web.json_response({
        "ts": int(time.time()),
        "cpu_count": os.cpu_count() or 1,
        "cpu_used_pct": cpu_pct,
        "mem_total": mem_total,
        "mem_used": mem_used,
        "mem_cache": mem.get("Cached", 0) + mem.get("Buffers", 0),
        "mem_total_mib": mem_total // (1024 * 1024),
        "mem_used_mib": mem_used // (1024 * 1024),
        "disk_used": disk_used,
        "disk_total": disk_total,
    })


SUDO_KEY: web.AppKey[SudoServer | None] = web.AppKey("envd_sudo")


class _ReaperView:
    """What the orphan reaper must not touch: processes of the manager and of the sudo service."""

    def __init__(self, manager: process.ProcessManager, sudo: SudoServer | None) -> None:
        self._manager = manager
        self._sudo = sudo

    @property
    def spawning(self) -> int:
        return self._manager.spawning + (self._sudo.spawning if self._sudo else 0)

    def managed_pids(self) -> set[int]:
        pids = self._manager.managed_pids()
        return pids | self._sudo.managed_pids() if self._sudo else pids


def create_app(state: EnvdState | None = None) -> web.Application:
    app = web.Application(middlewares=[access_middleware])
    app[STATE_KEY] = state or EnvdState.from_environ()
    manager = process.ProcessManager()
    app[process.MANAGER_KEY] = manager
    app.router.add_get("/health", health)
    app.router.add_post("/init", init)
    app.router.add_get("/agentenv/connections", connections)
    app.router.add_get("/envs", envs)
    app.router.add_get("/metrics", metrics)
    files.add_routes(app)
    process.add_routes(app)
    filesystem.add_routes(app)
    app.on_response_prepare.append(_cors_headers)
    sudo_path = server_socket_path()
    sudo = SudoServer(sudo_path) if sudo_path else None
    app[SUDO_KEY] = sudo
    reaper = OrphanReaper(_ReaperView(manager, sudo))
    oom = OomGuard.from_environ()

    async def on_startup(app: web.Application) -> None:
        reaper.start()
        if oom is not None:
            oom.start()
        if sudo is not None:
            try:
                sudo.start()
                log.info("sudo service listening on %s", sudo.path)
            except OSError as exc:  # envd keeps serving; `sudo` then reports it cannot connect
                log.warning("cannot start the sudo service on %s: %s", sudo.path, exc)

    async def on_cleanup(app: web.Application) -> None:
        reaper.stop()
        if oom is not None:
            oom.stop()
        if sudo is not None:
            await sudo.stop()
        await manager.shutdown()
        app[STATE_KEY].executor.shutdown()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def serve(host: str, port: int, state: EnvdState | None = None) -> None:
    """Run envd until SIGTERM/SIGINT."""
    app = create_app(state)
    runner = web.AppRunner(
        app,
        keepalive_timeout=KEEPALIVE_TIMEOUT,
        lingering_time=LINGERING_TIME,
        access_log=None,
        handle_signals=False,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    log.info("envd listening on %s:%d", host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
