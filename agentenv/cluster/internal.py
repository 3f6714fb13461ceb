"""The internal HTTP calls between cluster roles: a shared token, and a small RPC client.

Nodes expose their orchestrator's operations at `POST /internal/rpc/<method>` (JSON keyword
arguments in, an encoded result out); the scheduler exposes `POST /internal/place`. Every internal
call carries `X-Agentenv-Cluster-Token`; without the right one the answer is 401. These routes are
not part of the public (E2B) API and are documented in docs/cluster.md.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

import aiohttp
from aiohttp import web

from agentenv.cluster import codec
from agentenv.errors import AgentEnvError, Unavailable

log = logging.getLogger("agentenv.cluster")

TOKEN_HEADER = "X-Agentenv-Cluster-Token"


def require_token(token: str | None):
    """Middleware: every /internal/ route needs the cluster token."""

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith("/internal/"):
            given = request.headers.get(TOKEN_HEADER, "")
            if not token or not hmac.compare_digest(given.encode(), token.encode()):
                return web.json_response({"code": 401, "message": "missing or wrong cluster token"}, status=401)
        return await handler(request)

    return check


def cluster_auth(settings, is_sandbox_traffic=None):
    """The check of an internal listener: the client certificate with cluster TLS (every route but
    /health, sandbox traffic included), else the shared token (the /internal/ routes)."""
    from agentenv.cluster import tls

    return (tls.require_peer(is_sandbox_traffic) if tls.enabled(settings)
            else require_token(settings.cluster_token))


def error_response(e: AgentEnvError) -> web.Response:
    return web.json_response({"code": e.status, "message": e.message, "error_code": e.error_code},
                             status=e.status, headers=e.headers)


class Client:
    """Calls other roles' internal routes over one pooled aiohttp session."""

    def __init__(self, token: str | None, *, timeout: float = 600.0, ssl_context=None) -> None:
        self.token = token or ""
        self.ssl_context = ssl_context  # cluster TLS: our client certificate, the cluster CA
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=5)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def for_settings(cls, settings, *, timeout: float = 600.0, ssl_context=None) -> "Client":
        """With cluster TLS: no token, the role's certificate (`ssl_context`, or a new one)."""
        from agentenv.cluster import tls

        if tls.enabled(settings):
            return cls(None, timeout=timeout, ssl_context=ssl_context or tls.client_context(settings))
        return cls(settings.cluster_token, timeout=timeout)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, trust_env=False,
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30,
                                               ssl=self.ssl_context if self.ssl_context is not None else True))
        return self._session

    @property
    def headers(self) -> dict[str, str]:
        return {TOKEN_HEADER: self.token} if self.token else {}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def post(self, url: str, body: dict[str, Any], *, what: str, timeout: float | None = None) -> Any:
        """POST JSON; a typed error answer is raised as that AgentEnvError, an unreachable peer as 503.
        `timeout`: this call's bound instead of the client's (a best-effort call to a peer that may be
        cut off must not wait for the default)."""
        kw = {"timeout": aiohttp.ClientTimeout(total=timeout, sock_connect=min(5, timeout))} if timeout else {}
        try:
            async with self.session.post(url, json=body, headers=self.headers, **kw) as resp:
                data = await resp.json(content_type=None) if resp.content_length != 0 else None
                if resp.status >= 400:
                    raise codec.error_from(data if isinstance(data, dict) else {"message": str(data)},
                                           resp.status, {k: v for k, v in resp.headers.items()
                                                         if k in ("Retry-After", "Should-Retry")})
                return codec.decode(data)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise Unavailable(f"{what} is unreachable: {e or type(e).__name__}", error_code="node_unreachable",
                              headers={"Retry-After": "2"}) from e

    async def rpc(self, node_url: str, method: str, *, timeout_s: float | None = None, **kwargs: Any) -> Any:
        return await self.post(f"{node_url.rstrip('/')}/internal/rpc/{method}", codec.encode(kwargs),
                               what=f"node {node_url}", timeout=timeout_s)
