"""Egress proxy: decides outbound TCP by server name (TLS SNI / HTTP Host) for domain rules.

A domain in `allowOut` cannot be an nft rule: the addresses behind a name change and are shared.
When a sandbox has domain rules, its slot's nft table redirects guest TCP that its CIDR rules
would refuse to a listener of this process *inside the slot's netns* (a socket keeps the netns
it was created in, so one asyncio loop serves every slot). The handler reads the first bytes of
the connection — a TLS ClientHello or an HTTP/1 request head — takes the server name, checks it
against the sandbox's allowed domains, finds the original destination (SO_ORIGINAL_DST: the
REDIRECT's conntrack entry is in the same netns), connects there from the same netns (so the
platform rules of the slot's `output` chain still apply) and splices both directions. Anything
else (no name within PEEK_TIMEOUT_S, a name not allowed, an unreachable upstream) is answered
with a TCP reset.

Old gVisor cannot checkpoint a sandbox with open TCP endpoints. A proxied connection is, for
the guest, an ordinary outbound connection (conntrack in the slot lists it, so pause/fork/snapshot
wait for it or refuse with 503 exactly as for a direct one); the proxy never keeps one alive on
its own: a half-close is passed on at once, the connection is closed as soon as both directions
have ended, and a failure on either side resets both. `close` (slot release) resets what is left
and drops the listener, which would otherwise keep the namespace alive after the slot is gone.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import struct
from dataclasses import dataclass, field

from agentenv.network.nsock import socket_in
from agentenv.network.policy import EgressPolicy

log = logging.getLogger(__name__)

# Port of the listener inside every slot netns (each netns has its own port space).
EGRESS_PROXY_PORT = 49980
PEEK_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
MAX_HEAD = 16 * 1024
# Proxied (or being inspected) connections per sandbox: beyond this, new ones are reset at once, so
# a guest opening connections in a loop cannot exhaust the server process's file descriptors.
MAX_CONNS_PER_SANDBOX = 256
_SO_ORIGINAL_DST = 80
_HTTP_METHOD = re.compile(rb"^[A-Z]{3,10} ")


# ------------------------------------------------------------------ sockets in another netns


async def socket_in_netns(netns_path: str) -> socket.socket:
    """A new non-blocking TCP socket living in the network namespace at `netns_path` (`nsock`)."""
    sock = await socket_in(netns_path, socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock


def original_dst(sock: socket.socket) -> tuple[str, int]:
    """Where the guest meant to connect before the slot's REDIRECT."""
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port = struct.unpack_from("!H", raw, 2)[0]
    return socket.inet_ntoa(raw[4:8]), port


# ------------------------------------------------------------------ server name from the first bytes


def _tls_handshake(buf: bytes) -> bytes | None:
    """Handshake bytes of the TLS records at the start of `buf` (None if not TLS)."""
    if len(buf) < 1 or buf[0] != 0x16:
        return None
    hs = b""
    p = 0
    while p + 5 <= len(buf) and buf[p] == 0x16:
        n = struct.unpack_from("!H", buf, p + 3)[0]
        hs += buf[p + 5:p + 5 + n]
        if p + 5 + n > len(buf):
            break
        p += 5 + n
    return hs


def head_complete(buf: bytes) -> bool:
    """Whether `buf` holds enough of the stream to decide (or can never be decided)."""
    if not buf:
        return False
    if buf[0] == 0x16:
        hs = _tls_handshake(buf) or b""
        return len(hs) >= 4 and len(hs) >= 4 + int.from_bytes(hs[1:4], "big")
    if _HTTP_METHOD.match(buf[:11]) or (len(buf) < 11 and re.fullmatch(rb"[A-Z]*", buf)):
        return b"\r\n\r\n" in buf or b"\n\n" in buf
    return True  # neither TLS nor HTTP: nothing will name the server


def tls_sni(buf: bytes) -> str | None:
    """The server_name of a TLS ClientHello, None if absent or malformed."""
    hs = _tls_handshake(buf)
    if not hs or len(hs) < 4 or hs[0] != 0x01:
        return None
    body = hs[4:4 + int.from_bytes(hs[1:4], "big")]
    try:
        p = 2 + 32
        p += 1 + body[p]                                   # session id
        p += 2 + struct.unpack_from("!H", body, p)[0]      # cipher suites
        p += 1 + body[p]                                   # compression methods
        end = p + 2 + struct.unpack_from("!H", body, p)[0]
        p += 2
        while p + 4 <= min(end, len(body)):
            etype, elen = struct.unpack_from("!HH", body, p)
            p += 4
            if etype == 0:  # server_name
                q, qend = p + 2, p + elen
                while q + 3 <= qend:
                    ntype, nlen = body[q], struct.unpack_from("!H", body, q + 1)[0]
                    if ntype == 0:
                        return body[q + 3:q + 3 + nlen].decode("ascii")
                    q += 3 + nlen
                return None
            p += elen
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return None


def http_host(buf: bytes) -> str | None:
    """The Host of an HTTP/1 request head (port stripped), None if there is none."""
    if not _HTTP_METHOD.match(buf[:11]):
        return None
    head = buf.split(b"\r\n\r\n", 1)[0].split(b"\n\n", 1)[0]
    for line in head.split(b"\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"host":
            host = value.strip().decode("ascii", "replace")
            if host.startswith("["):
                return None  # IPv6 literal: never a domain
            return host.rsplit(":", 1)[0] if ":" in host else host
    return None


def server_name(buf: bytes) -> str | None:
    return tls_sni(buf) if buf[:1] == b"\x16" else http_host(buf)


# ------------------------------------------------------------------ the proxy


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (no FIN, so no TIME_WAIT left in the guest)."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Copy until EOF, then half-close; False when either side failed."""
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        return True
    except (OSError, RuntimeError):
        return False


@dataclass
class _Box:
    policy: EgressPolicy
    netns_path: str
    server: asyncio.base_events.Server | None = None
    conns: set[asyncio.Task] = field(default_factory=set)


class EgressProxy:
    def __init__(self) -> None:
        self._boxes: dict[str, _Box] = {}
        self.stats = {"allowed": 0, "refused": 0}

    def listening(self) -> list[str]:
        """Sandboxes with a listener (for leak checks)."""
        return [sid for sid, b in self._boxes.items() if b.server is not None]

    async def configure(self, sandbox_id: str, netns_path: str, policy: EgressPolicy) -> None:
        """Listen in the slot's netns while the policy has domain rules; stop otherwise."""
        if not policy.inspects:
            await self.close(sandbox_id)
            return
        box = self._boxes.get(sandbox_id)
        if box is None:
            box = self._boxes[sandbox_id] = _Box(policy, netns_path)
        box.policy = policy
        if box.server is None:
            sock = await socket_in_netns(netns_path)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("0.0.0.0", EGRESS_PROXY_PORT))
                sock.listen(128)
                box.server = await asyncio.start_server(
                    lambda r, w: self._serve(sandbox_id, r, w), sock=sock)
            except BaseException:
                sock.close()
                self._boxes.pop(sandbox_id, None)
                raise

    async def abort_connections(self, sandbox_id: str) -> None:
        """Reset every proxied connection of the sandbox (before a checkpoint)."""
        box = self._boxes.get(sandbox_id)
        if box is None:
            return
        tasks = list(box.conns)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self, sandbox_id: str) -> None:
        box = self._boxes.pop(sandbox_id, None)
        if box is None:
            return
        if box.server is not None:
            box.server.close()
        tasks = list(box.conns)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close_all(self) -> None:
        for sid in list(self._boxes):
            await self.close(sid)

    async def _serve(self, sandbox_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        box = self._boxes.get(sandbox_id)
        if box is None or task is None or len(box.conns) >= MAX_CONNS_PER_SANDBOX:
            if box is not None:
                self.stats["refused"] += 1
            _reset(writer)
            return
        box.conns.add(task)
        upstream: asyncio.StreamWriter | None = None
        clean = False
        dst: tuple[str, int] | None = None
        name: str | None = None
        try:
            dst = original_dst(writer.get_extra_info("socket"))
            head = b""
            async with asyncio.timeout(PEEK_TIMEOUT_S):
                while len(head) < MAX_HEAD and not head_complete(head):
                    chunk = await reader.read(MAX_HEAD - len(head))
                    if not chunk:
                        break
                    head += chunk
            name = server_name(head) if head else None
            if name is None or not box.policy.allows_name(name):
                self.stats["refused"] += 1
                log.info("egress of %s to %s:%d refused (server name %r)", sandbox_id, dst[0], dst[1], name)
                return
            usock = await socket_in_netns(box.netns_path)
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    await asyncio.get_running_loop().sock_connect(usock, dst)
                up_reader, upstream = await asyncio.open_connection(sock=usock)
            except BaseException:
                usock.close()
                raise
            self.stats["allowed"] += 1
            log.debug("egress of %s to %s:%d allowed as %r", sandbox_id, dst[0], dst[1], name)
            upstream.write(head)
            pipes = {asyncio.create_task(_pipe(reader, upstream)), asyncio.create_task(_pipe(up_reader, writer))}
            try:
                while pipes:
                    done, pipes = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
                    if not all(t.result() for t in done):
                        break
                else:
                    clean = True
            finally:
                for t in pipes:
                    t.cancel()
        except (OSError, TimeoutError, ValueError) as e:
            log.info("egress of %s to %s (%r) failed: %s", sandbox_id, dst, name, e)
        except asyncio.CancelledError:
            pass  # abort_connections / close: reset below
        finally:
            box.conns.discard(task)
            for w in (writer, upstream):
                if w is None:
                    continue
                if clean:
                    w.close()
                else:
                    _reset(w)
