"""Host-side calls into a sandbox's envd: readiness and /init.

Connections are always closed by the host side (we close the session) so that no TIME_WAIT
endpoint is left inside the sandbox, which would make a gVisor checkpoint fail.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from agentenv.constants import ENVD_PORT
from agentenv.errors import RuntimeFailure


async def wait_healthy(host_ip: str, *, timeout: float = 60.0, is_alive=None) -> float:
    """Poll GET /health until 204; returns seconds waited. `is_alive()` aborts early if the sandbox died."""
    start = time.monotonic()
    url = f"http://{host_ip}:{ENVD_PORT}/health"
    delay = 0.01
    last_err: str = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
        while True:
            try:
                async with http.get(url) as resp:
                    if resp.status in (200, 204):
                        return time.monotonic() - start
                    last_err = f"HTTP {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last_err = f"{type(e).__name__}: {e}"
            if time.monotonic() - start > timeout:
                raise RuntimeFailure(f"envd did not become healthy within {timeout:.0f}s ({last_err})")
            if is_alive is not None and delay >= 0.08 and not await is_alive():
                raise RuntimeFailure(f"sandbox exited before envd became healthy ({last_err})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)


async def init(host_ip: str, *, access_token: str | None, env_vars: dict[str, str], host_token: str,
               default_user: str, default_workdir: str, current_token: str | None = None,
               timeout: float = 10.0) -> None:
    """POST /init: hands envd its access token, global env vars and default user.

    A restored envd (fork child, snapshot) still holds the token of its checkpoint: `current_token`
    proves the right to replace it; the host token (given to envd at boot) does the same.
    """
    body = {
        "accessToken": access_token,
        "envVars": env_vars,
        "defaultUser": default_user,
        "defaultWorkdir": default_workdir,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    headers = {"X-Agentenv-Host-Token": host_token}
    if current_token:
        headers["X-Access-Token"] = current_token
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        async with http.post(f"http://{host_ip}:{ENVD_PORT}/init", json=body, headers=headers) as resp:
            if resp.status >= 300:
                text = (await resp.text())[:500]
                raise RuntimeFailure(f"envd /init failed: HTTP {resp.status}: {text}")


async def blocking_connections(host_ip: str, *, host_token: str, timeout: float = 5.0) -> list[dict]:
    """TCP endpoints inside the sandbox that would make a gVisor checkpoint fail (see envd/netstat.py)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        async with http.get(f"http://{host_ip}:{ENVD_PORT}/agentenv/connections",
                            headers={"X-Agentenv-Host-Token": host_token}) as resp:
            if resp.status != 200:
                raise RuntimeFailure(f"envd connection check failed: HTTP {resp.status}")
            return list((await resp.json()).get("connections", []))
