"""A small hand-rolled subset of the Connect protocol (JSON codec only) on top of aiohttp.

Only what the E2B SDKs use: unary calls (`application/json`), server streaming and client streaming
(`application/connect+json` with 5-byte envelopes). Streams always end with an end-of-stream envelope,
and stream errors are reported inside that envelope (the JS SDK ignores bodies of non-200 streams).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

log = logging.getLogger("agentenv.envd")

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
_HEADER = struct.Struct(">BI")
MAX_MESSAGE = 64 * 1024 * 1024

# Connect error code -> HTTP status (unary errors).
HTTP_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class ConnectError(Exception):
    """An RPC failure with a Connect error code (e.g. "not_found") and a human-readable message."""

    def __init__(self, code: str, message: str) -> None:
        if code not in HTTP_STATUS:
            raise ValueError(f"unknown Connect code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def parse_timeout_ms(value: str | None) -> float | None:
    """Connect-Timeout-Ms in seconds; lenient (old SDKs send floats such as "60000.0"), None if absent/invalid."""
    if not value:
        return None
    try:
        ms = float(value.strip())
    except ValueError:
        return None
    if not math.isfinite(ms) or ms <= 0:
        return None
    return ms / 1000.0


def encode_envelope(message: Any, flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(flags, len(data)) + data


async def read_envelopes(request: web.Request) -> AsyncIterator[tuple[int, Any]]:
    """Yield (flags, decoded JSON) for each envelope of a streaming request body."""
    content = request.content
    while True:
        try:
            header = await content.readexactly(_HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise ConnectError("invalid_argument", "truncated envelope header") from None
            return
        flags, length = _HEADER.unpack(header)
        if length > MAX_MESSAGE:
            raise ConnectError("resource_exhausted", f"message of {length} bytes is too large")
        if flags & FLAG_COMPRESSED:
            raise ConnectError("unimplemented", "compressed envelopes are not supported")
        try:
            data = await content.readexactly(length)
        except asyncio.IncompleteReadError:
            raise ConnectError("invalid_argument", "truncated envelope") from None
        yield flags, _decode_json(data)


def _decode_json(data: bytes) -> Any:
    if not data:
        return {}
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"invalid JSON: {exc}") from None
    except RecursionError:
        raise ConnectError("invalid_argument", "invalid JSON: nested too deeply") from None


def _unary_error(err: ConnectError) -> web.Response:
    return web.json_response(err.to_json(), status=HTTP_STATUS[err.code])


def _internal(exc: BaseException) -> ConnectError:
    """A handler failure as a Connect error. ValueError/TypeError come from request values that the
    handler could not use (a string where a number belongs, a NUL byte in a path, ...): the caller's
    fault (invalid_argument, 400), not the server's."""
    if isinstance(exc, (ValueError, TypeError)):
        log.info("rejected RPC argument: %s", exc)
        return ConnectError("invalid_argument", f"invalid argument: {exc}" if str(exc) else "invalid argument")
    log.exception("unhandled error in RPC handler", exc_info=exc)
    return ConnectError("internal", str(exc) or type(exc).__name__)


UnaryHandler = Callable[[web.Request, dict], Awaitable[dict]]
ServerStreamHandler = Callable[[web.Request, dict], AsyncIterator[dict]]
ClientStreamHandler = Callable[[web.Request, AsyncIterator[dict]], Awaitable[dict]]


def unary(handler: UnaryHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def view(request: web.Request) -> web.StreamResponse:
        try:
            ctype = request.content_type
            if ctype not in ("application/json", "application/connect+json", ""):
                raise ConnectError("unimplemented", f"unsupported content type {ctype!r}")
            msg = _decode_json(await request.read())
            if not isinstance(msg, dict):
                raise ConnectError("invalid_argument", "request must be a JSON object")
            timeout = parse_timeout_ms(request.headers.get("Connect-Timeout-Ms"))
            try:
                async with asyncio.timeout(timeout):
                    result = await handler(request, msg)
            except TimeoutError:
                raise ConnectError("deadline_exceeded", "the request deadline was exceeded") from None
        except ConnectError as err:
            return _unary_error(err)
        except Exception as exc:  # noqa: BLE001 - every failure must become a Connect error
            return _unary_error(_internal(exc))
        return web.json_response(result)

    return view


async def _start_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/connect+json"})
    await resp.prepare(request)
    return resp


async def _end_stream(resp: web.StreamResponse, err: ConnectError | None) -> None:
    body = {"error": err.to_json()} if err else {}
    try:
        await resp.write(encode_envelope(body, FLAG_END_STREAM))
        await resp.write_eof()
    except (ConnectionError, RuntimeError):
        pass


async def _first_message(request: web.Request) -> dict:
    async for _flags, msg in read_envelopes(request):
        if not isinstance(msg, dict):
            raise ConnectError("invalid_argument", "request must be a JSON object")
        return msg
    return {}


def server_stream(
    handler: ServerStreamHandler,
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Wrap an async generator handler; each yielded dict is flushed as one envelope immediately."""

    async def view(request: web.Request) -> web.StreamResponse:
        # Read the request message before sending response headers: some clients (the Python SDK's
        # transport) stop sending a chunked request body once response headers have arrived.
        err: ConnectError | None = None
        gen: AsyncIterator[dict] | None = None
        try:
            msg = await _first_message(request)
        except ConnectError as exc:
            err = exc
        resp = await _start_stream(request)
        try:
            if err is None:
                gen = handler(request, msg)
                async for item in gen:
                    await resp.write(encode_envelope(item))
        except ConnectError as exc:
            err = exc
        except ConnectionError:
            # Client went away: stop producing; never close the connection ourselves.
            if gen is not None:
                await gen.aclose()  # type: ignore[attr-defined]
            return resp
        except asyncio.CancelledError:  # server shutdown
            if gen is not None:
                await gen.aclose()  # type: ignore[attr-defined]
            raise
        except Exception as exc:  # noqa: BLE001
            err = _internal(exc)
        await _end_stream(resp, err)
        return resp

    return view


def client_stream(
    handler: ClientStreamHandler,
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def view(request: web.Request) -> web.StreamResponse:
        async def messages() -> AsyncIterator[dict]:
            async for flags, msg in read_envelopes(request):
                if flags & FLAG_END_STREAM:
                    return
                if not isinstance(msg, dict):
                    raise ConnectError("invalid_argument", "request must be a JSON object")
                yield msg

        err: ConnectError | None = None
        result: dict | None = None
        try:
            result = await handler(request, messages())
        except ConnectError as exc:
            err = exc
        except Exception as exc:  # noqa: BLE001
            err = _internal(exc)
        resp = await _start_stream(request)
        try:
            if result is not None:
                await resp.write(encode_envelope(result))
        except ConnectionError:
            return resp
        await _end_stream(resp, err)
        return resp

    return view


# ---- proto3-JSON helpers -------------------------------------------------------------------------


def field(msg: dict | None, camel: str, default: Any = None) -> Any:
    """Read a proto3-JSON field accepting both lowerCamelCase and snake_case names."""
    if not msg:
        return default
    if camel in msg:
        return msg[camel]
    snake = "".join("_" + c.lower() if c.isupper() else c for c in camel)
    return msg.get(snake, default)


def b64decode(value: str | None) -> bytes:
    """Decode proto3-JSON bytes: standard or URL-safe base64, padded or not."""
    if not value:
        return b""
    value = value.strip()
    value += "=" * (-len(value) % 4)
    try:
        if "-" in value or "_" in value:
            return base64.urlsafe_b64decode(value)
        return base64.b64decode(value)
    except ValueError:
        raise ConnectError("invalid_argument", "invalid base64 in bytes field") from None


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def enum_value(value: Any, names: dict[str, int], what: str) -> int:
    """Accept an enum as its name or its number."""
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if value in names:
            return names[value]
        if value.lstrip("-").isdigit():
            return int(value)
    if value is None:
        return 0
    raise ConnectError("invalid_argument", f"invalid {what}: {value!r}")
