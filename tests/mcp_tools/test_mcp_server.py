"""`agentenv mcp` driven by the official MCP Python SDK's own client, over stdio and streamable HTTP.

The MCP server is the real `agentenv mcp` subprocess; its tools act on the session's agentenv
server, and every assertion is on the tool results the MCP client receives (plus the sandbox seen
through the E2B SDK where that proves the effect).
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import socket
import subprocess
import time
from collections.abc import AsyncIterator

import pytest
import requests
from e2b import Sandbox
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from serverproc import agentenv_executable, free_port

TOOLS = {"list_sandboxes", "create_sandbox", "run_command", "read_file", "write_file", "fork_sandbox",
         "snapshot_sandbox", "kill_sandbox"}


def _kill_quietly(server, *ids: str) -> None:
    for sid in ids:
        with contextlib.suppress(requests.RequestException):
            requests.delete(f"{server.api_url}/sandboxes/{sid}", headers={"X-API-KEY": server.api_key}, timeout=60)


@contextlib.asynccontextmanager
async def stdio_session(server) -> AsyncIterator[ClientSession]:
    env = {k: v for k, v in server.sdk_env().items() if k.startswith(("E2B_", "PATH"))}
    params = StdioServerParameters(command=agentenv_executable(), args=["mcp"], env=env)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def call(session: ClientSession, tool: str, **args) -> dict:
    """A tool call that must succeed; its structured result."""
    r = await session.call_tool(tool, args)
    assert not r.is_error, (tool, r.content)
    return r.structured_content


async def create_run_write_read_kill(session: ClientSession, server, created: list[str]) -> str:
    sbx = await call(session, "create_sandbox", template="base", timeout=120, metadata={"via": "mcp"},
                     env_vars={"FROM_MCP": "1"})
    sid = sbx["sandboxID"]
    created.append(sid)
    listed = await call(session, "list_sandboxes")
    assert {"sandboxID": sid, "metadata": {"via": "mcp"}, "state": "running"}.items() <= \
        next(s for s in listed["sandboxes"] if s["sandboxID"] == sid).items()

    ran = await call(session, "run_command", sandbox_id=sid, command="echo hello-$((40+2)) $FROM_MCP")
    assert (ran["exitCode"], ran["stdout"], ran["stderr"]) == (0, "hello-42 1\n", "")

    wrote = await call(session, "write_file", sandbox_id=sid, path="notes/a.txt", content="héllo\nworld\n")
    assert wrote == {"path": "/home/user/notes/a.txt", "bytes": len("héllo\nworld\n".encode())}
    read = await session.call_tool("read_file", {"sandbox_id": sid, "path": "/home/user/notes/a.txt"})
    assert not read.is_error and read.content[0].text == "héllo\nworld\n"
    # the file is really in the sandbox
    assert Sandbox.connect(sid).files.read("/home/user/notes/a.txt") == "héllo\nworld\n"

    killed = await call(session, "kill_sandbox", sandbox_id=sid)
    assert killed == {"sandboxID": sid, "killed": True}
    gone = await session.call_tool("run_command", {"sandbox_id": sid, "command": "true"})
    assert gone.is_error and "404" in gone.content[0].text
    return sid


async def test_stdio_tools_create_run_write_read_kill(server):
    created: list[str] = []
    try:
        async with stdio_session(server) as session:
            tools = {t.name: t for t in (await session.list_tools()).tools}
            assert set(tools) == TOOLS
            assert tools["kill_sandbox"].annotations.destructive_hint is True
            assert tools["read_file"].annotations.read_only_hint is True
            await create_run_write_read_kill(session, server, created)
    finally:
        _kill_quietly(server, *created)


async def test_stdio_commands_binary_files_fork_and_snapshot(server):
    created: list[str] = []
    snapshot_id = None
    try:
        async with stdio_session(server) as session:
            sid = (await call(session, "create_sandbox", timeout=180))["sandboxID"]
            created.append(sid)
            failed = await call(session, "run_command", sandbox_id=sid, command="echo oops >&2; exit 5")
            assert (failed["exitCode"], failed["stderr"]) == (5, "oops\n")  # a result, not a tool error

            blob = os.urandom(70_000)
            await call(session, "write_file", sandbox_id=sid, path="/tmp/blob", encoding="base64",
                       content=base64.b64encode(blob).decode())
            back = await session.call_tool("read_file", {"sandbox_id": sid, "path": "/tmp/blob",
                                                         "encoding": "base64"})
            assert base64.b64decode(back.content[0].text) == blob
            not_text = await session.call_tool("read_file", {"sandbox_id": sid, "path": "/tmp/blob"})
            assert not_text.is_error and "encoding=base64" in not_text.content[0].text
            missing = await session.call_tool("read_file", {"sandbox_id": sid, "path": "/no/such"})
            assert missing.is_error and "does not exist" in missing.content[0].text

            bg = await call(session, "run_command", sandbox_id=sid, background=True,
                            command="n=0; while true; do n=$((n+1)); echo $n > /tmp/counter.new; "
                                    "mv /tmp/counter.new /tmp/counter; sleep 0.2; done")
            assert bg["exitCode"] is None and bg["pid"] > 0
            await call(session, "write_file", sandbox_id=sid, path="state.txt", content="before fork")

            forked = await call(session, "fork_sandbox", sandbox_id=sid, count=2, timeout=120)
            created += forked["children"]
            assert len(forked["children"]) == 2 and forked["errors"] == []
            for child in forked["children"]:
                r = await call(session, "run_command", sandbox_id=child,
                               command="cat state.txt; echo; a=$(cat /tmp/counter); sleep 1; b=$(cat /tmp/counter); "
                                       "[ $b -gt $a ] && echo counting")
                assert r["stdout"] == "before fork\ncounting\n", r  # files and the running loop came along

            snap = await call(session, "snapshot_sandbox", sandbox_id=sid, name=f"mcp-snap-{os.getpid()}")
            snapshot_id = snap["snapshotID"]
            assert snap["names"] == [f"mcp-snap-{os.getpid()}"]
            from_snap = (await call(session, "create_sandbox", template=snapshot_id, timeout=120))["sandboxID"]
            created.append(from_snap)
            r = await call(session, "run_command", sandbox_id=from_snap, command="cat state.txt")
            assert r["stdout"] == "before fork"

            for x in list(created):
                await call(session, "kill_sandbox", sandbox_id=x)
            remaining = {s["sandboxID"] for s in (await call(session, "list_sandboxes"))["sandboxes"]}
            assert not remaining & set(created)
    finally:
        _kill_quietly(server, *created)
        if snapshot_id:
            requests.delete(f"{server.api_url}/snapshots/{snapshot_id}", headers={"X-API-KEY": server.api_key},
                            timeout=60)


@pytest.fixture(scope="module")
def mcp_http(server):
    """`agentenv mcp --transport http` with a bearer token, on a free port."""
    port, token = free_port(), secrets.token_urlsafe(16)
    env = {**server.sdk_env(), "AGENTENV_MCP_TOKEN": token}
    proc = subprocess.Popen([agentenv_executable(), "mcp", "--transport", "http", "--port", str(port)], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline, "agentenv mcp did not listen within 60 s"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/mcp", token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_http_refuses_requests_without_the_token(mcp_http):
    url, token = mcp_http
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.post(url, json=body, headers={"Accept": "application/json, text/event-stream", **headers},
                          timeout=30)
        assert r.status_code == 401 and r.json()["message"] == "missing or wrong bearer token"


async def test_http_tools_create_run_write_read_kill(server, mcp_http):
    url, token = mcp_http
    created: list[str] = []
    try:
        async with create_mcp_http_client(headers={"Authorization": f"Bearer {token}"}) as http, \
                streamable_http_client(url, http_client=http) as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            assert {t.name for t in (await session.list_tools()).tools} == TOOLS
            await create_run_write_read_kill(session, server, created)
    finally:
        _kill_quietly(server, *created)
