"""The control API (REST, `X-API-KEY`): sandboxes, snapshots, logs, template builds."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

DEFAULT_API_URL = "http://127.0.0.1:3000"


@dataclass(frozen=True)
class Endpoint:
    """Where the server is and how to authenticate (API key) to it."""

    api_url: str
    api_key: str
    sandbox_url: str  # envd traffic; the server serves it on the API listener unless told otherwise


class ApiError(Exception):
    """The server answered an error (E2B's `{code, message}` body) or could not be reached (status 0)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.code = code


class ConfigError(ApiError):
    def __init__(self, message: str):
        super().__init__(0, message)


def resolve_endpoint(api_url: str | None = None, api_key: str | None = None,
                     sandbox_url: str | None = None) -> Endpoint:
    """Flags first, then E2B's environment variables (as the SDKs read them), then agentenv's."""
    url = (api_url or os.environ.get("E2B_API_URL") or os.environ.get("AGENTENV_API_URL")
           or DEFAULT_API_URL).rstrip("/")
    key = api_key or os.environ.get("E2B_API_KEY") or os.environ.get("AGENTENV_API_KEY")
    if not key:
        raise ConfigError("no API key: set E2B_API_KEY (or AGENTENV_API_KEY) or pass --api-key")
    sbx = (sandbox_url or os.environ.get("E2B_SANDBOX_URL") or url).rstrip("/")
    return Endpoint(api_url=url, api_key=key, sandbox_url=sbx)


def _error_of(status: int, text: str) -> ApiError:
    try:
        data = json.loads(text) if text else None
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("message"):
        code = data.get("code")
        return ApiError(status, str(data["message"]), code if isinstance(code, str) else None)
    return ApiError(status, text.strip()[:500] or "no body")


class ApiClient:
    """One aiohttp session to the control API; use as `async with ApiClient(endpoint) as api`."""

    def __init__(self, endpoint: Endpoint, *, timeout: float = 600.0):
        self.endpoint = endpoint
        self._timeout = timeout
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ApiClient:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=15))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("ApiClient used outside `async with`")
        return self._http

    async def call(self, method: str, path: str, body: Any = None, *, params: dict | None = None,
                   ok: tuple[int, ...] = ()) -> Any:
        """One JSON call; an error status raises ApiError (statuses in `ok` return None instead)."""
        url = self.endpoint.api_url + path
        try:
            async with self.http.request(method, url, json=body, params=params,
                                         headers={"X-API-KEY": self.endpoint.api_key},
                                         timeout=aiohttp.ClientTimeout(total=self._timeout)) as resp:
                text = await resp.text()
                if resp.status in ok:
                    return None
                if resp.status >= 300:
                    raise _error_of(resp.status, text)
                return json.loads(text) if text.strip() else None
        except aiohttp.ClientError as e:
            raise ApiError(0, f"cannot reach {self.endpoint.api_url}: {e}") from None
        except TimeoutError:
            raise ApiError(0, f"{method} {path}: no answer from {self.endpoint.api_url} "
                              f"within {self._timeout:.0f}s") from None

    # --- sandboxes ------------------------------------------------------------------------------

    async def list_sandboxes(self, state: str | None = None) -> list[dict]:
        params = {"state": state} if state else None
        return await self.call("GET", "/v2/sandboxes", params=params) or []

    async def create_sandbox(self, template: str, *, timeout: int | None = None,
                             metadata: dict[str, str] | None = None, env_vars: dict[str, str] | None = None,
                             auto_pause: bool = False, internet: bool | None = None) -> dict:
        body: dict[str, Any] = {"templateID": template}
        if timeout is not None:
            body["timeout"] = timeout
        if metadata:
            body["metadata"] = metadata
        if env_vars:
            body["envVars"] = env_vars
        if auto_pause:
            body["autoPause"] = True
        if internet is not None:
            body["allow_internet_access"] = internet
        return await self.call("POST", "/v2/sandboxes", body)

    async def get_sandbox(self, sandbox_id: str) -> dict:
        return await self.call("GET", f"/sandboxes/{sandbox_id}")

    async def connect(self, sandbox_id: str, timeout: int | None = None) -> dict:
        """Resume if paused; a running sandbox's end is only ever moved later (E2B's connect)."""
        return await self.call("POST", f"/v2/sandboxes/{sandbox_id}/connect",
                               {} if timeout is None else {"timeout": timeout})

    async def kill(self, sandbox_id: str) -> None:
        await self.call("DELETE", f"/sandboxes/{sandbox_id}")

    async def pause(self, sandbox_id: str) -> None:
        await self.call("POST", f"/sandboxes/{sandbox_id}/pause", {})

    async def fork(self, sandbox_id: str, count: int = 1, timeout: int | None = None) -> list[dict]:
        body: dict[str, Any] = {"count": count}
        if timeout is not None:
            body["timeout"] = timeout
        return await self.call("POST", f"/sandboxes/{sandbox_id}/fork", body) or []

    async def snapshot(self, sandbox_id: str, name: str | None = None, memory: bool = True) -> dict:
        body: dict[str, Any] = {"memory": memory}
        if name:
            body["name"] = name
        return await self.call("POST", f"/sandboxes/{sandbox_id}/snapshots", body)

    async def logs(self, sandbox_id: str, *, cursor: int | None = None, limit: int = 1000,
                   level: str | None = None, search: str | None = None) -> list[dict]:
        """GET /v2/sandboxes/{id}/logs, oldest first, from `cursor` (Unix ms, inclusive)."""
        params: dict[str, Any] = {"limit": limit, "direction": "forward"}
        if cursor is not None:
            params["cursor"] = cursor
        if level:
            params["level"] = level
        if search:
            params["search"] = search
        data = await self.call("GET", f"/v2/sandboxes/{sandbox_id}/logs", params=params) or {}
        return list(data.get("logs") or [])

    # --- template builds ------------------------------------------------------------------------

    async def request_build(self, name: str, *, cpu_count: int | None = None,
                            memory_mb: int | None = None) -> dict:
        body: dict[str, Any] = {"name": name}
        if cpu_count:
            body["cpuCount"] = cpu_count
        if memory_mb:
            body["memoryMB"] = memory_mb
        return await self.call("POST", "/v3/templates", body)

    async def upload_files(self, template_id: str, files_hash: str, chunks: AsyncIterator[bytes]) -> bool:
        """Upload a COPY step's tar unless the server has it already; True when it was uploaded."""
        info = await self.call("GET", f"/templates/{template_id}/files/{files_hash}") or {}
        if info.get("present"):
            return False
        url = info.get("url")
        if not url:
            raise ApiError(500, "the server gave no upload URL for the COPY files")
        try:
            async with self.http.put(url, data=chunks,
                                     headers={"Content-Type": "application/octet-stream"}) as resp:
                if resp.status >= 300:
                    raise _error_of(resp.status, await resp.text())
        except aiohttp.ClientError as e:
            raise ApiError(0, f"uploading the COPY files failed: {e}") from None
        return True

    async def start_build(self, template_id: str, build_id: str, spec: dict) -> None:
        await self.call("POST", f"/v2/templates/{template_id}/builds/{build_id}", spec)

    async def build_status(self, template_id: str, build_id: str, logs_offset: int = 0) -> dict:
        return await self.call("GET", f"/templates/{template_id}/builds/{build_id}/status",
                               params={"logsOffset": logs_offset, "limit": 100})
