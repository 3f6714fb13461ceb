"""Host-side calls into a sandbox's envd: readiness and /init.

Connections are always closed by the host side (we close the session) so that no TIME_WAIT
endpoint is left inside the sandbox, which would make a gVisor checkpoint fail.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
import time
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

from agentenv.constants import ENVD_PORT
from agentenv.envd.state import HOST_TOKEN_HEADER
from agentenv.errors import RuntimeFailure

log = logging.getLogger(__name__)

_ENVELOPE = struct.Struct(">BI")  # Connect streaming: flags, big-endian length


async def _until_answered(host_ip: str, send, *, timeout: float, is_alive, what: str) -> float:
    """Call `send(http, request_timeout)` until it answers True; returns seconds waited. `send` raises
    RuntimeFailure for an answer that trying again cannot change. `is_alive()` aborts early if the
    sandbox died."""
    start = time.monotonic()
    delay = 0.01
    last_err: str = "no answer"
    # A connect whose SYN was dropped (the slot's host side was still coming up) would wait out the
    # kernel's 1 s SYN retransmission: try again sooner with a fresh connection instead, with a connect
    # timeout that grows so a loaded host still gets there.
    # The same for a whole request: envd answers in a few ms, and one left unanswered (measured: 1 in
    # ~12 resumes waited 1.0 s for it) is given up for a fresh connection.
    # The first SYN to a restored sandbox vanishes in ~1 of 6 creates; its retry answers at once, so
    # the connect timeout starts at 25 ms (at 100 ms those creates' envd step took 130-145 ms, now
    # 50-60 ms). A connect given up never sent its request: nothing inside the sandbox saw it.
    connect, whole = 0.025, 0.25
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
        while True:
            try:
                answer = await send(http, aiohttp.ClientTimeout(total=whole, sock_connect=connect))
                if answer is True:
                    return time.monotonic() - start
                last_err = str(answer)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last_err = f"{type(e).__name__}: {e}"
                log.debug("envd at %s: no %s answer yet after %.3fs (%s)", host_ip, what,
                          time.monotonic() - start, last_err)
                if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
                    connect, whole = min(connect * 2, 2.0), min(whole * 2, 2.0)
            if time.monotonic() - start > timeout:
                raise RuntimeFailure(f"envd did not answer {what} within {timeout:.0f}s ({last_err})")
            if is_alive is not None and delay >= 0.08 and not await is_alive():
                raise RuntimeFailure(f"sandbox exited before envd answered {what} ({last_err})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)


async def wait_healthy(host_ip: str, *, timeout: float = 60.0, is_alive=None) -> float:
    """Poll GET /health until 204; returns seconds waited. `is_alive()` aborts early if the sandbox died."""
    url = f"http://{host_ip}:{ENVD_PORT}/health"

    async def health(http: aiohttp.ClientSession, t: aiohttp.ClientTimeout) -> bool | str:
        async with http.get(url, timeout=t) as resp:
            return True if resp.status in (200, 204) else f"HTTP {resp.status}"

    return await _until_answered(host_ip, health, timeout=timeout, is_alive=is_alive, what="/health")


async def init(host_ip: str, *, access_token: str | None, env_vars: dict[str, str], host_token: str,
               default_user: str, default_workdir: str, current_token: str | None = None,
               away_s: float | None = None, timeout: float = 60.0, is_alive=None) -> None:
    """POST /init: hands envd its access token, global env vars and default user.

    A restored envd (fork child, snapshot) still holds the token of its checkpoint: `current_token`
    proves the right to replace it; the host token (given to envd at boot) does the same. `away_s`:
    how long a restored sandbox was away (`agentenv.orchestrator.continuity`).

    Sent until envd answers it, for up to `timeout` seconds, as `wait_healthy` polls (`is_alive` as
    there): right after a start or restore it is the readiness check, with no health check's round
    trip before it. The same body goes each time, so a second copy of an /init whose answer was lost
    changes nothing (envd: `timestamp`); if the first copy set a new token, the second proves it with
    that one. An HTTP error answer fails at once: trying again cannot change it.
    """
    body: dict[str, object] = {
        "accessToken": access_token,
        "envVars": env_vars,
        "defaultUser": default_user,
        "defaultWorkdir": default_workdir,
        # the guest steps its clock to it (a restored microVM's clock lags by its time on disk)
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
    }
    if away_s:
        body["agentenvAwayMs"] = round(away_s * 1000)
    headers = {HOST_TOKEN_HEADER: host_token}
    if current_token:
        headers["X-Access-Token"] = current_token
    url = f"http://{host_ip}:{ENVD_PORT}/init"
    sent = 0

    async def send(http: aiohttp.ClientSession, t: aiohttp.ClientTimeout) -> bool | str:
        nonlocal sent
        sent += 1
        async with http.post(url, json=body, headers=headers, timeout=t) as resp:
            if resp.status == 401 and sent > 1 and access_token and headers.get("X-Access-Token") != access_token:
                # An earlier copy may have been applied with its answer lost: envd then holds the new
                # token, which the old one no longer passes (nor the host token, on a restore of another
                # node's image). Whoever holds the new token may resend it: once more, with that one.
                headers["X-Access-Token"] = access_token
                return "HTTP 401 to the token before this /init (an earlier copy was applied)"
            if resp.status >= 300:
                text = (await resp.text())[:500]
                raise RuntimeFailure(f"envd /init failed: HTTP {resp.status}: {text}")
            return True

    await _until_answered(host_ip, send, timeout=timeout, is_alive=is_alive, what="/init")


async def blocking_connections(host_ip: str, *, host_token: str, timeout: float = 5.0) -> list[dict]:
    """TCP endpoints inside the sandbox that would make a gVisor checkpoint fail (see envd/netstat.py).

    The capture follows at once, so this asking connection must be over inside the sandbox too:
    envd leaves it out of its answer, and a checkpoint (`--net-disconnect-ok`) that finds it still
    held resets it under envd, whose restored copies (fork children) then came back unable to answer
    (seen once in ~80 forks under load: the check took 64 ms, envd had not closed it yet). So the
    host half-closes after the answer and waits for envd's end of the close (EOF: envd has closed its
    socket) before it returns."""
    async def ask() -> list[dict]:
        reader, writer = await asyncio.open_connection(host_ip, ENVD_PORT)
        try:
            writer.write(f"GET /agentenv/connections HTTP/1.1\r\nHost: {host_ip}:{ENVD_PORT}\r\n"
                         f"X-Agentenv-Host-Token: {host_token}\r\n\r\n".encode())
            status, headers = await _read_head(reader)
            body = await _read_body(reader, headers)
            if status != 200:
                raise RuntimeFailure(f"envd connection check failed: HTTP {status}")
            writer.write_eof()  # the host closes first: no TIME_WAIT inside the sandbox
            rest = await reader.read()  # until envd's FIN: envd no longer holds the socket
            return list(json.loads(rest if body is None else body).get("connections", []))
        finally:
            writer.close()
    return await asyncio.wait_for(ask(), timeout)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """An HTTP/1.1 response's status code and headers (names lower-cased)."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes | None:
    """A response body by its Content-Length or chunks; None when it ends with the connection."""
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if "chunked" not in headers.get("transfer-encoding", "").lower():
        return None
    body = bytearray()
    while size := int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16):
        body += (await reader.readexactly(size + 2))[:-2]
    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any
        pass
    return bytes(body)


def _envd_headers(access_token: str | None, user: str) -> dict[str, str]:
    headers = {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}
    if access_token:
        headers["X-Access-Token"] = access_token
    return headers


async def run_process(host_ip: str, *, access_token: str | None, cmd: str, user: str, cwd: str | None = None,
                      envs: dict[str, str] | None = None, shell: str = "/bin/sh", background: bool = False,
                      on_output=None, timeout: float | None = None, login: bool = False) -> int | None:
    """Run `cmd` through `shell -c` inside the sandbox over envd's process.Start stream.

    Returns the exit code; with `background` returns None as soon as the process started (the
    host closes the stream, which never kills the process). `on_output(stream, text)` receives
    stdout/stderr as it arrives.
    """
    process: dict = {"cmd": shell, "args": ["-l", "-c", cmd] if login else ["-c", cmd], "envs": dict(envs or {})}
    if cwd:
        process["cwd"] = cwd
    payload = json.dumps({"process": process, "stdin": False}).encode()
    body = _ENVELOPE.pack(0, len(payload)) + payload
    headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
               **_envd_headers(access_token, user)}
    client_timeout = aiohttp.ClientTimeout(total=None if timeout is None else timeout + 10, sock_connect=10)
    async with aiohttp.ClientSession(timeout=client_timeout) as http:
        async with http.post(f"http://{host_ip}:{ENVD_PORT}/process.Process/Start", data=body,
                             headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeFailure(f"envd process start failed: HTTP {resp.status}: {(await resp.text())[:300]}")
            buf = b""
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                if deadline is not None and time.monotonic() > deadline:
                    raise asyncio.TimeoutError(f"command did not finish within {timeout:.0f}s")
                chunk = await resp.content.readany()
                if not chunk:
                    raise RuntimeFailure("envd closed the process stream before the process ended")
                buf += chunk
                while len(buf) >= 5:
                    flags, length = _ENVELOPE.unpack(buf[:5])
                    if len(buf) < 5 + length:
                        break
                    msg = json.loads(buf[5:5 + length] or b"{}")
                    buf = buf[5 + length:]
                    if flags & 0x02:  # end of stream: an error, or a clean end after "end"
                        err = msg.get("error") if isinstance(msg, dict) else None
                        if err:
                            raise RuntimeFailure(f"envd: {err.get('code')}: {err.get('message')}")
                        raise RuntimeFailure("envd ended the process stream without an exit status")
                    event = (msg.get("event") or {}) if isinstance(msg, dict) else {}
                    if "start" in event and background:
                        return None
                    if "data" in event and on_output is not None:
                        for stream in ("stdout", "stderr", "pty"):
                            if stream in event["data"]:
                                on_output(stream, base64.b64decode(event["data"][stream]).decode(errors="replace"))
                    if "end" in event:
                        end = event["end"]
                        if not end.get("exited", True) and on_output is not None:
                            on_output("stderr", f"process ended: {end.get('error') or end.get('status')}\n")
                        return int(end.get("exitCode", 0))


async def upload_file(host_ip: str, *, access_token: str | None, path: str, src: Path, user: str = "root",
                      timeout: float = 600.0) -> None:
    """POST a host file to `path` inside the sandbox (envd /files, raw body, streamed)."""
    headers = {"Content-Type": "application/octet-stream", **_envd_headers(access_token, user)}

    async def chunks():
        with open(src, "rb") as f:
            while data := f.read(1 << 20):
                yield data

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        async with http.post(f"http://{host_ip}:{ENVD_PORT}/files", params={"path": path, "username": user},
                             data=chunks(), headers=headers) as resp:
            if resp.status >= 300:
                raise RuntimeFailure(f"upload to the sandbox failed: HTTP {resp.status}: {(await resp.text())[:300]}")


async def warm_login_shell(host_ip: str, *, access_token: str | None, user: str) -> None:
    """Run the login shell an SDK command runs in (`bash -l -c true`) once: its binaries and profile
    are then in the page cache and envd's first fork is behind it, so the next command costs what
    later ones do (a warm image before its checkpoint, a pooled sandbox after its restore).
    Raises what `run_process` raises (an image without bash works, only colder)."""
    await run_process(host_ip, access_token=access_token, cmd="true", user=user, shell="/bin/bash",
                      login=True, timeout=30)
