"""TrafficProxy against real aiohttp servers on loopback that stand in for sandbox ports."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import socket
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import requests
from aiohttp import web
from e2b.sandbox.signature import get_signature

from agentenv.constants import ENVD_PORT
from agentenv.errors import Unavailable
from agentenv.proxy import LISTENER_OPTIONS, SandboxRoute, TrafficProxy

pytestmark = pytest.mark.timeout(60)

MIB = 1024 * 1024
USER_PORT = 8080
CLOSED_PORT = 3000  # mapped to a loopback port nobody listens on
BLACKHOLE_PORT = 4000  # mapped to a listener whose accept queue is full (connect times out)


def pattern(size: int) -> Iterable[bytes]:
    """Deterministic, non-repeating test data produced in 1 MiB blocks."""
    block, i = 0, 0
    while i < size:
        seed = hashlib.sha256(block.to_bytes(8, "big")).digest()
        chunk = (seed * (MIB // len(seed)))[: min(MIB, size - i)]
        yield chunk
        i += len(chunk)
        block += 1


def sha_of(chunks: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


# --------------------------------------------------------------------------- upstream "sandbox"


@dataclass
class Upstream:
    name: str
    port: int = 0
    events: defaultdict[str, asyncio.Event] = field(default_factory=lambda: defaultdict(asyncio.Event))
    cancelled: set[str] = field(default_factory=set)
    runner: web.AppRunner | None = None


def upstream_app(up: Upstream) -> web.Application:
    async def whoami(request: web.Request) -> web.Response:
        return web.json_response({"name": up.name, "path_qs": request.path_qs, "method": request.method})

    async def echo_headers(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        return web.json_response(
            {"headers": [[k, v] for k, v in request.headers.items()], "peer_port": peer[1] if peer else None}
        )

    async def upload(request: web.Request) -> web.Response:
        h, size = hashlib.sha256(), 0
        key = request.query.get("key")
        async for chunk in request.content.iter_any():
            if size == 0 and key:
                up.events[key + "-first"].set()
            h.update(chunk)
            size += len(chunk)
        return web.json_response(
            {
                "size": size,
                "sha256": h.hexdigest(),
                "content_length": request.headers.get("Content-Length"),
                "transfer_encoding": request.headers.get("Transfer-Encoding"),
                "content_encoding": request.headers.get("Content-Encoding"),
            }
        )

    async def download(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "application/octet-stream"
        await resp.prepare(request)
        for chunk in pattern(int(request.query["size"])):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def slow(request: web.Request) -> web.StreamResponse:
        """First part, then wait until the test saw it, then the rest."""
        key = request.query["key"]
        resp = web.StreamResponse(headers={"Content-Type": request.query.get("ct", "text/plain")})
        await resp.prepare(request)
        try:
            await resp.write(request.query.get("first", "first-part").encode())
            await asyncio.wait_for(up.events[key].wait(), 20)
            await resp.write(request.query.get("rest", "rest").encode())
            await resp.write_eof()
        except asyncio.CancelledError:
            up.cancelled.add(key)
            raise
        return resp

    async def gzipped(request: web.Request) -> web.Response:
        body = gzip.compress(b"hello compressed world\n" * 1000)
        return web.Response(body=body, headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse(protocols=("echo.v1",))
        await sock.prepare(request)
        async for msg in sock:
            if msg.type == aiohttp.WSMsgType.TEXT:
                if msg.data == "bye":
                    await sock.close(code=4001, message=b"bye")
                else:
                    await sock.send_str(f"{up.name}:{msg.data}")
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await sock.send_bytes(msg.data[::-1])
        return sock

    async def set_cookies(request: web.Request) -> web.Response:
        resp = web.Response(text="ok", headers={"X-Upstream": "yes"})
        resp.headers.add("Set-Cookie", "a=1; Path=/")
        resp.headers.add("Set-Cookie", "b=2; Path=/")
        return resp

    async def dies(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"partial")
        await asyncio.sleep(0.1)
        assert request.transport is not None
        request.transport.close()  # the sandbox goes away mid-response
        await asyncio.sleep(0.1)
        return resp

    async def no_content(request: web.Request) -> web.Response:
        return web.Response(status=204, headers={"X-Method": request.method})

    app = web.Application()
    app.router.add_route("*", "/no-content", no_content)
    app.router.add_get("/dies", dies)
    app.router.add_get("/set-cookies", set_cookies)
    app.router.add_get("/whoami", whoami)
    app.router.add_get("/", whoami)
    app.router.add_get("/files", whoami)
    app.router.add_post("/files", whoami)
    app.router.add_get("/echo-headers", echo_headers)
    app.router.add_post("/upload", upload)
    app.router.add_get("/download", download)
    app.router.add_get("/slow", slow)
    app.router.add_get("/gzip", gzipped)
    app.router.add_get("/ws", ws)
    return app


async def start(app: web.Application, **kwargs: object) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, **kwargs)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, port


# --------------------------------------------------------------------------- resolver + proxy


class DictResolver:
    def __init__(self) -> None:
        self.routes: dict[str, SandboxRoute] = {}

    async def resolve(self, sandbox_id: str) -> SandboxRoute | None:
        if sandbox_id == "cannotwake":  # what the orchestrator does when an auto-resume fails
            raise Unavailable("node is at capacity (2 sandboxes); retry later", error_code="capacity_exhausted")
        return self.routes.get(sandbox_id)

    def running_routes(self) -> Iterable[SandboxRoute]:
        return [r for r in self.routes.values() if r.state == "running"]


@dataclass
class Env:
    url: str
    proxy: TrafficProxy
    resolver: DictResolver
    upstreams: dict[str, Upstream]


async def serve_proxy(proxy: TrafficProxy) -> tuple[web.AppRunner, str]:
    """The way the real server mounts it: one listener, proxy first, control API otherwise."""

    async def dispatch(request: web.Request) -> web.StreamResponse:
        if proxy.matches(request):
            return await proxy.handle(request)
        return web.json_response({"plane": "control"}, status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", dispatch)
    runner, port = await start(app, **LISTENER_OPTIONS)
    return runner, f"http://127.0.0.1:{port}"


def free_closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="module")
async def env() -> AsyncIterator[Env]:
    upstreams = {name: Upstream(name) for name in ("sbxa", "sbxb", "sbxc", "sbxd")}
    runners: list[web.AppRunner] = []
    blackhole = socket.socket()
    fillers: list[socket.socket] = []
    proxy: TrafficProxy | None = None
    try:
        for up in upstreams.values():
            # Like envd: no request decompression, and cancel handlers when the peer goes away.
            up.runner, up.port = await start(upstream_app(up), handler_cancellation=True, auto_decompress=False)
            runners.append(up.runner)
        closed_port = free_closed_port()
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(0)
        for _ in range(4):  # fill the accept queue so further SYNs are dropped
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(blackhole.getsockname())
            fillers.append(c)

        resolver = DictResolver()
        for name in upstreams:
            resolver.routes[name] = SandboxRoute(name, "127.0.0.1", "running", f"envd-token-{name}", None)
        resolver.routes["sbxc"].traffic_access_token = "traffic-secret"
        resolver.routes["pausedone"] = SandboxRoute("pausedone", None, "paused", "envd-token-p", None)

        def port_override(route: SandboxRoute, port: int) -> tuple[str, int]:
            if port in (ENVD_PORT, USER_PORT):
                return "127.0.0.1", upstreams[route.sandbox_id].port
            if port == BLACKHOLE_PORT:
                return "127.0.0.1", blackhole.getsockname()[1]
            return "127.0.0.1", closed_port

        proxy = TrafficProxy(resolver, domain="example.test", connect_timeout=1.0, port_override=port_override)
        runner, url = await serve_proxy(proxy)
        runners.append(runner)
        yield Env(url, proxy, resolver, upstreams)
    finally:
        if proxy is not None:
            await proxy.close()
        for r in reversed(runners):
            await r.cleanup()
        for c in fillers:
            c.close()
        blackhole.close()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        yield session


def sbx(sandbox_id: str, port: int = ENVD_PORT, **extra: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port), **extra}


# --------------------------------------------------------------------------- routing + errors


async def test_header_routing_picks_sandbox_and_port(env: Env, client: aiohttp.ClientSession) -> None:
    for name in ("sbxa", "sbxb"):
        async with client.get(f"{env.url}/whoami?x=1%202", headers=sbx(name)) as r:
            assert r.status == 200
            body = await r.json()
            assert body == {"name": name, "path_qs": "/whoami?x=1%202", "method": "GET"}
    # default port is envd's
    async with client.get(f"{env.url}/whoami", headers={"E2b-Sandbox-Id": "sbxb"}) as r:
        assert (await r.json())["name"] == "sbxb"
    # without routing information it is control-plane traffic
    async with client.get(f"{env.url}/whoami") as r:
        assert (await r.json()) == {"plane": "control"}


async def test_host_routing(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/whoami", headers={"Host": f"{USER_PORT}-sbxa.example.test"}) as r:
        assert (await r.json())["name"] == "sbxa"
    async with client.get(f"{env.url}/whoami", headers={"Host": f"{ENVD_PORT}-sbxb.elsewhere.dev:3000"}) as r:
        assert (await r.json())["name"] == "sbxb"
    async with client.get(f"{env.url}/whoami", headers={"Host": "api.example.test"}) as r:
        assert (await r.json()) == {"plane": "control"}


async def test_not_found_is_502_with_e2b_body(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/health", headers=sbx("doesnotexist")) as r:
        assert r.status == 502
        assert await r.json() == {"sandboxId": "doesnotexist", "message": "The sandbox was not found", "code": 502}


async def test_paused_without_auto_resume_is_502_that_the_sdk_reads_as_not_running(
        env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/health", headers=sbx("pausedone")) as r:
        assert r.status == 502
        body = await r.json()
    assert body["sandboxId"] == "pausedone" and body["code"] == 502
    # The SDKs key on this substring (SandboxNotRunning / is_running() False); the rest says why.
    assert "was not found" in body["message"] and "paused" in body["message"]


async def test_path_routing(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/proxy/sbxb/{USER_PORT}/whoami?x=1%202&y=") as r:
        assert r.status == 200
        assert await r.json() == {"name": "sbxb", "path_qs": "/whoami?x=1%202&y=", "method": "GET"}
    async with client.get(f"{env.url}/proxy/sbxa/{USER_PORT}") as r:
        assert await r.json() == {"name": "sbxa", "path_qs": "/", "method": "GET"}  # no path: "/"
    async with client.get(f"{env.url}/proxy/sbxa/{USER_PORT}/echo-headers") as r:
        got = {k.lower(): v for k, v in (await r.json())["headers"]}
    assert got["x-forwarded-prefix"] == f"/proxy/sbxa/{USER_PORT}"
    body = b"x" * 100_000
    async with client.post(f"{env.url}/proxy/sbxb/{USER_PORT}/upload", data=body) as r:
        assert (await r.json())["sha256"] == hashlib.sha256(body).hexdigest()
    async with client.ws_connect(f"{env.url}/proxy/sbxd/{USER_PORT}/ws", protocols=("echo.v1",)) as ws:
        await ws.send_str("hi")
        assert (await ws.receive()).data == "sbxd:hi"
    for bad in ("/proxy/sbxa", "/proxy/sbxa/http/x", "/proxy/SBXA/80/", "/proxy/sbxa/99999/"):
        async with client.get(f"{env.url}{bad}") as r:
            assert r.status == 400, bad
            assert "/proxy/<sandboxID>/<port>/<path>" in (await r.json())["message"]
    async with client.get(f"{env.url}/proxy/sbxc/{USER_PORT}/whoami") as r:  # private: token needed
        assert r.status == 403


async def test_failed_wake_is_503_with_the_reason(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/proxy/cannotwake/{USER_PORT}/") as r:
        assert r.status == 503
        body = await r.json()
    assert body["sandboxId"] == "cannotwake" and body["code"] == 503
    assert body["message"] == "The sandbox could not be resumed: node is at capacity (2 sandboxes); retry later"


async def test_port_not_open_is_502(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/", headers=sbx("sbxa", CLOSED_PORT)) as r:
        assert r.status == 502
        assert await r.json() == {
            "sandboxId": "sbxa",
            "message": "The sandbox is running but port is not open",
            "code": 502,
        }


async def test_connect_timeout_is_504(env: Env, client: aiohttp.ClientSession) -> None:
    started = time.monotonic()
    async with client.get(f"{env.url}/", headers=sbx("sbxa", BLACKHOLE_PORT)) as r:
        assert r.status == 504
        body = await r.json()
    assert body["code"] == 504 and body["sandboxId"] == "sbxa"
    assert time.monotonic() - started < 5


async def test_bad_port_header_is_400(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/", headers=sbx("sbxa") | {"E2b-Sandbox-Port": "http"}) as r:
        assert r.status == 400


async def test_traffic_token_enforced_except_on_envd_port(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/whoami", headers=sbx("sbxc", USER_PORT)) as r:
        assert r.status == 403
        assert (await r.json())["sandboxId"] == "sbxc"
    wrong = sbx("sbxc", USER_PORT, **{"E2B-Traffic-Access-Token": "nope"})
    async with client.get(f"{env.url}/whoami", headers=wrong) as r:
        assert r.status == 403
    right = sbx("sbxc", USER_PORT, **{"E2B-Traffic-Access-Token": "traffic-secret"})
    async with client.get(f"{env.url}/whoami", headers=right) as r:
        assert r.status == 200 and (await r.json())["name"] == "sbxc"
    async with client.get(f"{env.url}/whoami", headers=sbx("sbxc", ENVD_PORT)) as r:
        assert r.status == 200
    # The token is ours: checked here, not handed to the sandbox.
    async with client.get(f"{env.url}/echo-headers", headers=right) as r:
        got = {k.lower() for k, _ in (await r.json())["headers"]}
    assert "e2b-traffic-access-token" not in got


async def test_authorization_carrying_an_api_key_is_not_forwarded(env: Env, client: aiohttp.ClientSession) -> None:
    for value, forwarded in (("Bearer e2b_0123abcd", False), ("e2b_0123abcd", False),
                             ("Bearer app-token", True), ("Basic dXNlcjo=", True)):
        async with client.get(f"{env.url}/echo-headers", headers=sbx("sbxa", USER_PORT, Authorization=value)) as r:
            got = {k.lower(): v for k, v in (await r.json())["headers"]}
        assert (got.get("authorization") == value) is forwarded, value


# --------------------------------------------------------------------------- headers


async def test_headers_forwarded_api_key_and_hop_by_hop_stripped(env: Env, client: aiohttp.ClientSession) -> None:
    sent = {
        "X-API-KEY": "e2b_secret",
        "X-Access-Token": "envd-token-sbxa",
        "Authorization": "Basic dXNlcjo=",
        "Connect-Protocol-Version": "1",
        "Keepalive-Ping-Interval": "50",
        "X-Custom": "a, b",
        "Connection": "keep-alive, X-Drop-Me",
        "X-Drop-Me": "1",
    }
    no_auto = ["Accept", "Accept-Encoding", "User-Agent"]
    async with client.get(f"{env.url}/echo-headers", headers=sbx("sbxa", **sent), skip_auto_headers=no_auto) as r:
        body = await r.json()
    got = {k.lower(): v for k, v in body["headers"]}
    assert "x-api-key" not in got
    assert "x-drop-me" not in got and "connection" not in got
    for key in ("X-Access-Token", "Authorization", "Connect-Protocol-Version", "Keepalive-Ping-Interval", "X-Custom"):
        assert got[key.lower()] == sent[key]
    assert got["x-forwarded-for"] == "127.0.0.1"
    assert got["x-forwarded-proto"] == "http"
    # nothing invented on the way (an added Accept-Encoding would make envd gzip the response)
    for key in no_auto:
        assert key.lower() not in got


async def test_response_headers_kept_and_cookies_not_shared(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/set-cookies", headers=sbx("sbxa")) as r:
        assert r.headers.getall("Set-Cookie") == ["a=1; Path=/", "b=2; Path=/"]
        assert r.headers["X-Upstream"] == "yes"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as other:
        async with other.get(f"{env.url}/echo-headers", headers=sbx("sbxa")) as r:
            got = {k.lower(): v for k, v in (await r.json())["headers"]}
    assert "cookie" not in got


async def test_head_204_and_content_length(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/gzip", headers=sbx("sbxa")) as r:
        body = await r.read()
        assert r.headers["Content-Length"] == str(len(body))
        assert "Transfer-Encoding" not in r.headers
    async with client.head(f"{env.url}/gzip", headers=sbx("sbxa")) as r:
        assert r.status == 200
        assert r.headers["Content-Length"] == str(len(body))
        assert await r.read() == b""
    for method in ("DELETE", "PUT"):
        async with client.request(method, f"{env.url}/no-content", headers=sbx("sbxa")) as r:
            assert r.status == 204 and r.headers["X-Method"] == method
    async with client.get(f"{env.url}/whoami", headers=sbx("sbxa")) as r:  # connection still usable
        assert r.status == 200


async def test_upstream_connections_are_reused(env: Env, client: aiohttp.ClientSession) -> None:
    peers = []
    for _ in range(3):
        async with client.get(f"{env.url}/echo-headers", headers=sbx("sbxa")) as r:
            peers.append((await r.json())["peer_port"])
    assert len(set(peers)) == 1


# --------------------------------------------------------------------------- bodies


async def test_large_download_streams(env: Env, client: aiohttp.ClientSession) -> None:
    size = 60 * MIB
    h, got = hashlib.sha256(), 0
    async with client.get(f"{env.url}/download?size={size}", headers=sbx("sbxa")) as r:
        assert r.status == 200
        async for chunk in r.content.iter_chunked(MIB):
            h.update(chunk)
            got += len(chunk)
    assert got == size
    assert h.hexdigest() == sha_of(pattern(size))


async def test_large_chunked_upload_streams(env: Env, client: aiohttp.ClientSession) -> None:
    size = 60 * MIB
    key = "upload-stream"
    up = env.upstreams["sbxa"]

    async def body() -> AsyncIterator[bytes]:
        chunks = iter(pattern(size))
        yield next(chunks)
        # The sandbox must see the start of the body while the client is still sending.
        await asyncio.wait_for(up.events[key + "-first"].wait(), 10)
        for c in chunks:
            yield c

    async with client.post(f"{env.url}/upload?key={key}", data=body(), headers=sbx("sbxa")) as r:
        result = await r.json()
    assert result["size"] == size
    assert result["sha256"] == sha_of(pattern(size))
    assert result["transfer_encoding"] == "chunked"


async def test_upload_with_content_length(env: Env, client: aiohttp.ClientSession) -> None:
    data = b"".join(pattern(3 * MIB + 17))
    async with client.post(f"{env.url}/upload", data=io.BytesIO(data), headers=sbx("sbxa")) as r:
        result = await r.json()
    assert result["size"] == len(data)
    assert result["content_length"] == str(len(data))
    assert result["sha256"] == hashlib.sha256(data).hexdigest()


async def test_chunked_upload_with_requests(env: Env) -> None:
    parts = [b"alpha-" * 1000, b"beta-" * 10, b"gamma"]

    def run() -> dict:
        r = requests.post(f"{env.url}/upload", data=iter(parts), headers=sbx("sbxb"), timeout=10)
        r.raise_for_status()
        return r.json()

    result = await asyncio.to_thread(run)
    assert result["size"] == sum(map(len, parts))
    assert result["sha256"] == sha_of(parts)
    assert result["transfer_encoding"] == "chunked"


async def test_gzip_bodies_pass_through_untouched(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/gzip", headers=sbx("sbxa")) as r:
        raw = await r.read()
        assert r.headers["Content-Encoding"] == "gzip"
    assert raw[:2] == b"\x1f\x8b"
    assert gzip.decompress(raw) == b"hello compressed world\n" * 1000

    compressed = gzip.compress(b"payload " * 5000)
    headers = sbx("sbxa", **{"Content-Encoding": "gzip", "Content-Type": "application/octet-stream"})
    async with client.post(f"{env.url}/upload", data=compressed, headers=headers) as r:
        result = await r.json()
    assert result["content_encoding"] == "gzip"
    assert result["sha256"] == hashlib.sha256(compressed).hexdigest()


# --------------------------------------------------------------------------- streaming


async def test_first_bytes_arrive_before_upstream_finishes(env: Env, client: aiohttp.ClientSession) -> None:
    up = env.upstreams["sbxa"]
    async with client.get(f"{env.url}/slow?key=flush", headers=sbx("sbxa")) as r:
        first = await asyncio.wait_for(r.content.readexactly(len(b"first-part")), 5)
        assert first == b"first-part"
        up.events["flush"].set()  # only now may the upstream finish
        assert await asyncio.wait_for(r.content.read(), 5) == b"rest"


async def test_sse_events_are_flushed(env: Env, client: aiohttp.ClientSession) -> None:
    up = env.upstreams["sbxb"]
    query = "key=sse&ct=text/event-stream&first=data%3A%20one%0A%0A&rest=data%3A%20two%0A%0A"
    async with client.get(f"{env.url}/slow?{query}", headers=sbx("sbxb", USER_PORT)) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5) == b"data: one\n\n"
        up.events["sse"].set()
        assert await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5) == b"data: two\n\n"


async def test_client_disconnect_cancels_upstream(env: Env) -> None:
    up = env.upstreams["sbxb"]
    async with aiohttp.ClientSession() as session:
        r = await session.get(f"{env.url}/slow?key=hangup", headers=sbx("sbxb"))
        assert await asyncio.wait_for(r.content.readexactly(4), 5) == b"firs"
        r.close()  # drop the client connection mid-stream
    deadline = time.monotonic() + 3
    while "hangup" not in up.cancelled and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert "hangup" in up.cancelled


async def test_upstream_death_truncates_client_response(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.get(f"{env.url}/dies", headers=sbx("sbxb")) as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(r.read(), 5)
    async with client.get(f"{env.url}/whoami", headers=sbx("sbxb")) as r:
        assert r.status == 200


async def test_websocket_echo(env: Env, client: aiohttp.ClientSession) -> None:
    async with client.ws_connect(f"{env.url}/ws", headers=sbx("sbxa", USER_PORT), protocols=("echo.v1",)) as ws:
        assert ws.protocol == "echo.v1"
        await ws.send_str("hi")
        assert (await ws.receive(timeout=5)).data == "sbxa:hi"
        await ws.send_bytes(b"\x00\x01\x02")
        assert (await ws.receive(timeout=5)).data == b"\x02\x01\x00"
        await ws.send_str("bye")
        msg = await ws.receive(timeout=5)
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 4001


# --------------------------------------------------------------------------- signed /files URLs


def signed_url(base: str, path: str, op: str, token: str, user: str | None = None, exp: int | None = None) -> str:
    sig = get_signature(path, op, user, token, exp)  # the SDK's own signer
    params = {"path": path, "signature": sig["signature"]}
    if user:
        params["username"] = user
    if sig["expiration"]:
        params["signature_expiration"] = str(sig["expiration"])
    return str(aiohttp.client.URL(f"{base}/files").with_query(params))


async def test_signed_files_urls_route_to_the_right_sandbox(env: Env, client: aiohttp.ClientSession) -> None:
    for name in ("sbxa", "sbxb", "sbxd"):
        token = env.resolver.routes[name].envd_access_token
        assert token
        url = signed_url(env.url, "/home/user/a b.txt", "read", token)
        async with client.get(url) as r:
            assert r.status == 200 and (await r.json())["name"] == name
        url = signed_url(env.url, "data.bin", "write", token, user="root", exp=600)
        async with client.post(url, data=b"x") as r:
            assert r.status == 200 and (await r.json())["name"] == name
    # signature for "read" does not route a write; a foreign token or no signature gives 401
    read_url = signed_url(env.url, "f", "read", "envd-token-sbxa")
    async with client.post(read_url, data=b"x") as r:
        assert r.status == 401
    async with client.get(signed_url(env.url, "f", "read", "unknown-token")) as r:
        assert r.status == 401 and (await r.json())["code"] == 401
    async with client.get(f"{env.url}/files?path=f") as r:
        assert r.status == 401


# --------------------------------------------------------------------------- checkpoint support


def tcp_sockets(port: int) -> list[tuple[str, int, int]]:
    """(state, local_port, remote_port) of IPv4 sockets touching `port` (from /proc/net/tcp)."""
    states = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, st = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16), fields[3]
        if port in (local, remote):
            out.append((states.get(st, st), local, remote))
    return out


async def test_close_sandbox_connections_leaves_no_connection(env: Env) -> None:
    up = env.upstreams["sbxd"]
    async with aiohttp.ClientSession() as session:
        # an idle pooled connection, an in-flight stream and a WebSocket towards the sandbox
        async with session.get(f"{env.url}/whoami", headers=sbx("sbxd")) as r:
            assert r.status == 200
        stream = await session.get(f"{env.url}/slow?key=ckpt", headers=sbx("sbxd"))
        assert await asyncio.wait_for(stream.content.readexactly(4), 5) == b"firs"
        ws = await session.ws_connect(f"{env.url}/ws", headers=sbx("sbxd", USER_PORT))
        await ws.send_str("x")
        assert (await ws.receive(timeout=5)).data == "sbxd:x"

        established = [s for s in tcp_sockets(up.port) if s[0] == "ESTABLISHED"]
        assert len(established) >= 4  # both ends of >= 2 upstream connections

        env.resolver.routes["sbxd"].state = "pausing"
        try:
            await env.proxy.close_sandbox_connections("sbxd")
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(stream.content.read(), 5)
            assert (await ws.receive(timeout=5)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                remaining = [s for s in tcp_sockets(up.port) if s[0] != "LISTEN"]
                if not [s for s in remaining if s[0] in ("ESTABLISHED", "CLOSE_WAIT")]:
                    break
                await asyncio.sleep(0.05)
            remaining = [s for s in tcp_sockets(up.port) if s[0] != "LISTEN"]
            assert not [s for s in remaining if s[0] == "ESTABLISHED"], remaining
            # The proxy closed first: any TIME_WAIT is on the proxy's side, none on the sandbox port.
            assert not [s for s in remaining if s[0] == "TIME_WAIT" and s[1] == up.port], remaining
            # while not running, new requests get the not-found answer and open nothing
            async with session.get(f"{env.url}/whoami", headers=sbx("sbxd")) as r:
                assert r.status == 502
                assert "was not found" in (await r.json())["message"]
        finally:
            stream.close()
            await ws.close()
            env.resolver.routes["sbxd"].state = "running"
        async with session.get(f"{env.url}/whoami", headers=sbx("sbxd")) as r:
            assert r.status == 200  # and traffic flows again after the "checkpoint"


async def test_stats_count_traffic(env: Env, client: aiohttp.ClientSession) -> None:
    before = env.proxy.stats.bytes_from_sandbox, env.proxy.stats.requests, env.proxy.stats.errors["not_found"]
    async with client.get(f"{env.url}/download?size=1000", headers=sbx("sbxa")) as r:
        assert len(await r.read()) == 1000
    async with client.get(f"{env.url}/", headers=sbx("nosuchbox")) as r:
        assert r.status == 502
    s = env.proxy.stats
    assert s.bytes_from_sandbox - before[0] == 1000
    assert s.requests - before[1] == 2
    assert s.errors["not_found"] - before[2] == 1
    json.dumps(s.errors)  # plain, serialisable


async def test_idle_upstream_connections_are_closed_by_the_proxy(env: Env) -> None:
    """Keep-alive connections expire on the proxy side, so the sandbox never holds a TIME_WAIT."""
    up = Upstream("idle")
    up.runner, up.port = await start(upstream_app(up), auto_decompress=False)
    resolver = DictResolver()
    resolver.routes["idle"] = SandboxRoute("idle", "127.0.0.1", "running", "t", None)
    proxy = TrafficProxy(resolver, port_override=lambda route, port: ("127.0.0.1", up.port), idle_timeout=0.2)
    runner, url = await serve_proxy(proxy)
    # /proc/net/tcp is netns-wide: sockets of earlier tests may carry the same port number.
    stale = {s for s in tcp_sockets(up.port) if s[0] != "LISTEN"}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/whoami", headers=sbx("idle")) as r:
                assert r.status == 200
            async with session.ws_connect(f"{url}/ws", headers=sbx("idle", USER_PORT)) as ws:
                await ws.send_str("x")
                assert (await ws.receive(timeout=5)).data == "idle:x"
            async with session.get(f"{url}/whoami", headers=sbx("idle")) as r:  # pooled again
                assert r.status == 200
            assert [s for s in tcp_sockets(up.port) if s[0] == "ESTABLISHED"]
            deadline = time.monotonic() + 3
            while [s for s in tcp_sockets(up.port) if s[0] not in ("LISTEN", "TIME_WAIT") and s not in stale]:
                assert time.monotonic() < deadline, (tcp_sockets(up.port), stale)
                await asyncio.sleep(0.05)
        assert not [s for s in tcp_sockets(up.port) if s[0] == "TIME_WAIT" and s[1] == up.port]
    finally:
        await proxy.close()
        await runner.cleanup()
        await up.runner.cleanup()
