"""Capture anything: pause/resume, fork of 4 and snapshot -> create of sandboxes that run event-loop
servers and hold TCP connections of every kind.

Each sandbox runs, at the moment of the capture:
- an asyncio HTTP + WebSocket server (epoll) with an in-memory counter, port 8001;
- a Node.js HTTP server (epoll) with an in-memory counter, port 8002;
- an HTTP/1.0 `http.server` that closes connections itself (TIME_WAIT inside the sandbox), port 8003;
- a WebSocket held open from the host through our proxy (inbound);
- a connection held from the sandbox to a test host outside it (outbound);
- a connection held from inside the sandbox to its own asyncio server (loopback).

Connections may be reset by a capture (documented in docs/limitations.md, as Modal does); every
server must come back working with its state, in the source and in every child.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
from e2b import Sandbox, SandboxState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "network_policy"))
from netpolicy_util import running_test_hosts  # noqa: E402

from lifecycle_util import start_detached

WORK = "/home/user/cap"
ASYNC_PORT, NODE_PORT, HTTP10_PORT = 8001, 8002, 8003

ASYNC_SERVER = r'''
import asyncio, base64, hashlib, json, os, struct
N = 0
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

def frame(payload: bytes) -> bytes:
    return bytes([0x81, len(payload)]) + payload

async def websocket(r, w, hdrs):
    global N
    acc = base64.b64encode(hashlib.sha1(hdrs["sec-websocket-key"].encode() + GUID).digest())
    w.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    await w.drain()
    while True:
        b0, b1 = await r.readexactly(2)
        n = b1 & 127
        if n == 126:
            n = struct.unpack(">H", await r.readexactly(2))[0]
        mask = await r.readexactly(4) if b1 & 128 else b"\0\0\0\0"
        data = bytes(c ^ mask[i % 4] for i, c in enumerate(await r.readexactly(n)))
        if b0 & 15 == 8:
            return
        N += 1
        w.write(frame(json.dumps({"echo": data.decode(), "count": N}).encode()))
        await w.drain()

async def handle(r, w):
    global N
    try:
        while True:
            head = (await r.readuntil(b"\r\n\r\n")).decode()
            lines = head.split("\r\n")
            path = lines[0].split()[1]
            hdrs = {k.lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:]) if v}
            if path == "/ws":
                return await websocket(r, w, hdrs)
            N += 1
            body = json.dumps({"pid": os.getpid(), "count": N}).encode()
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(body), body))
            await w.drain()
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        pass
    finally:
        w.close()

async def main():
    server = await asyncio.start_server(handle, "0.0.0.0", PORT)
    await server.serve_forever()

asyncio.run(main())
'''.replace("PORT", str(ASYNC_PORT))

NODE_SERVER = r'''
const http = require("http");
let n = 0;
http.createServer((req, res) => {
  n += 1;
  res.setHeader("Content-Type", "application/json");
  res.end(JSON.stringify({pid: process.pid, count: n}));
}).listen(PORT, "0.0.0.0");
'''.replace("PORT", str(NODE_PORT))

# Holds one TCP connection to HOST:PORT (after one request on it when asked) until it breaks, and
# writes what broke it to RESULT; when RESULT.ping appears it sends a request on the held connection
# instead and writes "alive" if it was answered.
HOLDER = r'''
import os, socket, sys
host, port, result, request = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
s = socket.create_connection((host, port))
if request:
    s.sendall(b"GET /count HTTP/1.1\r\nHost: x\r\n\r\n")
    s.recv(4096)
open(result + ".held", "w").close()
s.settimeout(0.2)
outcome = None
while outcome is None:
    try:
        if os.path.exists(result + ".ping"):
            s.settimeout(10)
            s.sendall(b"GET /count HTTP/1.1\r\nHost: x\r\n\r\n")
            outcome = "alive" if b"200 OK" in s.recv(4096) else "no answer"
            break
        data = s.recv(1)
        outcome = "eof" if not data else "data"
    except socket.timeout:
        continue
    except OSError as e:
        outcome = type(e).__name__
with open(result + ".tmp", "w") as f:  # whole or not at all: the test reads it once it exists
    f.write(outcome)
os.rename(result + ".tmp", result)
'''


def route(sbx_id: str, port: int) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sbx_id, "E2b-Sandbox-Port": str(port)}


def get_json(server, sbx_id: str, port: int, path: str = "/count", limit: float = 60) -> dict:
    deadline = time.monotonic() + limit
    while True:
        try:
            r = requests.get(f"{server.sandbox_url}{path}", headers=route(sbx_id, port), timeout=15)
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except requests.RequestException as e:
            last = repr(e)
        assert time.monotonic() < deadline, f"{sbx_id}:{port}{path} never answered: {last}"
        time.sleep(0.3)


def get_hello(server, sbx_id: str, limit: float = 60) -> str:
    """GET /hello.txt from the HTTP/1.0 server, once it listens (502 until then)."""
    deadline = time.monotonic() + limit
    while True:
        r = requests.get(f"{server.sandbox_url}/hello.txt", headers=route(sbx_id, HTTP10_PORT), timeout=30)
        if r.status_code == 200:
            return r.text
        assert time.monotonic() < deadline, f"http.server of {sbx_id} never answered: {r.status_code} {r.text[:200]}"
        time.sleep(0.3)


class WebSocketThroughProxy:
    """A minimal RFC 6455 client over a plain socket to the proxy (the sandbox answers the upgrade)."""

    def __init__(self, server, sbx_id: str) -> None:
        u = urlsplit(server.sandbox_url)
        self.sock = socket.create_connection((u.hostname, u.port or 80), timeout=20)
        key = base64.b64encode(os.urandom(16)).decode()
        hdrs = "".join(f"{k}: {v}\r\n" for k, v in route(sbx_id, ASYNC_PORT).items())
        self.sock.sendall((f"GET /ws HTTP/1.1\r\nHost: {u.netloc}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{hdrs}\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            assert chunk, f"proxy closed the upgrade: {head!r}"
            head += chunk
        assert head.startswith(b"HTTP/1.1 101"), head[:200]
        self.buf = head.split(b"\r\n\r\n", 1)[1]

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionResetError("websocket closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def echo(self, text: str) -> dict:
        payload = text.encode()
        mask = os.urandom(4)
        self.sock.sendall(bytes([0x81, 0x80 | len(payload)]) + mask +
                          bytes(c ^ mask[i % 4] for i, c in enumerate(payload)))
        _, n = self._read(2)
        if n & 127 == 126:
            n = struct.unpack(">H", self._read(2))[0]
        return json.loads(self._read(n & 127 if n < 126 else n))

    def is_broken(self) -> bool:
        """The capture reset it: a send or a read fails (or the peer closed)."""
        try:
            self.sock.settimeout(10)
            self.echo("after")
            return False
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def outside_host(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces for the outside test host)")
    with running_test_hosts(tmp_path_factory.mktemp("capture-hosts")) as hosts:
        yield hosts.public


def start_workloads(sbx: Sandbox, server, outside: str) -> dict:
    sbx.files.write(f"{WORK}/async_server.py", ASYNC_SERVER)
    sbx.files.write(f"{WORK}/node_server.js", NODE_SERVER)
    sbx.files.write(f"{WORK}/holder.py", HOLDER)
    sbx.files.write(f"{WORK}/www/hello.txt", "hello\n")
    for cmd in (f"exec python3 {WORK}/async_server.py", f"exec node {WORK}/node_server.js",
                f"cd {WORK}/www && exec python3 -m http.server {HTTP10_PORT}"):
        start_detached(sbx, cmd)
    before = {"async": get_json(server, sbx.sandbox_id, ASYNC_PORT), "node": get_json(server, sbx.sandbox_id, NODE_PORT)}
    # TIME_WAIT inside the sandbox: HTTP/1.0 http.server closes the connection first.
    assert get_hello(server, sbx.sandbox_id) == "hello\n"
    # Held connections: loopback inside the sandbox, outbound to the test host, inbound WebSocket.
    start_detached(sbx, f"exec python3 {WORK}/holder.py 127.0.0.1 {ASYNC_PORT} {WORK}/loopback 1")
    start_detached(sbx, f"exec python3 {WORK}/holder.py {outside} 80 {WORK}/outbound 0")
    for name in ("loopback", "outbound"):
        wait_file(sbx, f"{WORK}/{name}.held")
    ws = WebSocketThroughProxy(server, sbx.sandbox_id)
    before["ws"] = ws.echo("before")
    conns = sbx.commands.run("cat /proc/net/tcp /proc/net/tcp6 | awk '$4 == \"01\"' | wc -l").stdout.strip()
    assert int(conns) >= 3, f"expected the held connections to be ESTABLISHED in the sandbox, saw {conns}"
    before["ws_client"] = ws
    return before


def wait_file(sbx: Sandbox, path: str, limit: float = 30) -> str:
    deadline = time.monotonic() + limit
    while not sbx.files.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.3)
    return sbx.files.read(path)


def assert_servers_continue(server, sbx: Sandbox, before: dict, what: str) -> None:
    """Every server answers, as the same process, with its counter continued from before the capture."""
    for name, port in (("async", ASYNC_PORT), ("node", NODE_PORT)):
        got = get_json(server, sbx.sandbox_id, port)
        assert got["pid"] == before[name]["pid"], f"{what}: {name} server is another process: {got}"
        assert got["count"] > before[name]["count"], f"{what}: {name} server lost its state: {got} vs {before[name]}"
    assert get_hello(server, sbx.sandbox_id) == "hello\n", f"{what}: http.server"
    ws = WebSocketThroughProxy(server, sbx.sandbox_id)
    try:
        got = ws.echo(what)
        assert got["echo"] == what and got["count"] > before["ws"]["count"], got
    finally:
        ws.close()
    # a new loopback connection inside the sandbox works too
    out = sbx.commands.run(f"python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{ASYNC_PORT}/count', "
                           f"timeout=10).read().decode())\"", timeout=30).stdout
    assert json.loads(out)["pid"] == before["async"]["pid"], out


RESET = ("ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError", "eof")


def assert_held_connections(sbx: Sandbox, before: dict) -> None:
    """Connections that cross the sandbox's network (inbound through the proxy, outbound) are reset
    by the capture; a loopback connection inside the sandbox is saved with it and still works."""
    assert before["ws_client"].is_broken(), "the WebSocket held through the proxy survived the capture"
    before["ws_client"].close()
    outcome = wait_file(sbx, f"{WORK}/outbound")
    assert outcome in RESET, f"outbound connection: {outcome}"
    sbx.files.write(f"{WORK}/loopback.ping", "")
    outcome = wait_file(sbx, f"{WORK}/loopback")
    assert outcome in RESET + ("alive",), f"loopback connection: {outcome}"
    print(f"loopback connection after the capture: {outcome}")


@pytest.mark.timeout(600)
def test_pause_resume_with_servers_and_open_connections(server, tracker, outside_host):
    sbx = tracker.create()
    before = start_workloads(sbx, server, outside_host)
    t0 = time.monotonic()
    assert sbx.pause() is True
    print(f"pause with servers and open connections: {time.monotonic() - t0:.2f}s")
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert_servers_continue(server, resumed, before, "after resume")
    assert_held_connections(resumed, before)


@pytest.mark.timeout(600)
def test_fork_4_with_servers_and_open_connections(server, tracker, outside_host):
    src = tracker.create()
    before = start_workloads(src, server, outside_host)
    t0 = time.monotonic()
    results = src.fork(count=4, timeout=600, request_timeout=540)
    print(f"fork(4) with servers and open connections: {time.monotonic() - t0:.2f}s")
    children = [tracker.add(c) for c in results if isinstance(c, Sandbox)]
    assert len(children) == 4, f"fork children failed: {[r for r in results if not isinstance(r, Sandbox)]}"
    assert Sandbox.get_info(src.sandbox_id).state == SandboxState.RUNNING
    assert_servers_continue(server, src, before, "source after fork")
    assert_held_connections(src, before)
    for c in children:
        assert_servers_continue(server, c, before, f"fork child {c.sandbox_id}")


@pytest.mark.timeout(600)
def test_snapshot_then_create_with_servers_and_open_connections(server, tracker, outside_host):
    src = tracker.create()
    before = start_workloads(src, server, outside_host)
    snap = src.create_snapshot()
    assert Sandbox.get_info(src.sandbox_id).state == SandboxState.RUNNING
    assert_servers_continue(server, src, before, "source after snapshot")
    assert_held_connections(src, before)
    child = tracker.create(snap.snapshot_id)
    assert_servers_continue(server, child, before, "sandbox from the snapshot")
