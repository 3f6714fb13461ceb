"""`agentenv mcp`: sandboxes as Model Context Protocol tools (official MCP Python SDK, `MCPServer`).

Transports: stdio (an MCP client starts `agentenv mcp` itself) and streamable HTTP
(`--transport http`, endpoint `/mcp`). The tools (`mcp_tools.py`) drive a running agentenv server
through its public API and envd with one API key, so an MCP client gets exactly what that key's
team may do. Over HTTP, `--token` (or AGENTENV_MCP_TOKEN) makes every request carry
`Authorization: Bearer <token>`; without it anyone who can reach the port holds the API key's
power, so the listener defaults to 127.0.0.1. The SDK and the tools are imported only when the
command runs (the rest of the CLI starts without them).
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

import click


def _bearer_guard(app: Any, token: str) -> Any:
    """ASGI wrapper: HTTP requests must carry `Authorization: Bearer <token>`."""
    expected = f"Bearer {token}".encode()

    async def guarded(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, expected):
                body = json.dumps({"code": 401, "message": "missing or wrong bearer token"}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return guarded


async def serve_http(server: Any, host: str, port: int, path: str, token: str | None) -> None:
    import uvicorn

    app = server.streamable_http_app(streamable_http_path=path, host=host)
    if token:
        app = _bearer_guard(app, token)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    await uvicorn.Server(config).serve()


@click.command("mcp")
@click.option("--transport", type=click.Choice(["stdio", "http"]), default="stdio", show_default=True,
              help="stdio (the MCP client starts this command) or streamable HTTP")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP listen address")
@click.option("--port", type=int, default=8765, show_default=True, help="HTTP listen port")
@click.option("--path", "http_path", default="/mcp", show_default=True, help="HTTP endpoint path")
@click.option("--token", default=None,
              help="HTTP: require `Authorization: Bearer TOKEN` (default $AGENTENV_MCP_TOKEN)")
@click.option("--api-url", default=None, help="agentenv server (default $E2B_API_URL, $AGENTENV_API_URL)")
@click.option("--api-key", default=None, help="API key (default $E2B_API_KEY, $AGENTENV_API_KEY)")
@click.option("--sandbox-url", default=None, help="envd traffic URL (default $E2B_SANDBOX_URL, the server URL)")
def mcp_command(transport: str, host: str, port: int, http_path: str, token: str | None, api_url: str | None,
                api_key: str | None, sandbox_url: str | None) -> None:
    """Serve sandboxes to MCP clients: create, run commands, read/write files, fork, snapshot, kill, list."""
    import anyio

    from agentenv.client import ApiError, resolve_endpoint
    from agentenv.mcp_tools import build_server

    try:
        endpoint = resolve_endpoint(api_url, api_key, sandbox_url)
    except ApiError as e:
        raise click.ClickException(e.message) from None
    server = build_server(endpoint)
    if transport == "stdio":
        anyio.run(server.run_stdio_async)
        return
    token = token or os.environ.get("AGENTENV_MCP_TOKEN") or None
    if host not in ("127.0.0.1", "localhost", "::1") and not token:
        click.echo("warning: HTTP on a non-loopback address without --token: anyone who reaches it can use "
                   "the API key", err=True)
    click.echo(f"agentenv MCP server on http://{host}:{port}{http_path}", err=True)
    try:
        anyio.run(serve_http, server, host, port, http_path, token)
    except KeyboardInterrupt:
        pass
