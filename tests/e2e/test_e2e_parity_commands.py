"""E2B parity of command timeouts and of commands cut off by the sandbox's end (issue 14, items 3 and 5).

E2B's envd bounds a Start stream and its process by `Connect-Timeout-Ms`; the stream's deadline
runs from the request and wins, so `commands.run(..., timeout=N)` always ends in the SDK's
TimeoutException (code deadline_exceeded), never in an exit code -1 from the kill of the process.

A sandbox that goes away (killed, or its timeout reached) while a command streams: the stream is
cut at the connection level, as E2B's proxy does; the SDKs then probe the sandbox's /health, get
the proxy's 502 "sandbox was not found" and raise their TimeoutException saying the sandbox "was
killed or reached its end of life while the request was in flight".
"""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
from e2b import AsyncSandbox, CommandExitException, Sandbox, TimeoutException

from e2e_util import akill_quietly, kill_quietly, wait_until

HERE = Path(__file__).resolve().parent
JS_SDK = HERE.parent / "js" / "node_modules" / "e2b" / "dist" / "index.mjs"
RUNS = 10
KILLED_WORDS = "killed or reached its end of life"


def _run_js(server, *args: str, timeout: float = 240) -> dict:
    node = shutil.which("node")
    if node is None or not JS_SDK.exists():
        pytest.fail("node or the JS e2b SDK is missing (run scripts/setup.sh --test)")
    proc = subprocess.run(
        [node, str(HERE / "js_parity_commands.mjs"), JS_SDK.as_uri(), *args],
        env=server.sdk_env(), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


def _no_sleep_left(sbx: Sandbox, marker: str) -> bool:
    return not any(marker in " ".join([p.cmd, *p.args]) for p in sbx.commands.list())


# ------------------------------------------------------------------ item 5: run(timeout=...)


def test_run_timeout_always_raises_timeout_sync(sandbox_factory):
    sbx = sandbox_factory.create()
    for i in range(RUNS):
        marker = f"sleep 10.{i}1"
        start = time.monotonic()
        with pytest.raises(TimeoutException) as info:
            sbx.commands.run(marker, timeout=2)
        took = time.monotonic() - start
        assert not isinstance(info.value, CommandExitException), f"run {i}: {info.value!r}"
        assert 1.9 <= took < 8, f"run {i} took {took:.2f}s"  # not the 10 s of the sleep
        # envd's own timeout killed the process
        wait_until(lambda: _no_sleep_left(sbx, marker), f"run {i}'s process to be killed", limit=15)


async def test_run_timeout_always_raises_timeout_async(server):
    sbx = await AsyncSandbox.create(timeout=300, metadata={"suite": "e2e", "module": "parity_commands"})
    try:
        for i in range(RUNS):
            with pytest.raises(TimeoutException) as info:
                await sbx.commands.run(f"sleep 10.{i}2", timeout=1)
            assert not isinstance(info.value, CommandExitException), f"run {i}: {info.value!r}"
        assert (await sbx.commands.run("echo still-here")).stdout == "still-here\n"
    finally:
        await akill_quietly(sbx)


def test_run_timeout_always_raises_timeout_js(server):
    result = _run_js(server, "timeouts", str(RUNS))
    assert len(result["runs"]) == RUNS
    for i, run in enumerate(result["runs"]):
        assert run["timeoutError"], f"run {i}: {run}"
        assert "deadline_exceeded" in run["message"], f"run {i}: {run}"
        assert 1.9 <= run["seconds"] < 8, f"run {i}: {run}"


def _frames(data: bytes) -> list[tuple[int, dict]]:
    out, pos = [], 0
    while pos + 5 <= len(data):
        flags, size = struct.unpack(">BI", data[pos:pos + 5])
        out.append((flags, json.loads(data[pos + 5:pos + 5 + size] or b"{}")))
        pos += 5 + size
    assert pos == len(data), "a truncated Connect frame"
    return out


def test_start_stream_deadline_wins_over_the_process_timeout(server, sandbox_factory):
    """Without a client-side timer (only the Connect-Timeout-Ms header): envd itself ends the stream
    with deadline_exceeded, never with the end event of the process its timeout killed."""
    sbx = sandbox_factory.create()
    body = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "sleep 10.93"]}}).encode()
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sbx._envd_access_token or "", "Authorization": "Basic dXNlcjo=",  # user:
        "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1", "Connect-Timeout-Ms": "1500",
    }
    for i in range(5):
        start = time.monotonic()
        r = requests.post(f"{server.sandbox_url}/process.Process/Start", headers=headers,
                          data=struct.pack(">BI", 0, len(body)) + body, timeout=30)
        took = time.monotonic() - start
        assert r.status_code == 200, r.text
        frames = _frames(r.content)
        events = [m["event"] for flags, m in frames if not flags & 2]
        assert "start" in events[0], frames
        assert not any("end" in e for e in events), f"run {i}: the process's end event came first: {frames}"
        flags, last = frames[-1]
        assert flags & 2 and last.get("error", {}).get("code") == "deadline_exceeded", frames
        assert 1.4 <= took < 5, took
    wait_until(lambda: _no_sleep_left(sbx, "sleep 10.93"), "the timed-out processes to be killed", limit=15)


# ------------------------------------------------------------------ item 3: sandbox gone mid-command


def _wait_error_sync(sbx: Sandbox, end) -> BaseException:
    handle = sbx.commands.run("sleep 120", background=True)
    threading.Timer(1.0, end).start()
    with pytest.raises(TimeoutException) as info:
        handle.wait()
    return info.value


def test_killed_sandbox_wait_raises_timeout_sync(sandbox_factory):
    sbx = sandbox_factory.create()
    err = _wait_error_sync(sbx, lambda: Sandbox.kill(sbx.sandbox_id))
    assert KILLED_WORDS in str(err), repr(err)
    assert not sbx.is_running()


def test_sandbox_killing_itself_wait_raises_timeout_sync(sandbox_factory):
    sbx = sandbox_factory.create()
    err = _wait_error_sync(sbx, sbx.kill)
    assert KILLED_WORDS in str(err), repr(err)


def test_sandbox_end_of_life_wait_raises_timeout_sync(server):
    sbx = Sandbox.create(timeout=3, metadata={"suite": "e2e", "module": "parity_commands"})
    try:
        handle = sbx.commands.run("sleep 120", background=True)
        start = time.monotonic()
        with pytest.raises(TimeoutException) as info:
            handle.wait()
        assert KILLED_WORDS in str(info.value), repr(info.value)
        assert time.monotonic() - start < 30
    finally:
        kill_quietly(sbx)


async def test_killed_sandbox_wait_raises_timeout_async(server):
    sbx = await AsyncSandbox.create(timeout=300, metadata={"suite": "e2e", "module": "parity_commands"})
    try:
        handle = await sbx.commands.run("sleep 120", background=True)

        async def kill_soon() -> None:
            await asyncio.sleep(1.0)
            await AsyncSandbox.kill(sbx.sandbox_id)

        killer = asyncio.create_task(kill_soon())
        with pytest.raises(TimeoutException) as info:
            await handle.wait()
        await killer
        assert KILLED_WORDS in str(info.value), repr(info.value)
    finally:
        await akill_quietly(sbx)


def test_killed_sandbox_wait_raises_timeout_js(server):
    result = _run_js(server, "killed")
    for case in ("kill", "endOfLife"):
        got = result[case]
        assert got["timeoutError"], f"{case}: {got}"
        assert KILLED_WORDS in got["message"], f"{case}: {got}"
