"""The data-plane proxy end to end: a real server, real sandboxes, a real web app inside them.

The app (`sandbox_app.py`, standard library only) runs inside the sandbox on APP_PORT; every
request goes through the session server's listener (E2B_SANDBOX_URL), routed by the
`E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers, by `get_host()`'s Host name, or by the
`/proxy/<id>/<port>/` path. Counts of resumes come from the server's log, which is what an
operator sees.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import aiohttp
import pytest
import requests
from e2b import Sandbox

pytestmark = pytest.mark.timeout(600)

APP_PORT = 8000
MIB = 1 << 20
BIG = 200 * MIB
APP_SOURCE = (Path(__file__).parent / "sandbox_app.py").read_text()
APP_PATH = "/home/user/app.py"
# Proxy memory may grow by at most this much while 200 MiB pass through it each way (a buffered
# body would need at least the body's size).
RSS_GROWTH_LIMIT = 64 * MIB


def pattern(size: int) -> Iterable[bytes]:
    """The same bytes sandbox_app.pattern() produces."""
    block, i = 0, 0
    while i < size:
        seed = hashlib.sha256(block.to_bytes(8, "big")).digest()
        chunk = (seed * (MIB // len(seed)))[: min(MIB, size - i)]
        yield chunk
        i += len(chunk)
        block += 1


def pattern_sha(size: int) -> str:
    h = hashlib.sha256()
    for c in pattern(size):
        h.update(c)
    return h.hexdigest()


def route(sbx: Sandbox, port: int = APP_PORT, **extra: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(port), **extra}


def start_app(sbx: Sandbox, server, token: str | None = None) -> None:
    """Start the app detached from envd's process stream (no connection is left open), wait for it."""
    sbx.files.write(APP_PATH, APP_SOURCE)
    sbx.commands.run(f"setsid nohup python3 {APP_PATH} {APP_PORT} >/tmp/app.log 2>&1 </dev/null &")
    headers = route(sbx, **({"E2B-Traffic-Access-Token": token} if token else {}))
    deadline = time.monotonic() + 60
    while True:
        r = requests.get(f"{server.sandbox_url}/hello", headers=headers, timeout=30)
        if r.status_code == 200:
            return
        assert r.status_code == 502 and "port is not open" in r.json()["message"], r.text
        if time.monotonic() > deadline:
            pytest.fail(f"the app did not start: {sbx.commands.run('cat /tmp/app.log').stdout}")
        time.sleep(0.2)


def kill_quietly(sbx: Sandbox) -> None:
    try:
        sbx.kill()
    except Exception:  # noqa: BLE001
        pass


def log_count(server, pattern_: str) -> int:
    return len(re.findall(pattern_, server.log_path.read_text(errors="replace")))


def lifecycle_events(server, sandbox_id: str, type_: str) -> list[dict]:
    """The sandbox's lifecycle events of one type, from the server's public event stream."""
    r = requests.get(f"{server.api_url}/events", params={"sandboxID": sandbox_id, "limit": 5000},
                     headers={"X-API-Key": server.api_key}, timeout=30)
    assert r.status_code == 200, r.text
    return [e for e in r.json()["events"] if e["type"] == type_]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """Samples a process's RSS every 20 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.base, self.peak = pid, rss(pid), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss(self.pid))
            time.sleep(0.02)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return max(0, self.peak - self.base)


@pytest.fixture(scope="module")
def app_sbx(server) -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=900, metadata={"suite": "proxy"})
    try:
        start_app(sbx, server)
        yield sbx
    finally:
        kill_quietly(sbx)


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        yield session


# --------------------------------------------------------------------------- routing


def test_header_host_and_path_routing_reach_the_app(server, app_sbx: Sandbox) -> None:
    by_header = requests.get(f"{server.sandbox_url}/hello?via=header", headers=route(app_sbx), timeout=30)
    assert by_header.status_code == 200 and by_header.json()["path"] == "/hello?via=header"
    pid = by_header.json()["pid"]

    host = app_sbx.get_host(APP_PORT)
    assert host == f"{APP_PORT}-{app_sbx.sandbox_id}.localhost:{server.sandbox_url.rsplit(':', 1)[1]}"
    by_host = requests.get(f"{server.sandbox_url}/hello?via=host", headers={"Host": host}, timeout=30)
    assert by_host.status_code == 200 and by_host.json()["pid"] == pid

    by_path = requests.get(f"{server.sandbox_url}/proxy/{app_sbx.sandbox_id}/{APP_PORT}/hello?via=path", timeout=30)
    assert by_path.status_code == 200
    body = by_path.json()
    assert body["pid"] == pid and body["path"] == "/hello?via=path"
    assert dict((k.lower(), v) for k, v in body["headers"])["x-forwarded-prefix"] == \
        f"/proxy/{app_sbx.sandbox_id}/{APP_PORT}"


def test_upstream_connections_are_kept_alive_and_reused(server, app_sbx: Sandbox) -> None:
    """Separate client connections, one after the other, share one pooled connection to the app."""
    peers = set()
    for _ in range(5):
        with requests.Session() as s:  # a new client connection each time
            peers.add(tuple(s.get(f"{server.sandbox_url}/hello", headers=route(app_sbx), timeout=30).json()["peer"]))
    # Normally one; idle pooled connections are closed after 2 s, which a stalled machine can reach.
    assert len(peers) < 5, peers


def test_get_host_resolves_without_dns_for_curl(server, app_sbx: Sandbox) -> None:
    """curl resolves `*.localhost` to loopback by itself: get_host() works as-is, no DNS set up."""
    out = subprocess.run(["curl", "-sS", "--max-time", "30", f"http://{app_sbx.get_host(APP_PORT)}/hello"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["pid"] > 0


def test_errors_are_json_with_the_bodies_the_sdk_expects(server, app_sbx: Sandbox) -> None:
    closed = requests.get(f"{server.sandbox_url}/", headers=route(app_sbx, 8001), timeout=30)
    assert closed.status_code == 502
    assert closed.json() == {"sandboxId": app_sbx.sandbox_id, "message": "The sandbox is running but port is not open",
                             "code": 502}
    unknown = requests.get(f"{server.sandbox_url}/proxy/inosuchsandbox/{APP_PORT}/hello", timeout=30)
    assert unknown.status_code == 502
    assert unknown.json() == {"sandboxId": "inosuchsandbox", "message": "The sandbox was not found", "code": 502}
    bad = requests.get(f"{server.sandbox_url}/proxy/{app_sbx.sandbox_id}/notaport/hello", timeout=30)
    assert bad.status_code == 400 and bad.json()["code"] == 400


def test_api_key_is_not_a_data_plane_credential(server, app_sbx: Sandbox) -> None:
    headers = route(app_sbx, **{"X-API-Key": server.api_key, "Authorization": f"Bearer {server.api_key}",
                                "X-App": "kept"})
    r = requests.get(f"{server.sandbox_url}/hello", headers=headers, timeout=30)
    got = {k.lower(): v for k, v in r.json()["headers"]}
    assert "x-api-key" not in got and "authorization" not in got
    assert got["x-app"] == "kept"
    assert server.api_key not in r.text


# --------------------------------------------------------------------------- streaming


async def test_http_streams_both_ways_at_once(server, app_sbx: Sandbox, client: aiohttp.ClientSession) -> None:
    """Each chunk sent is echoed back before the next is sent: neither direction is buffered."""
    echoed: asyncio.Queue[bytes] = asyncio.Queue()
    chunks = [secrets.token_bytes(1000 + i) for i in range(8)]

    async def body() -> AsyncIterator[bytes]:
        for c in chunks:
            yield c
            got = b""
            while len(got) < len(c):
                got += await asyncio.wait_for(echoed.get(), 30)
            assert got == c

    async def read(resp: aiohttp.ClientResponse) -> None:
        async for data in resp.content.iter_any():
            await echoed.put(data)

    req = asyncio.ensure_future(client.post(f"{server.sandbox_url}/echo", data=body(), headers=route(app_sbx)))
    # The response headers arrive while the request body is still open; read it concurrently.
    resp = await asyncio.wait_for(req, 60)
    assert resp.status == 200 and resp.headers.get("Transfer-Encoding") == "chunked"
    reader = asyncio.create_task(read(resp))
    await asyncio.wait_for(reader, 60)
    resp.release()
    assert echoed.empty()


async def test_sse_events_arrive_one_by_one(server, app_sbx: Sandbox, client: aiohttp.ClientSession) -> None:
    """The app sends event i+1 only after the client acknowledged event i on another request,
    so the stream can only finish if the proxy flushed every event on its own."""
    key = secrets.token_hex(4)
    events = []
    async with client.get(f"{server.sandbox_url}/sse?n=5&key={key}", headers=route(app_sbx)) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        block = b""
        while len(events) < 5:
            line = await asyncio.wait_for(r.content.readline(), 30)
            assert line, "stream ended early"
            block += line
            if line == b"\n":
                fields = dict(ln.split(": ", 1) for ln in block.decode().strip().split("\n"))
                events.append(fields)
                block = b""
                async with client.get(f"{server.sandbox_url}/ack?key={key}&i={fields['id']}",
                                      headers=route(app_sbx)) as ack:
                    assert ack.status == 200
        assert await r.read() == b""
    assert [e["id"] for e in events] == ["0", "1", "2", "3", "4"]
    assert all(e["event"] == "tick" and json.loads(e["data"])["i"] == int(e["id"]) for e in events)


async def test_websocket_echo_server_in_the_sandbox(server, app_sbx: Sandbox, client: aiohttp.ClientSession) -> None:
    url = f"{server.sandbox_url}/proxy/{app_sbx.sandbox_id}/{APP_PORT}/ws"
    async with client.ws_connect(url, autoping=False) as ws:
        await ws.send_str("hello")
        assert (await ws.receive(timeout=30)).data == "echo:hello"
        blob = secrets.token_bytes(300_000)  # a 64-bit length frame
        await ws.send_bytes(blob)
        msg = await ws.receive(timeout=30)
        assert msg.type == aiohttp.WSMsgType.BINARY and msg.data == blob
        await ws.ping(b"are you there")
        pong = await ws.receive(timeout=30)
        assert pong.type == aiohttp.WSMsgType.PONG and pong.data == b"are you there"
        await ws.close(code=4000, message=b"done")
        assert ws.close_code == 4000
    # Host routing does WebSocket too.
    async with client.ws_connect(f"{server.sandbox_url}/ws", headers={"Host": app_sbx.get_host(APP_PORT)}) as ws:
        await ws.send_str("again")
        assert (await ws.receive(timeout=30)).data == "echo:again"


async def test_200_mib_each_way_with_bounded_proxy_memory(server, app_sbx: Sandbox,
                                                          client: aiohttp.ClientSession) -> None:
    async def upload() -> AsyncIterator[bytes]:
        for c in pattern(BIG):
            yield c

    # The process the bytes cross: HAProxy when it is the data plane, else the server itself.
    from test_data_plane import haproxy_pids

    proxy_pid = (haproxy_pids(server.data_dir) or [server.pid])[0]
    with PeakRss(proxy_pid) as up_mem:
        async with client.post(f"{server.sandbox_url}/upload", data=upload(), headers=route(app_sbx)) as r:
            assert r.status == 200
            got = await r.json()
    assert got["size"] == BIG and got["sha256"] == pattern_sha(BIG)
    assert got["transfer_encoding"] == "chunked"  # streamed as it came, not collected first

    with PeakRss(proxy_pid) as down_mem:
        h, size = hashlib.sha256(), 0
        async with client.get(f"{server.sandbox_url}/download?size={BIG}", headers=route(app_sbx)) as r:
            assert r.status == 200 and r.headers["Content-Length"] == str(BIG)
            async for data in r.content.iter_chunked(MIB):
                h.update(data)
                size += len(data)
    assert size == BIG and h.hexdigest() == pattern_sha(BIG)

    print(f"proxy RSS growth: upload {up_mem.growth / MIB:.1f} MiB, download {down_mem.growth / MIB:.1f} MiB")
    assert up_mem.growth < RSS_GROWTH_LIMIT, f"upload grew the proxy by {up_mem.growth / MIB:.0f} MiB"
    assert down_mem.growth < RSS_GROWTH_LIMIT, f"download grew the proxy by {down_mem.growth / MIB:.0f} MiB"


# --------------------------------------------------------------------------- private sandboxes


def test_private_sandbox_needs_its_traffic_token(server) -> None:
    sbx = Sandbox.create(timeout=600, metadata={"suite": "proxy"}, network={"allow_public_traffic": False})
    try:
        token = sbx.traffic_access_token
        assert token
        start_app(sbx, server, token)
        url = f"{server.sandbox_url}/hello"
        missing = requests.get(url, headers=route(sbx), timeout=30)
        assert missing.status_code == 403 and "Missing" in missing.json()["message"]
        wrong = requests.get(url, headers=route(sbx, **{"E2B-Traffic-Access-Token": token[:-2] + "xx"}), timeout=30)
        assert wrong.status_code == 403 and "Invalid" in wrong.json()["message"]
        api_key = requests.get(url, headers=route(sbx, **{"E2B-Traffic-Access-Token": server.api_key}), timeout=30)
        assert api_key.status_code == 403  # the API key does not open a private sandbox
        right = requests.get(url, headers=route(sbx, **{"e2b-traffic-access-token": token}), timeout=30)
        assert right.status_code == 200
        got = {k.lower() for k, _ in right.json()["headers"]}
        assert "e2b-traffic-access-token" not in got  # checked by the proxy, not handed on
        # Every routing form enforces it.
        by_path = f"{server.sandbox_url}/proxy/{sbx.sandbox_id}/{APP_PORT}/hello"
        assert requests.get(by_path, timeout=30).status_code == 403
        assert requests.get(by_path, headers={"E2B-Traffic-Access-Token": token}, timeout=30).status_code == 200
        by_host = {"Host": sbx.get_host(APP_PORT)}
        assert requests.get(url, headers=by_host, timeout=30).status_code == 403
        # envd keeps its own access token: the SDK works on a private sandbox as usual.
        assert sbx.commands.run("echo private").stdout.strip() == "private"
    finally:
        kill_quietly(sbx)


def test_public_sandbox_gets_no_token(server, app_sbx: Sandbox) -> None:
    assert app_sbx.traffic_access_token is None
    assert requests.get(f"{server.sandbox_url}/hello", headers=route(app_sbx), timeout=30).status_code == 200


# --------------------------------------------------------------------------- wake on traffic


def wait_state(sbx: Sandbox, state: str, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while sbx.get_info().state.value != state:
        assert time.monotonic() < deadline, f"sandbox never became {state}"
        time.sleep(0.5)


async def test_wake_on_traffic_20_concurrent_requests_one_resume(server) -> None:
    sbx = Sandbox.create(timeout=600, metadata={"suite": "proxy"},
                         lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        assert sbx.get_info().lifecycle["auto_resume"] is True
        start_app(sbx, server)
        before = requests.get(f"{server.sandbox_url}/hello", headers=route(sbx), timeout=30).json()
        sbx.pause()
        wait_state(sbx, "paused")
        sid = sbx.sandbox_id
        woke0 = log_count(server, rf"woke sandbox {sid} on traffic")
        resumed0 = log_count(server, rf"resumed sandbox {sid}\b")
        assert lifecycle_events(server, sid, "resumed") == []

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as client:
            async def one(i: int) -> tuple[int, dict]:
                async with client.get(f"{server.sandbox_url}/hello?n={i}", headers=route(sbx)) as r:
                    return r.status, await r.json()

            results = await asyncio.gather(*(one(i) for i in range(20)))

        assert [status for status, _ in results] == [200] * 20, results
        # The same process, with its memory: the counter carries on from before the pause.
        assert {body["pid"] for _, body in results} == {before["pid"]}
        assert sorted(body["count"] for _, body in results) == list(range(before["count"] + 1, before["count"] + 21))
        assert log_count(server, rf"woke sandbox {sid} on traffic") - woke0 == 1
        assert log_count(server, rf"resumed sandbox {sid}\b") - resumed0 == 1
        resumed = lifecycle_events(server, sid, "resumed")
        assert len(resumed) == 1 and resumed[0]["reason"] == "traffic", resumed
        assert sbx.get_info().state.value == "running"
    finally:
        kill_quietly(sbx)


def test_sandbox_auto_paused_at_its_timeout_wakes_on_traffic(server) -> None:
    """The E2B flow: on_timeout="pause" + auto_resume — idle until the timeout, then a request
    brings it back with its processes, and it runs as long as its last run did."""
    sbx = Sandbox.create(timeout=600, metadata={"suite": "proxy"},
                         lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        start_app(sbx, server)
        before = requests.get(f"{server.sandbox_url}/hello", headers=route(sbx), timeout=30).json()
        sbx.set_timeout(3)
        wait_state(sbx, "paused")
        r = requests.get(f"{server.sandbox_url}/proxy/{sbx.sandbox_id}/{APP_PORT}/hello", timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["pid"] == before["pid"] and r.json()["count"] == before["count"] + 1
        info = sbx.get_info()
        assert info.state.value == "running"
        # As long a run as the last one (created, then cut to 3 s): not the default 300 s.
        assert 1 <= (info.end_at - info.started_at).total_seconds() <= 120
        assert log_count(server, rf"woke sandbox {sbx.sandbox_id} on traffic") == 1
    finally:
        kill_quietly(sbx)


def test_paused_sandbox_without_auto_resume_stays_paused(server) -> None:
    sbx = Sandbox.create(timeout=600, metadata={"suite": "proxy"})
    try:
        start_app(sbx, server)
        sbx.pause()
        wait_state(sbx, "paused")
        r = requests.get(f"{server.sandbox_url}/hello", headers=route(sbx), timeout=30)
        assert r.status_code == 502
        body = r.json()
        assert body["sandboxId"] == sbx.sandbox_id and "was not found" in body["message"] and "paused" in body["message"]
        assert sbx.get_info().state.value == "paused"
        assert log_count(server, rf"resumed sandbox {sbx.sandbox_id}\b") == 0
    finally:
        kill_quietly(sbx)
