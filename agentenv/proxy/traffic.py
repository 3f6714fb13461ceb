"""Data-plane reverse proxy: forwards SDK traffic (envd, Jupyter, user ports) into sandboxes.

One listener serves the control API and E2B_SANDBOX_URL; `TrafficProxy.matches` tells sandbox
traffic apart (routing headers, `<port>-<id>.` Host, a `/proxy/<id>/<port>/...` path, or a signed
`/files` URL) and `handle` forwards it with raw, streaming bodies in both directions. docs/proxy.md
describes the routing forms, credentials and errors for users.

The listener must be created with ``auto_decompress=False`` (see `LISTENER_OPTIONS`), otherwise
aiohttp inflates gzip request bodies before we can pass them through untouched.

gVisor cannot checkpoint a sandbox that holds a non-listening TCP socket (including TIME_WAIT
after a close it initiated), so every upstream connection is closed from the proxy side: idle
pooled connections expire here before typical server idle timeouts, and
`close_sandbox_connections` drops everything towards one sandbox right before a checkpoint. The
closes are resets (SO_LINGER 0): the sandbox's endpoint goes straight to CLOSED, with no FIN
exchange that could leave it in TIME_WAIT (which would hold a pause off for 60 s).
"""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import hmac
import logging
import re
import socket
import struct
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import WSMsgType, web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from agentenv.constants import ENVD_PORT
from agentenv.proxy.hostfiles import (HOST_READ_HEADER, HOST_TOKEN_HEADER, HOST_WRITE_HEADER, MIN_BYTES, STAGED_HEADER,
                                     HostFiles, HostTransfer)

log = logging.getLogger(__name__)

# Bodies are relayed in pieces of up to this many bytes each way: aiohttp's 64 KiB default made a
# proxied 64 MiB download half as fast as a direct one (docs/benchmarks.md, files). A stream buffers at
# most twice this before its reader pauses the socket, so a slow client costs this much memory per
# transfer, not the whole body.
RELAY_BUFSIZE = 1 << 20

# Pass to web.AppRunner / web.run_app for the listener that hosts the proxy (raw body passthrough).
LISTENER_OPTIONS: dict[str, Any] = {"auto_decompress": False, "read_bufsize": RELAY_BUFSIZE}

SANDBOX_ID_HEADER = "E2b-Sandbox-Id"
SANDBOX_PORT_HEADER = "E2b-Sandbox-Port"
TRAFFIC_TOKEN_HEADER = "E2B-Traffic-Access-Token"

PATH_PREFIX = "/proxy/"
# The prefix a path-routed request had, for apps that build absolute links (`X-Forwarded-Prefix`).
FORWARDED_PREFIX_HEADER = "X-Forwarded-Prefix"

_HOST_LABEL = re.compile(r"^(\d+)-([a-z0-9]+)$")
_PATH_ROUTE = re.compile(r"^/proxy/([a-z0-9]+)/(\d{1,5})(/[^?]*)?(\?.*)?$", re.S)
# `Authorization` values that carry one of our API keys: meant for the control API, never forwarded.
_API_KEY_AUTH = re.compile(r"^(?:bearer\s+)?e2b_[0-9a-f]+\s*$", re.I)
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
        "TE", "Trailer", "Transfer-Encoding", "Upgrade",
    )
)
# Never forwarded upstream: the API key is not a data-plane credential, the traffic token is ours
# (checked here, of no use to the sandbox), and Expect was already answered by our own listener.
# The host token is the orchestrator's credential for envd (re-init, connection checks); only the
# host adds it here, to its own requests (`hostfiles`). Code inside any sandbox can read it (it is in
# envd's environment), so a client presenting it must not reach another sandbox's envd; nor may a
# client send the host's own requests to envd (the host-read, host-write and staged headers).
_STRIP_REQUEST = frozenset({"x-api-key", "expect", TRAFFIC_TOKEN_HEADER.lower(), HOST_TOKEN_HEADER.lower(),
                            HOST_READ_HEADER.lower(), HOST_WRITE_HEADER.lower(), STAGED_HEADER.lower()})
# Headers aiohttp's client would otherwise invent; we forward exactly what the client sent.
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_WS_HANDSHAKE = frozenset(
    {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-protocol"}
)
# Responses up to this size with a Content-Length are read whole and sent with their headers.
SMALL_BODY = 64 * 1024
# How often an idle stream checks whether its client went away (aiohttp gives no callback).
_CLIENT_POLL_S = 0.25


@dataclass
class SandboxRoute:
    """What the proxy needs to know about one sandbox, as the orchestrator sees it now."""

    sandbox_id: str
    host_ip: str | None  # None when not running (paused, starting, dead)
    state: str  # "running" | "paused" | ...
    envd_access_token: str | None
    traffic_access_token: str | None


class SandboxResolver(Protocol):
    """Route lookup supplied by the orchestrator (`resolve` may e.g. auto-resume a paused sandbox)."""

    async def resolve(self, sandbox_id: str) -> SandboxRoute | None: ...

    def running_routes(self) -> Iterable[SandboxRoute]: ...


@dataclass
class ProxyStats:
    """Plain counters, read by the metrics endpoint later."""

    requests: int = 0
    websockets: int = 0
    active: int = 0
    bytes_to_sandbox: int = 0
    bytes_from_sandbox: int = 0
    # error kind -> count: not_found, port_closed, timeout, forbidden, unauthorized, bad_request,
    # upstream_closed, client_disconnect, aborted
    errors: Counter[str] = field(default_factory=Counter)
    files_from_host: int = 0  # downloads sent from the sandbox's disk on the host (`hostfiles`)
    files_to_host: int = 0    # uploads the host staged in the sandbox's root dir (`hostfiles`)


def file_signature(path: str, operation: str, username: str, token: str, expiration: str | None) -> str:
    """Signature of a `/files` URL (protocol 4.5.4); used only to find which sandbox a URL is for."""
    raw = f"{path}:{operation}:{username}:{token}"
    if expiration:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


_WS = web.WebSocketResponse | aiohttp.ClientWebSocketResponse


@dataclass(frozen=True)
class _Target:
    """Where one request goes: sandbox, port, and the raw path + query to send upstream."""

    sandbox_id: str
    port: int
    raw_path: str
    prefix: str | None = None  # the /proxy/<id>/<port> prefix a path-routed request had


@dataclass(eq=False)
class _Flight:
    """One request being proxied; lets us cancel it from outside and know why."""

    task: asyncio.Task[Any]
    sandbox_id: str
    request: web.BaseRequest
    reason: str | None = None  # set when *we* cancel the task
    response: web.StreamResponse | None = None  # once headers went to the client
    routed: bool = False  # resolved to a running sandbox: may hold a connection into it

    def abort(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.task.cancel()


class _CoalescedResponse(web.StreamResponse):
    """A StreamResponse whose headers go out with the body in one write (as aiohttp's own
    web.Response does), without web.Response's defaults such as a Content-Type the upstream
    did not send."""

    _send_headers_immediately = False


def _error(status: int, message: str, sandbox_id: str | None = None) -> web.Response:
    body: dict[str, Any] = {"code": status, "message": message}
    if sandbox_id is not None:
        body = {"sandboxId": sandbox_id, "message": message, "code": status}
    return web.json_response(body, status=status)


def _not_found(sandbox_id: str) -> web.Response:
    return _error(502, "The sandbox was not found", sandbox_id)


def _resetting_socket(addr_info: Any) -> socket.socket:
    """Upstream sockets close with a reset, so the sandbox never ends up in TIME_WAIT (module doc)."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return sock


def _connection_tokens(headers: CIMultiDictProxy[str]) -> set[str]:
    tokens = set(_HOP_BY_HOP)
    for value in headers.getall("Connection", []):
        tokens.update(t.strip().lower() for t in value.split(",") if t.strip())
    return tokens


class TrafficProxy:
    """Reverse proxy for sandbox traffic. Create once per listener; `close()` on shutdown."""

    strip_request: frozenset[str] = _STRIP_REQUEST  # request headers never sent on

    def __init__(
        self,
        resolver: SandboxResolver,
        *,
        domain: str | None = None,
        connect_timeout: float = 5.0,
        port_override: Callable[[SandboxRoute, int], tuple[str, int]] | None = None,
        idle_timeout: float = 2.0,
        host_files: HostFiles | None = None,
    ) -> None:
        """`idle_timeout`: pooled upstream connections are closed by us after 1-2x this long idle,
        i.e. before common server keep-alive timeouts (5 s) make the sandbox close them first.
        `host_files`: large downloads from sandboxes that share their rootfs with the host are sent
        from it (`agentenv.proxy.hostfiles`)."""
        self._resolver = resolver
        self._host_files = host_files
        self._domain = domain.lower() if domain else None
        self._connect_timeout = connect_timeout
        self._port_override = port_override
        self._idle_timeout = idle_timeout
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._flights: dict[str, set[_Flight]] = {}
        self._closed = False
        self._watcher: asyncio.Task[None] | None = None
        self.stats = ProxyStats()

    # ------------------------------------------------------------------ routing

    def _host_target(self, request: web.BaseRequest) -> tuple[str, int] | None:
        host = request.headers.get("Host", "").strip().lower()
        if not host or host.startswith("["):
            return None
        if self._domain and host.endswith("." + self._domain):
            label = host[: -len(self._domain) - 1]
        else:
            label = host.split(".", 1)[0].split(":", 1)[0]
        m = _HOST_LABEL.match(label)
        if m is None:
            return None
        return m.group(2), int(m.group(1))

    def matches(self, request: web.BaseRequest) -> bool:
        """True for data-plane requests; everything else belongs to the control API."""
        if request.headers.get(SANDBOX_ID_HEADER):
            return True
        if self._host_target(request) is not None:
            return True
        return request.path == "/files" or request.raw_path.startswith(PATH_PREFIX)

    def _signed_files_target(self, request: web.BaseRequest) -> str | None:
        """Find the running sandbox whose envd token produced this URL's signature."""
        q = request.query
        signature = q.get("signature")
        if not signature:
            return None
        operation = "read" if request.method in ("GET", "HEAD") else "write"
        path, user, exp = q.get("path", ""), q.get("username", ""), q.get("signature_expiration")
        for route in self._resolver.running_routes():
            token = route.envd_access_token
            if token and hmac.compare_digest(file_signature(path, operation, user, token, exp).encode(),
                                             signature.encode()):
                return route.sandbox_id
        return None

    def _target(self, request: web.BaseRequest) -> _Target | web.Response:
        sandbox_id = request.headers.get(SANDBOX_ID_HEADER)
        if sandbox_id:
            raw_port = request.headers.get(SANDBOX_PORT_HEADER, "").strip() or str(ENVD_PORT)
            if not raw_port.isdigit() or not 0 < int(raw_port) < 65536:
                return _error(400, f"Invalid {SANDBOX_PORT_HEADER} header: {raw_port!r}", sandbox_id)
            return _Target(sandbox_id.strip(), int(raw_port), request.raw_path)
        by_host = self._host_target(request)
        if by_host is not None:
            return _Target(*by_host, request.raw_path)
        if request.raw_path.startswith(PATH_PREFIX):
            m = _PATH_ROUTE.match(request.raw_path)
            if m is None or not 0 < int(m.group(2)) < 65536:
                return _error(400, "Path-routed sandbox traffic must look like /proxy/<sandboxID>/<port>/<path>")
            sandbox_id, port, rest, query = m.group(1), int(m.group(2)), m.group(3) or "/", m.group(4) or ""
            return _Target(sandbox_id, port, rest + query, prefix=f"/proxy/{sandbox_id}/{port}")
        sandbox_id = self._signed_files_target(request)
        if sandbox_id is None:
            return _error(401, "The URL is not signed for any running sandbox")
        return _Target(sandbox_id, ENVD_PORT, request.raw_path)

    # ------------------------------------------------------------------ entry point

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Forward one request (HTTP or WebSocket) to the sandbox it addresses."""
        self.stats.requests += 1
        target = self._target(request)
        if isinstance(target, web.Response):
            self.stats.errors["unauthorized" if target.status == 401 else "bad_request"] += 1
            return target
        sandbox_id = target.sandbox_id
        task = asyncio.current_task()
        assert task is not None
        # Registered before resolving, so a concurrent close_sandbox_connections cannot miss it.
        flight = _Flight(task, sandbox_id, request)
        self._flights.setdefault(sandbox_id, set()).add(flight)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch_clients())
        self.stats.active += 1
        try:
            return await self._handle_flight(request, flight, target)
        except asyncio.CancelledError:
            # Only swallow our own cancellation, and only if nobody else cancelled us as well.
            if flight.reason is None or task.uncancel() > 0:
                raise
            self.stats.errors[flight.reason] += 1
            if flight.response is None:
                return _not_found(sandbox_id)
            # Headers are out: cut the connection so the client sees a truncated stream, not a
            # cleanly finished one.
            flight.response.force_close()
            if request.transport is not None:
                request.transport.close()
            return flight.response
        finally:
            self.stats.active -= 1
            flights = self._flights.get(sandbox_id)
            if flights is not None:
                flights.discard(flight)
                if not flights:
                    del self._flights[sandbox_id]

    async def _handle_flight(self, request: web.Request, flight: _Flight, target: _Target) -> web.StreamResponse:
        sandbox_id, port = flight.sandbox_id, target.port
        if self._closed:
            return _error(503, "The proxy is shutting down", sandbox_id)
        try:
            # May wake a paused sandbox that has auto-resume on (and wait for it).
            route = await self._resolver.resolve(sandbox_id)
        except Exception as exc:  # noqa: BLE001 - a failed wake must answer, not crash the request
            self.stats.errors["resume_failed"] += 1
            message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            return _error(503, f"The sandbox could not be resumed: {message}", sandbox_id)
        if route is None or route.state != "running" or not route.host_ip:
            self.stats.errors["not_found"] += 1
            if route is not None and route.state in ("paused", "pausing"):
                return _error(502, "The sandbox was not found: it is paused and auto-resume is off "
                              "(resume it with Sandbox.connect())", sandbox_id)
            return _not_found(sandbox_id)
        if route.traffic_access_token and port != ENVD_PORT:
            given = request.headers.get(TRAFFIC_TOKEN_HEADER, "")
            if not hmac.compare_digest(given.encode(), route.traffic_access_token.encode()):
                self.stats.errors["forbidden"] += 1
                what = "Invalid" if given else "Missing"
                return _error(403, f"{what} {TRAFFIC_TOKEN_HEADER} header: this sandbox is private "
                              "(created with allowPublicTraffic=false)", sandbox_id)
        flight.routed = True
        host, up_port = self._port_override(route, port) if self._port_override else (route.host_ip, port)
        path, _, query = target.raw_path.partition("?")
        url = URL.build(scheme="http", host=host, port=up_port, path=path, query_string=query, encoded=True)

        if self._is_websocket(request):
            return await self._proxy_websocket(request, flight, url, target)
        return await self._proxy_http(request, flight, url, target)

    # ------------------------------------------------------------------ HTTP

    def _session(self, sandbox_id: str) -> aiohttp.ClientSession:
        """One pool per sandbox, so all of a sandbox's connections can be dropped at once."""
        session = self._sessions.get(sandbox_id)
        if session is None or session.closed:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self._idle_timeout,
                                               socket_factory=_resetting_socket),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout),
                auto_decompress=False,
                read_bufsize=RELAY_BUFSIZE,
                cookie_jar=aiohttp.DummyCookieJar(),  # never share cookies between clients
                skip_auto_headers=_NO_AUTO_HEADERS,
                trust_env=False,
                requote_redirect_url=False,
            )
            self._sessions[sandbox_id] = session
        return session

    def _upstream_headers(self, request: web.BaseRequest, target: _Target, *,
                          websocket: bool = False) -> CIMultiDict[str]:
        drop = _connection_tokens(request.headers) | self.strip_request
        if websocket:
            drop |= _WS_HANDSHAKE
        headers = CIMultiDict(
            (k, v) for k, v in request.headers.items()
            if k.lower() not in drop and not (k.lower() == "authorization" and _API_KEY_AUTH.match(v))
        )
        if target.prefix is not None:
            headers[FORWARDED_PREFIX_HEADER] = target.prefix
        remote = request.remote or ""
        prior = request.headers.get("X-Forwarded-For")
        if remote or not prior:  # behind HAProxy (a unix socket) the client is already in `prior`
            headers["X-Forwarded-For"] = f"{prior}, {remote}" if prior else remote
        headers.setdefault("X-Forwarded-Proto", request.scheme)
        if request.host:
            headers.setdefault("X-Forwarded-Host", request.host)
        return headers

    async def _request_body(self, request: web.BaseRequest) -> AsyncIterator[bytes]:
        async for chunk in request.content.iter_any():
            self.stats.bytes_to_sandbox += len(chunk)
            yield chunk

    async def _request(self, request: web.Request, sandbox_id: str, url: URL, headers: CIMultiDict[str], *,
                       body: bool = True) -> aiohttp.ClientResponse | web.Response:
        """Send the request on (`body=False`: without its body); a connection that fails before a
        response is answered here."""
        if not body:
            headers = headers.copy()
            headers.popall("Content-Length", None)
            headers.popall("Transfer-Encoding", None)
        try:
            return await self._session(sandbox_id).request(
                request.method,
                url,
                headers=headers,
                data=self._request_body(request) if body and request.body_exists else None,
                allow_redirects=False,
                compress=None,
            )
        except aiohttp.ConnectionTimeoutError:
            self.stats.errors["timeout"] += 1
            return _error(504, "The sandbox did not accept the connection in time", sandbox_id)
        except aiohttp.ClientConnectorError as exc:
            self.stats.errors["port_closed"] += 1
            if exc.os_error.errno not in (errno.ECONNREFUSED, None):
                log.info("connect to sandbox %s at %s failed: %s", sandbox_id, url.origin(), exc)
            return _error(502, "The sandbox is running but port is not open", sandbox_id)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            return await self._upstream_failed(request, sandbox_id, exc)

    def _shared_root(self, request: web.BaseRequest, target: _Target, url: URL) -> Path | None:
        """The host's view of the sandbox's rootfs, for a download envd may leave to the host or an
        upload the host may stage (`hostfiles`)."""
        if self._host_files is None or target.port != ENVD_PORT or url.path != "/files":
            return None
        if request.method == "GET" and not request.body_exists:
            return self._host_files.root_of(target.sandbox_id)
        if request.method == "POST" and (request.content_length or 0) >= MIN_BYTES:
            return self._host_files.root_of(target.sandbox_id)
        return None

    async def _proxy_http(self, request: web.Request, flight: _Flight, url: URL,
                          target: _Target) -> web.StreamResponse:
        sandbox_id = flight.sandbox_id
        headers = self._upstream_headers(request, target)
        root = self._shared_root(request, target, url)
        if root is not None and self._host_files is not None:
            async def send(to_envd: CIMultiDict[str], body: bool = True,
                           path: str | None = None) -> aiohttp.ClientResponse | web.Response:
                to = url if path is None else URL.build(scheme=url.scheme, host=url.host, port=url.port, path=path,
                                                        query_string=url.raw_query_string, encoded=True)
                return await self._request(request, sandbox_id, to, to_envd, body=body)

            def started(response: web.StreamResponse) -> None:
                flight.response = response

            transfer = HostTransfer(request, sandbox_id, root, self._host_files.host_token, send=send,
                                    relay=lambda upstream: self._relay(request, flight, upstream),
                                    stats=self.stats, started=started)
            return await (transfer.upload(headers) if request.method == "POST" else transfer.download(headers))
        upstream = await self._request(request, sandbox_id, url, headers)
        if isinstance(upstream, web.Response):
            return upstream
        return await self._relay(request, flight, upstream)

    async def _relay(self, request: web.Request, flight: _Flight,
                     upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        sandbox_id = flight.sandbox_id
        try:
            drop = _connection_tokens(upstream.headers)
            if self._is_small(request, upstream):
                return await self._small_response(request, flight, upstream, drop)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in drop:
                    response.headers.add(key, value)
            try:
                await response.prepare(request)
            except ConnectionError:
                self.stats.errors["client_disconnect"] += 1
                return response
            flight.response = response
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                    # Upstream died mid-body: the client must see a truncated response.
                    self.stats.errors["upstream_closed"] += 1
                    log.info("stream from sandbox %s ended early: %s", sandbox_id, exc)
                    response.force_close()
                    if request.transport is not None:
                        request.transport.close()
                    return response
                if not chunk:
                    break
                self.stats.bytes_from_sandbox += len(chunk)
                try:
                    await response.write(chunk)  # waits for the client to drain: no buffering here
                except ConnectionError:
                    self.stats.errors["client_disconnect"] += 1
                    return response
            try:
                await response.write_eof()
            except ConnectionError:
                self.stats.errors["client_disconnect"] += 1
            return response
        finally:
            # After a complete body this returns the connection to the pool; otherwise it closes
            # it from our side (never leaving the close to the sandbox).
            if upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()

    @staticmethod
    def _is_small(request: web.BaseRequest, upstream: aiohttp.ClientResponse) -> bool:
        """A short body of known length: sent together with the headers in one write."""
        length = upstream.content_length
        return (length is not None and length <= SMALL_BODY and request.method != "HEAD"
                and upstream.status not in (204, 304) and 200 <= upstream.status
                and "chunked" not in upstream.headers.get("Transfer-Encoding", "").lower())

    async def _small_response(self, request: web.Request, flight: _Flight, upstream: aiohttp.ClientResponse,
                              drop: set[str]) -> web.StreamResponse:
        """Read a short body whole, then answer with headers + body in one write (one syscall less
        per request than streaming; small responses are most of an API's traffic)."""
        try:
            body = await upstream.content.readexactly(upstream.content_length or 0)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.IncompleteReadError) as exc:
            self.stats.errors["upstream_closed"] += 1
            log.info("response from sandbox %s ended early: %r", flight.sandbox_id, exc)
            return _error(502, "The connection to the sandbox closed in the middle of the response",
                          flight.sandbox_id)
        self.stats.bytes_from_sandbox += len(body)
        response = _CoalescedResponse(status=upstream.status, reason=upstream.reason)
        for key, value in upstream.headers.items():
            if key.lower() not in drop:
                response.headers.add(key, value)
        try:
            await response.prepare(request)
            await response.write_eof(body)
        except ConnectionError:
            self.stats.errors["client_disconnect"] += 1
        return response

    async def _upstream_failed(self, request: web.Request, sandbox_id: str, exc: BaseException) -> web.Response:
        """The connection broke before a response: most likely the sandbox went away meanwhile."""
        route = await self._resolver.resolve(sandbox_id)
        if route is None or route.state != "running":
            self.stats.errors["not_found"] += 1
            return _not_found(sandbox_id)
        self.stats.errors["upstream_closed"] += 1
        log.info("request to sandbox %s failed: %r", sandbox_id, exc)
        if isinstance(exc, aiohttp.ClientPayloadError):  # our client's upload broke off
            return _error(400, "The request body ended early", sandbox_id)
        return _error(502, "The connection to the sandbox closed before a response was received", sandbox_id)

    async def _watch_clients(self) -> None:
        """Abort a flight promptly when its client hangs up while we wait on the sandbox.

        aiohttp only notices a lost client on the next read/write (unless the whole listener
        runs with handler_cancellation), so one shared task polls all in-flight requests.
        """
        while self._flights:
            await asyncio.sleep(_CLIENT_POLL_S)
            for flights in list(self._flights.values()):
                for flight in list(flights):
                    transport = flight.request.transport
                    if transport is None or transport.is_closing():
                        flight.abort("client_disconnect")

    # ------------------------------------------------------------------ WebSocket

    @staticmethod
    def _is_websocket(request: web.BaseRequest) -> bool:
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return False
        return "upgrade" in {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}

    async def _proxy_websocket(self, request: web.Request, flight: _Flight, url: URL,
                               target: _Target) -> web.StreamResponse:
        sandbox_id = flight.sandbox_id
        protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        try:
            upstream = await self._session(sandbox_id).ws_connect(
                url,
                headers=self._upstream_headers(request, target, websocket=True),
                protocols=protocols,
                autoping=False,
                autoclose=True,
                max_msg_size=0,
                compress=0,
            )
        except aiohttp.WSServerHandshakeError as exc:
            self.stats.errors["upstream_closed"] += 1
            return _error(502, f"The sandbox refused the WebSocket upgrade (HTTP {exc.status})", sandbox_id)
        except aiohttp.ConnectionTimeoutError:
            self.stats.errors["timeout"] += 1
            return _error(504, "The sandbox did not accept the connection in time", sandbox_id)
        except aiohttp.ClientConnectorError:
            self.stats.errors["port_closed"] += 1
            return _error(502, "The sandbox is running but port is not open", sandbox_id)
        except aiohttp.ClientConnectionError as exc:
            return await self._upstream_failed(request, sandbox_id, exc)

        self.stats.websockets += 1
        try:
            # autoclose off on both sides: a close is relayed, and the close code the client sees
            # is the one the other end answered with (not a default 1000 from our side).
            downstream = web.WebSocketResponse(
                protocols=(upstream.protocol,) if upstream.protocol else (),
                autoping=False,
                autoclose=False,
                max_msg_size=0,
                compress=False,
            )
            await downstream.prepare(request)
            flight.response = downstream
            from_client = asyncio.create_task(self._pump(downstream, upstream, to_sandbox=True))
            from_sandbox = asyncio.create_task(self._pump(upstream, downstream, to_sandbox=False))
            try:
                done, _ = await asyncio.wait((from_client, from_sandbox), return_when=asyncio.FIRST_COMPLETED)
                first = done.pop()
                closed = None if first.cancelled() or first.exception() else first.result()
                if closed is not None and first is from_client:
                    # Client closed: close handshake with the sandbox, then answer with its code.
                    await upstream.close(code=closed[0], message=closed[1])
                    await downstream.close(code=_relayable(upstream.close_code, closed[0]), message=closed[1])
                elif closed is not None:
                    # Sandbox closed: the same the other way round.
                    await downstream.close(code=closed[0], message=closed[1])
                    await upstream.close(code=_relayable(downstream.close_code, closed[0]), message=closed[1])
            finally:
                for p in (from_client, from_sandbox):
                    p.cancel()
                await asyncio.gather(from_client, from_sandbox, return_exceptions=True)
            await downstream.close()  # no-op after a relayed close; 1000 after an error
            return downstream
        finally:
            await upstream.close()

    async def _pump(self, src: _WS, dst: _WS, *, to_sandbox: bool) -> tuple[int, bytes] | None:
        """Relay frames one way. Returns (code, reason) when `src` sent a close, None when it
        ended otherwise (we are closing it, or the connection broke)."""
        while True:
            msg = await src.receive()
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                size = len(msg.data)
                if to_sandbox:
                    self.stats.bytes_to_sandbox += size
                else:
                    self.stats.bytes_from_sandbox += size
                if msg.type == WSMsgType.TEXT:
                    await dst.send_str(msg.data)
                else:
                    await dst.send_bytes(msg.data)
            elif msg.type == WSMsgType.PING:
                await dst.ping(msg.data)
            elif msg.type == WSMsgType.PONG:
                await dst.pong(msg.data)
            elif msg.type == WSMsgType.CLOSE:
                return _relayable(msg.data, 1000), (msg.extra or "").encode()
            else:  # CLOSING, CLOSED, ERROR
                return None

    # ------------------------------------------------------------------ lifecycle

    async def close_sandbox_connections(self, sandbox_id: str) -> None:
        """Close (from our side) every upstream connection to a sandbox and abort its in-flight
        requests, so it holds no TCP connection and can be checkpointed right after.

        Call it after the resolver stopped reporting the sandbox as running, otherwise new
        requests simply open new connections.
        """
        # Requests still waiting for the sandbox (resolving: e.g. for a pause to end, then a wake)
        # hold no connection into it: they go on once it runs again.
        flights = [f for f in self._flights.get(sandbox_id, ()) if f.routed]
        for flight in flights:
            flight.abort("aborted")
        session = self._sessions.pop(sandbox_id, None)
        if session is not None:
            await session.close()
        if flights:
            await asyncio.wait([f.task for f in flights], timeout=5.0)
        # Transport closes complete on the next loop iterations.
        for _ in range(3):
            await asyncio.sleep(0)

    async def close(self) -> None:
        """Abort everything and release all pools (listener shutdown)."""
        self._closed = True
        for sandbox_id in list(self._sessions.keys() | self._flights.keys()):
            await self.close_sandbox_connections(sandbox_id)
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)


def _relayable(code: object, fallback: int) -> int:
    """A close code we may put on the wire (1005/1006/1015 are reserved for local use)."""
    if isinstance(code, int) and 1000 <= code <= 4999 and code not in (1004, 1005, 1006, 1015):
        return code
    return fallback
