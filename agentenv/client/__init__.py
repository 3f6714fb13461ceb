"""A small asyncio client for an agentenv (E2B-compatible) server, for the CLI and the MCP server.

It speaks only the public protocols: the control API with an API key, and envd (Connect-RPC JSON
plus `/files`) through the server's traffic proxy (`E2b-Sandbox-Id` / `E2b-Sandbox-Port`
headers), exactly as the E2B SDKs do. It does not import the server.
"""

from agentenv.client.api import ApiClient, ApiError, Endpoint, resolve_endpoint
from agentenv.client.envd import EnvdClient, EnvdError, ProcessEnd, connect_envd, exit_status

__all__ = ["ApiClient", "ApiError", "Endpoint", "EnvdClient", "EnvdError", "ProcessEnd", "connect_envd", "exit_status",
           "resolve_endpoint"]
