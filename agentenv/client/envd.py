"""envd through the server's traffic proxy: processes (Connect-RPC, JSON codec) and `/files`.

Requests go to the sandbox URL (the API listener by default) with `E2b-Sandbox-Id` and
`E2b-Sandbox-Port: 49983`, plus the sandbox's `X-Access-Token`, as the E2B SDKs send them.
Streaming RPCs use Connect's envelope: 1 flag byte + 4-byte big-endian length + JSON; flag 0x02
marks the end-of-stream message (`{}` or `{"error": {...}}`).
"""

from __future__ import annotations

import base64
import json
import signal
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from agentenv.client.api import ApiClient, Endpoint

ENVD_PORT = 49983
_ENVELOPE = struct.Struct(">BI")
_END_STREAM = 0x02
KEEPALIVE_S = 30  # envd sends a keepalive after this much idle time on a stream (keeps proxies open)


class EnvdError(Exception):
    """envd (or the proxy in front of it) refused or failed a call."""

    def __init__(self, message: str, code: str | None = None, status: int = 0):
        super().__init__(message)
        self.message, self.code, self.status = message, code, status


@dataclass(frozen=True)
class ProcessEnd:
    """envd's EndEvent: `exited` false means a signal ended the process (exitCode is then -1)."""

    exit_code: int
    exited: bool
    status: str
    error: str | None = None

    @property
    def shell_code(self) -> int:
        """The code a shell would report: the exit code, or 128 + the signal's number."""
        return self.exit_code if self.exited else exit_status(self.status)


def exit_status(status: str) -> int:
    """128 + n for envd's `signal: <name>` status (Go's names: `killed`, `terminated`, ...)."""
    name = status.split(":", 1)[-1].strip().lower()
    for sig in signal.Signals:
        try:
            if (signal.strsignal(sig) or "").lower() == name:
                return 128 + int(sig)
        except ValueError:
            continue
    return 128 + int(signal.SIGKILL) if "kill" in name else 255


def _envelope(msg: dict) -> bytes:
    payload = json.dumps(msg).encode()
    return _ENVELOPE.pack(0, len(payload)) + payload


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _error_of(status: int, text: str) -> EnvdError:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("message"):
        code = data.get("code")
        return EnvdError(str(data["message"]), code if isinstance(code, str) else None, status)
    return EnvdError(f"HTTP {status}: {text.strip()[:300] or 'no body'}", None, status)


class ProcessStream:
    """A running `process.Process/Start` stream: `pid`, then `async for (stream, bytes)`, then `end`."""

    def __init__(self, client: EnvdClient, request: dict, headers: dict[str, str]):
        self._client, self._request, self._headers = client, request, headers
        self._resp: aiohttp.ClientResponse | None = None
        self._buf = bytearray()
        self.pid: int = 0
        self.end: ProcessEnd | None = None

    async def __aenter__(self) -> ProcessStream:
        url = f"{self._client.endpoint.sandbox_url}/process.Process/Start"
        try:
            self._resp = await self._client.http.post(url, data=_envelope(self._request), headers=self._headers,
                                                      timeout=aiohttp.ClientTimeout(total=None, sock_connect=15))
        except aiohttp.ClientError as e:
            raise EnvdError(f"cannot reach the sandbox at {self._client.endpoint.sandbox_url}: {e}") from None
        if self._resp.status != 200:
            text = await self._resp.text()
            self._resp.release()
            raise _error_of(self._resp.status, text)
        first = await self._next_event()
        if first is None or "start" not in first:
            raise EnvdError("envd did not report the process start")
        self.pid = int(first["start"].get("pid", 0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._resp is not None:
            self._resp.close()  # never kills the process (envd keeps it running)

    async def _message(self) -> tuple[int, dict] | None:
        assert self._resp is not None
        while True:
            if len(self._buf) >= 5:
                flags, length = _ENVELOPE.unpack_from(self._buf)
                if len(self._buf) >= 5 + length:
                    raw = bytes(self._buf[5:5 + length])
                    del self._buf[:5 + length]  # bytearray: dropping the front does not copy the rest
                    msg = json.loads(raw or b"{}")
                    return flags, msg if isinstance(msg, dict) else {}
            try:
                chunk = await self._resp.content.readany()
            except aiohttp.ClientError as e:
                raise EnvdError(f"the process stream broke: {e}") from None
            if not chunk:
                return None
            self._buf += chunk

    async def _next_event(self) -> dict | None:
        """The next non-keepalive event, or None when the stream ended; stream errors raise."""
        while True:
            got = await self._message()
            if got is None:
                return None
            flags, msg = got
            if flags & _END_STREAM:
                err = msg.get("error")
                if err:
                    raise EnvdError(str(err.get("message") or err), err.get("code"))
                return None
            event = msg.get("event") or {}
            if "keepalive" in event:
                continue
            return event

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        return self._output()

    async def _output(self) -> AsyncIterator[tuple[str, bytes]]:
        while True:
            event = await self._next_event()
            if event is None:
                raise EnvdError("the process stream ended without the process's exit status")
            if "data" in event:
                for stream in ("stdout", "stderr", "pty"):
                    if stream in event["data"]:
                        yield stream, base64.b64decode(event["data"][stream])
            elif "end" in event:
                e = event["end"]
                self.end = ProcessEnd(int(e.get("exitCode", 0)), bool(e.get("exited", True)),
                                      str(e.get("status", "")), e.get("error"))
                return


class EnvdClient:
    """envd of one sandbox; shares the caller's aiohttp session."""

    def __init__(self, http: aiohttp.ClientSession, endpoint: Endpoint, sandbox_id: str,
                 access_token: str | None, *, user: str | None = None):
        self.http, self.endpoint, self.sandbox_id = http, endpoint, sandbox_id
        self.access_token, self.user = access_token, user

    def headers(self, user: str | None = None) -> dict[str, str]:
        h = {"E2b-Sandbox-Id": self.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
        if self.access_token:
            h["X-Access-Token"] = self.access_token
        who = user or self.user
        if who:  # selects the OS user (E2B's convention), not authentication
            h["Authorization"] = "Basic " + _b64(f"{who}:".encode())
        return h

    async def unary(self, method: str, body: dict, *, timeout: float = 60.0) -> dict:
        url = f"{self.endpoint.sandbox_url}/{method}"
        headers = {**self.headers(), "Content-Type": "application/json", "Connect-Protocol-Version": "1"}
        try:
            async with self.http.post(url, data=json.dumps(body), headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise _error_of(resp.status, text)
                return json.loads(text) if text.strip() else {}
        except aiohttp.ClientError as e:
            raise EnvdError(f"{method}: {e}") from None

    def start(self, cmd: str, args: list[str], *, envs: dict[str, str] | None = None, cwd: str | None = None,
              stdin: bool = False, pty: tuple[int, int] | None = None, timeout_s: float | None = None,
              user: str | None = None) -> ProcessStream:
        """`async with client.start(...) as proc`: a process (pty = (cols, rows) for a terminal).

        `timeout_s` is envd's process lifetime (Connect-Timeout-Ms); None runs it until it ends.
        """
        process: dict[str, Any] = {"cmd": cmd, "args": args, "envs": dict(envs or {})}
        if cwd:
            process["cwd"] = cwd
        request: dict[str, Any] = {"process": process, "stdin": stdin}
        if pty is not None:
            request["pty"] = {"size": {"cols": pty[0], "rows": pty[1]}}
        headers = {**self.headers(user), "Content-Type": "application/connect+json",
                   "Connect-Protocol-Version": "1", "Keepalive-Ping-Interval": str(KEEPALIVE_S)}
        if timeout_s:
            headers["Connect-Timeout-Ms"] = str(int(timeout_s * 1000))
        return ProcessStream(self, request, headers)

    def shell(self, command: str, **kw: Any) -> ProcessStream:
        """A command line through bash as a login shell (what the SDKs' `commands.run` does)."""
        return self.start("/bin/bash", ["-l", "-c", command], **kw)

    async def send_input(self, pid: int, data: bytes, *, pty: bool = False) -> None:
        await self.unary("process.Process/SendInput",
                         {"process": {"pid": pid}, "input": {"pty" if pty else "stdin": _b64(data)}})

    async def close_stdin(self, pid: int) -> None:
        await self.unary("process.Process/CloseStdin", {"process": {"pid": pid}})

    async def resize(self, pid: int, cols: int, rows: int) -> None:
        await self.unary("process.Process/Update",
                         {"process": {"pid": pid}, "pty": {"size": {"cols": cols, "rows": rows}}})

    async def kill(self, pid: int) -> None:
        await self.unary("process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})

    # --- files ----------------------------------------------------------------------------------

    async def download(self, path: str, sink: Callable[[bytes], object]) -> int:
        """Stream a file's bytes to `sink`; returns the byte count."""
        params = {"path": path}
        if self.user:
            params["username"] = self.user
        n = 0
        try:
            async with self.http.get(f"{self.endpoint.sandbox_url}/files", params=params, headers=self.headers(),
                                     timeout=aiohttp.ClientTimeout(total=None, sock_connect=15,
                                                                   sock_read=300)) as resp:
                if resp.status != 200:
                    raise _error_of(resp.status, await resp.text())
                async for chunk in resp.content.iter_chunked(1 << 16):
                    sink(chunk)
                    n += len(chunk)
        except aiohttp.ClientError as e:
            raise EnvdError(f"download of {path} failed: {e}") from None
        return n

    async def read(self, path: str) -> bytes:
        parts: list[bytes] = []
        await self.download(path, parts.append)
        return b"".join(parts)

    async def upload(self, path: str, data: bytes | AsyncIterator[bytes]) -> list[dict]:
        """Write (create or replace) a file; the body is streamed (envd's octet-stream upload)."""
        params = {"path": path}
        if self.user:
            params["username"] = self.user
        headers = {**self.headers(), "Content-Type": "application/octet-stream"}
        try:
            async with self.http.post(f"{self.endpoint.sandbox_url}/files", params=params, data=data,
                                      headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=None, sock_connect=15,
                                                                    sock_read=300)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise _error_of(resp.status, text)
                return json.loads(text) if text.strip() else []
        except aiohttp.ClientError as e:
            raise EnvdError(f"upload to {path} failed: {e}") from None


async def connect_envd(api: ApiClient, sandbox_id: str, *, user: str | None = None,
                       resume_timeout: int | None = None) -> EnvdClient:
    """envd of a sandbox: its access token from GET /sandboxes/{id}; a paused one is resumed first.

    A running sandbox's TTL is left alone (only a resume sets one: `resume_timeout`, or the
    server's default).
    """
    info = await api.get_sandbox(sandbox_id)
    if info.get("state") != "running":
        info = await api.connect(sandbox_id, resume_timeout)
    return EnvdClient(api.http, api.endpoint, sandbox_id, info.get("envdAccessToken"), user=user)
