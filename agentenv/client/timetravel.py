"""Time travel from Python: checkpoint a running sandbox, roll it back, branch from any checkpoint.

A small client of agentenv's checkpoint routes (docs/time-travel.md) that sits beside the
unmodified E2B SDK and uses its connection settings: pass the SDK's `ConnectionConfig` (or a
sandbox, whose own config is used), or nothing to read `E2B_API_URL` / `E2B_API_KEY` as the SDK
does. `AsyncTimeTravel` for asyncio code, `TimeTravel` for the rest; same methods:

    tt = TimeTravel()
    ck = tt.checkpoint(sbx, name="step-3")          # the sandbox keeps running
    tt.rollback(sbx, ck.checkpoint_id)              # same id, tokens, URLs; old memory and files
    child = Sandbox.create(ck.checkpoint_id)        # branch: a checkpoint is a snapshot
    tt.tree(ck.checkpoint_id)                       # every checkpoint of that tree

It needs no more than the standard library (sync) and aiohttp (async), both already there.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from agentenv.client.api import ApiError, _error_of

__all__ = ["AsyncTimeTravel", "Checkpoint", "CheckpointTree", "TimeTravel", "ApiError"]

DEFAULT_TIMEOUT_S = 300.0  # a checkpoint of a large sandbox, or a rollback, may take a while


@dataclass(frozen=True)
class Checkpoint:
    checkpoint_id: str
    parent_id: str | None
    sandbox_id: str | None
    created_at: str
    size_bytes: int
    name: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    kind: str = "checkpoint"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Checkpoint":
        return cls(checkpoint_id=d["checkpointID"], parent_id=d.get("parentID"), sandbox_id=d.get("sandboxID"),
                   created_at=d.get("createdAt", ""), size_bytes=int(d.get("sizeBytes") or 0), name=d.get("name"),
                   metadata=dict(d.get("metadata") or {}), kind=d.get("kind") or "checkpoint")


@dataclass(frozen=True)
class CheckpointTree:
    root_id: str
    checkpoints: list[Checkpoint]

    def children(self, checkpoint_id: str | None) -> list[Checkpoint]:
        return [c for c in self.checkpoints if c.parent_id == checkpoint_id]

    def path_to(self, checkpoint_id: str) -> list[Checkpoint]:
        """The checkpoints from the root down to `checkpoint_id`."""
        by_id = {c.checkpoint_id: c for c in self.checkpoints}
        out: list[Checkpoint] = []
        cur = by_id.get(checkpoint_id)
        while cur is not None:
            out.append(cur)
            cur = by_id.get(cur.parent_id) if cur.parent_id else None
        return out[::-1]


def _config_of(config: Any, sandbox: Any = None) -> Any:
    if config is not None:
        return config
    own = getattr(sandbox, "connection_config", None)
    if own is not None:
        return own
    try:
        from e2b import ConnectionConfig  # the SDK's own environment handling
    except ImportError:
        return None
    return ConnectionConfig()


class _Base:
    def __init__(self, config: Any = None, *, api_url: str | None = None, api_key: str | None = None,
                 request_timeout: float | None = None) -> None:
        """`config`: an E2B `ConnectionConfig` (api_url, api_key, headers, request_timeout are used)."""
        self._config = config
        self._api_url, self._api_key, self._timeout = api_url, api_key, request_timeout

    def _endpoint(self, sandbox: Any = None) -> tuple[str, dict[str, str], float]:
        cfg = _config_of(self._config, sandbox)
        url = self._api_url or getattr(cfg, "api_url", None) or os.environ.get("E2B_API_URL")
        key = self._api_key or getattr(cfg, "api_key", None) or os.environ.get("E2B_API_KEY")
        if not url or not key:
            raise ApiError(0, "no API URL or key: pass an E2B ConnectionConfig or set E2B_API_URL and E2B_API_KEY")
        headers = {k: v for k, v in (getattr(cfg, "headers", None) or {}).items() if k.lower() != "user-agent"}
        headers.update({"X-API-KEY": key, "Content-Type": "application/json"})
        timeout = self._timeout or DEFAULT_TIMEOUT_S
        return url.rstrip("/"), headers, timeout

    @staticmethod
    def _sid(sandbox: Any) -> str:
        return sandbox if isinstance(sandbox, str) else sandbox.sandbox_id

    @staticmethod
    def _q(part: str) -> str:
        return urllib.parse.quote(part, safe="")


class AsyncTimeTravel(_Base):
    async def _call(self, method: str, path: str, body: Any = None, sandbox: Any = None) -> Any:
        import aiohttp

        url, headers, timeout = self._endpoint(sandbox)
        data = None if body is None else json.dumps(body)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            try:
                async with s.request(method, url + path, data=data, headers=headers) as r:
                    text = await r.text()
                    if r.status >= 400:
                        raise _error_of(r.status, text)
                    return json.loads(text) if text else None
            except aiohttp.ClientError as e:
                raise ApiError(0, f"cannot reach {url}: {e}") from e

    async def checkpoint(self, sandbox: Any, *, name: str | None = None,
                         metadata: dict[str, str] | None = None) -> Checkpoint:
        """Checkpoint a running sandbox (an id or an E2B Sandbox); it keeps running."""
        body = {k: v for k, v in (("name", name), ("metadata", metadata)) if v is not None}
        d = await self._call("POST", f"/sandboxes/{self._q(self._sid(sandbox))}/checkpoints", body, sandbox)
        return Checkpoint.from_json(d)

    async def rollback(self, sandbox: Any, checkpoint_id: str) -> None:
        """Replace the sandbox's memory, processes and files with the checkpoint's (same id and tokens)."""
        await self._call("POST", f"/sandboxes/{self._q(self._sid(sandbox))}/rollback",
                         {"checkpointID": checkpoint_id}, sandbox)

    async def checkpoints(self, sandbox: Any) -> list[Checkpoint]:
        d = await self._call("GET", f"/sandboxes/{self._q(self._sid(sandbox))}/checkpoints", None, sandbox)
        return [Checkpoint.from_json(x) for x in d]

    async def tree(self, checkpoint_id: str) -> CheckpointTree:
        d = await self._call("GET", f"/checkpoints/{self._q(checkpoint_id)}/tree")
        return CheckpointTree(d["rootID"], [Checkpoint.from_json(x) for x in d["checkpoints"]])

    async def delete(self, checkpoint_id: str) -> None:
        await self._call("DELETE", f"/snapshots/{self._q(checkpoint_id)}")


class TimeTravel(_Base):
    """The same as `AsyncTimeTravel`, blocking (standard library HTTP)."""

    def _call(self, method: str, path: str, body: Any = None, sandbox: Any = None) -> Any:
        url, headers, timeout = self._endpoint(sandbox)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the configured API URL
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise _error_of(e.code, e.read().decode(errors="replace")) from None
        except OSError as e:
            raise ApiError(0, f"cannot reach {url}: {e}") from e
        return json.loads(text) if text else None

    def checkpoint(self, sandbox: Any, *, name: str | None = None,
                   metadata: dict[str, str] | None = None) -> Checkpoint:
        body = {k: v for k, v in (("name", name), ("metadata", metadata)) if v is not None}
        return Checkpoint.from_json(self._call("POST", f"/sandboxes/{self._q(self._sid(sandbox))}/checkpoints",
                                               body, sandbox))

    def rollback(self, sandbox: Any, checkpoint_id: str) -> None:
        self._call("POST", f"/sandboxes/{self._q(self._sid(sandbox))}/rollback", {"checkpointID": checkpoint_id},
                   sandbox)

    def checkpoints(self, sandbox: Any) -> list[Checkpoint]:
        return [Checkpoint.from_json(x)
                for x in self._call("GET", f"/sandboxes/{self._q(self._sid(sandbox))}/checkpoints", None, sandbox)]

    def tree(self, checkpoint_id: str) -> CheckpointTree:
        d = self._call("GET", f"/checkpoints/{self._q(checkpoint_id)}/tree")
        return CheckpointTree(d["rootID"], [Checkpoint.from_json(x) for x in d["checkpoints"]])

    def delete(self, checkpoint_id: str) -> None:
        self._call("DELETE", f"/snapshots/{self._q(checkpoint_id)}")

