"""Large file transfers between the client and the host's view of a sandbox's disk, not through the
sandbox's network (docs/proxy.md, "Downloads from the host, uploads staged on it").

Under gVisor a sandbox's root filesystem is an overlay mount on the host (`storage/rootfs.py`), and
gVisor writes a sandbox's file writes (and shared mappings) straight through to the host file. A large
`/files` transfer through gVisor's network stack moves ~150-300 MiB/s; between the client and the
host's page cache it moves at disk speed. For a sandbox whose runtime declares
`RuntimeTraits.shares_rootfs`, the traffic proxy still asks envd first, with the host token, and envd
decides everything it decides for any transfer (token or signature, user, permissions, ranges, gzip,
the size limit):

- a download (`HOST_READ_HEADER`): for an uncompressed file of at least `MIN_BYTES` on the
  sandbox's root filesystem envd answers with the file's canonical path, size, the response's status
  and headers and the part to send (all of it, or a `Range` request's part) instead of the bytes, and
  the proxy sends that itself (`open_checked`, `sendfile(2)`); a path that is not a regular file of
  that size there goes back to envd;
- an upload of at least `MIN_BYTES` (`HOST_WRITE_HEADER`): envd checks it and makes a new staging dir,
  the proxy writes the body (each multipart file part) into it (`Stage`), and envd takes the files
  (`STAGED_HEADER`): it opens each destination as for any upload and copies the bytes in.

The host opens every path with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS)`
below the sandbox's rootfs: symlinks and `..` resolve inside the sandbox's own tree, never into the
host's, whatever envd (a program in the sandbox) answered.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict

from agentenv.envd.files import (HOST_READ_HEADER, HOST_READ_RANGES, HOST_WRITE_HEADER, STAGED_HEADER, STAGED_PATH,
                                 STAGED_PREFIX, BatchWriter, part_chunks, part_filename, staged_header)
from agentenv.envd.state import HOST_TOKEN_HEADER

__all__ = ["applies", "HOST_READ_HEADER", "HOST_TOKEN_HEADER", "HOST_WRITE_HEADER", "STAGED_HEADER", "MIN_BYTES",
           "HostFiles", "HostTransfer", "Stage", "open_checked", "open_in_root", "room_to_stage"]

log = logging.getLogger(__name__)

# Below this a download or upload goes through envd as before: the bytes are few.
MIN_BYTES = 1 << 20
# Free space an upload leaves on the sandbox's disk for it to be staged (`room_to_stage`).
STAGE_SPARE_BYTES = 16 << 20
# Headers of envd's answer to a host read that do not describe the file the host sends.
_NOT_THE_FILES = frozenset({"content-length", "transfer-encoding", "connection", "date", "server",
                            HOST_READ_HEADER.lower()})
# How far the mtime the host sees may be from envd's (gVisor keeps its own copy of the time).
MTIME_SLACK_S = 2.0

_SYS_OPENAT2 = 437  # the same number on every Linux architecture (it postdates the split tables)
_RESOLVE_NO_XDEV, _RESOLVE_NO_MAGICLINKS, _RESOLVE_IN_ROOT = 0x01, 0x02, 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def open_in_root(root: Path, path: str, *, directory: bool = False) -> int:
    """An O_RDONLY fd of `path` resolved with `root` as "/" (no escaping it by symlink or `..`, no
    crossing into another mount). Raises OSError (ENOSYS on kernels before 5.6)."""
    if "\0" in path:
        raise OSError(errno.EINVAL, "NUL in path")
    dirfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
        how = _OpenHow(flags, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_XDEV | _RESOLVE_NO_MAGICLINKS)
        fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path.lstrip("/") or "."), ctypes.byref(how),
                           ctypes.sizeof(how))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return int(fd)
    finally:
        os.close(dirfd)


def applies(runtimes: Iterable[Any], bandwidth_mbit: int) -> bool:
    """Whether large transfers may go this way on a server: a runtime shares its sandboxes' rootfs
    with the host, and sandboxes have no bandwidth cap (`sandbox_bandwidth_mbit`), which file
    transfers obey like any other traffic of the sandbox's."""
    return not bandwidth_mbit and any(rt.traits.shares_rootfs for rt in runtimes)


@dataclass(frozen=True)
class HostFiles:
    """What the traffic proxy needs for transfers through the host: the rootfs of a sandbox whose
    runtime shares it (None otherwise), and the host token envd wants with the host's requests."""

    root_of: Callable[[str], Path | None]
    host_token: str


def open_checked(root: Path, path: str, size: int, mtime: float | None = None) -> int | None:
    """The fd of envd's answer, if it is a regular file of `size` bytes below `root`, modified when
    envd saw it modified (within `MTIME_SLACK_S`: gVisor keeps its own copy of the time); else None.
    Size and time together catch a path that names another file on the host than in the sandbox (a
    bind mount made inside the sandbox)."""
    try:
        fd = open_in_root(root, path)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size != size or (
            mtime is not None and abs(st.st_mtime - mtime) > MTIME_SLACK_S):
        os.close(fd)
        return None
    return fd


def room_to_stage(root: Path, length: int) -> bool:
    """Whether the filesystem of the sandbox's writable layer (an overlay reports its upper's: with
    `disk_quota = loop`, the sandbox's own disk image) has room for an upload of `length` bytes twice,
    staged and copied in, with `STAGE_SPARE_BYTES` to spare."""
    try:
        st = os.statvfs(root)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * length + STAGE_SPARE_BYTES


class Stage:
    """An upload's body written by the host into the staging dir envd made for it in the sandbox's
    root dir (`HOST_WRITE_HEADER`), one file per file of the upload, for envd to take
    (`STAGED_HEADER`). The dir is new to gVisor and never listed, so its lookups of these names reach
    the host's files."""

    def __init__(self, root: Path, staging: str) -> None:
        if not staging.startswith(STAGED_PREFIX) or "/" in staging:
            raise OSError(errno.EINVAL, f"not a staging dir: {staging!r}")
        self.dir = staging
        self._dirfd = open_in_root(root, "/" + staging, directory=True)
        self.names: list[str] = []

    def create(self) -> int:
        name = str(len(self.names))
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._dirfd)
        self.names.append(name)
        return fd

    def close(self, *, handed_over: bool) -> None:
        """Remove the staged files unless envd was asked to take them (`handed_over`): from then on
        they are envd's, which may hold them open, and a file gVisor holds open must never go behind
        its back (a checkpoint could not reopen it). The dir is envd's: envd removes it after taking
        the upload, or a stale one later (`agentenv.envd.files.sweep_staged`)."""
        try:
            if not handed_over:
                for name in self.names:
                    try:
                        os.unlink(name, dir_fd=self._dirfd)
                    except FileNotFoundError:
                        pass
        finally:
            os.close(self._dirfd)


async def _write_staged(fd: int, pieces: AsyncIterator[bytes]) -> None:
    """`pieces` into the staged file `fd` (closed after), written on I/O threads in batches
    (`BatchWriter`): a disk that makes writes wait stalls this upload, never the server's event loop."""
    writer = BatchWriter(fd)
    try:
        async for piece in pieces:
            await writer.add(piece)
        await writer.finish()
    finally:
        writer.settle()
        os.close(fd)


Send = Callable[..., Awaitable["aiohttp.ClientResponse | web.Response"]]


@dataclass
class HostTransfer:
    """One `/files` request of a client that the host takes part in (the traffic proxy makes one per
    request and hands it the ways to reach envd): `send(headers, body=True, path=None)` sends the request
    on with those headers (without its body if `body` is false; to another path of envd's with the same
    query if `path` is given; a connection that failed is answered);
    `relay(upstream)` answers the client with envd's response; `started(response)` is told of a
    response whose headers are out; `stats` is the proxy's `ProxyStats`."""

    request: web.Request
    sandbox_id: str
    root: Path
    host_token: str
    send: Send
    relay: Callable[[aiohttp.ClientResponse], Awaitable[web.StreamResponse]]
    stats: Any
    started: Callable[[web.StreamResponse], None]

    def _as_host(self, headers: CIMultiDict[str], name: str, value: str) -> CIMultiDict[str]:
        asked = headers.copy()
        asked[name] = value
        asked[HOST_TOKEN_HEADER] = self.host_token
        return asked

    async def download(self, headers: CIMultiDict[str]) -> web.StreamResponse:
        upstream = await self.send(self._as_host(headers, HOST_READ_HEADER, f"{MIN_BYTES} {HOST_READ_RANGES}"))
        if isinstance(upstream, web.Response):
            return upstream
        if not upstream.headers.get(HOST_READ_HEADER):
            return await self.relay(upstream)
        sent = await self._send_file(upstream)
        if sent is not None:
            return sent
        # Not the file envd described (it changed meanwhile, or is not below the rootfs): envd sends it.
        return await self._through_envd(headers)

    async def _send_file(self, upstream: aiohttp.ClientResponse) -> web.StreamResponse | None:
        """Send the file envd described from the host; None if it is not that file."""
        try:
            info = await upstream.json()
            path, size, headers = str(info["path"]), int(info["size"]), dict(info["headers"])
            mtime = float(info["mtime"])
            # the part of a Range request (an envd before ranges: the whole file)
            status, offset, count = int(info.get("status", 200)), int(info.get("offset", 0)), int(info.get("count", size))
            if not (status in (200, 206) and 0 <= offset and 0 <= count and offset + count <= size):
                raise ValueError(f"not a part of the file: {status} {offset}+{count} of {size}")
        except (aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
            log.info("sandbox %s: unusable answer to a host read: %r", self.sandbox_id, exc)
            return None
        finally:
            upstream.release()
        # Inline, not on a thread: a pause cancelling this task must never leave an fd open on the
        # rootfs it is about to unmount (a few path-lookup syscalls on the host).
        fd = open_checked(self.root, path, size, mtime)
        if fd is None:
            return None
        try:
            response = web.StreamResponse(status=status)
            for key, value in headers.items():
                if key.lower() not in _NOT_THE_FILES:
                    response.headers[key] = str(value)
            response.content_length = count
            self.started(response)
            try:
                await response.prepare(self.request)
                if self.request.transport is None:
                    raise ConnectionResetError("client gone")
                transport = self.request.transport
                with os.fdopen(fd, "rb", buffering=0, closefd=False) as fobj:
                    sent = await asyncio.get_running_loop().sendfile(transport, fobj, offset, count)
                if sent < count:
                    # Cut short in the sandbox meanwhile. The headers promised `size` bytes: only
                    # closing the connection tells the client (HTTP/1.1 has no other way), where
                    # keeping it open would leave it waiting for bytes that never come.
                    log.info("sandbox %s: %s shrank while it was sent (%d of %d bytes); connection closed",
                             self.sandbox_id, path, sent, count)
                    transport.close()
                    self.stats.errors["file_shrank"] += 1
                    return response
                await response.write_eof()
            except ConnectionError:
                self.stats.errors["client_disconnect"] += 1
                return response
            self.stats.files_from_host += 1
            self.stats.bytes_from_sandbox += count
            return response
        finally:
            os.close(fd)

    async def upload(self, headers: CIMultiDict[str]) -> web.StreamResponse:
        """envd checks the upload first, the host writes its body into the staging dir envd made for
        it, envd takes it from there. Without room for the body twice on the sandbox's disk (staged,
        then copied in), envd takes the body itself, as for any upload: staging must never turn an
        upload that fits into a 507."""
        request = self.request
        length = request.content_length or 0
        if not room_to_stage(self.root, length):
            log.info("sandbox %s: no room to stage an upload of %d bytes; envd takes the body", self.sandbox_id, length)
            return await self._through_envd(headers)
        upstream = await self.send(self._as_host(headers, HOST_WRITE_HEADER, str(length)),
                                   body=False, path=STAGED_PATH)
        if isinstance(upstream, web.Response):
            return upstream
        staging = upstream.headers.get(HOST_WRITE_HEADER)
        if staging is not None and upstream.status != 204:
            return await self.relay(upstream)  # envd's refusal (401, 413, ...) as it is
        upstream.release()
        try:
            # None: an envd without the route (a sandbox restored from an older image); "": no dir
            stage = Stage(self.root, staging or "")
        except OSError as exc:
            log.info("sandbox %s: the upload is not staged (%s); envd takes the body", self.sandbox_id, exc)
            return await self._through_envd(headers)
        handed_over = False
        try:
            multipart = request.content_type.startswith("multipart/")
            try:
                files = await _stage_body(request, stage, multipart)
            except (ValueError, AssertionError) as exc:  # what envd answers for a malformed body
                message = f"malformed multipart body: {exc or type(exc).__name__}"
                return web.json_response({"code": 400, "message": message}, status=400)
            except (ConnectionError, aiohttp.ClientError, asyncio.IncompleteReadError, HttpProcessingError) as exc:
                self.stats.errors["client_disconnect"] += 1
                log.info("upload to sandbox %s ended early: %r", self.sandbox_id, exc)
                return web.json_response({"sandboxId": self.sandbox_id, "message": "The request body ended early",
                                          "code": 400}, status=400)
            except OSError as exc:  # writing the staged file (the disk filled up meanwhile)
                log.warning("upload to sandbox %s not staged: %s", self.sandbox_id, exc)
                full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                status = 507 if full else 500
                message = "not enough disk space for the upload" if full else f"the upload was not stored: {exc}"
                return web.json_response({"sandboxId": self.sandbox_id, "message": message, "code": status},
                                         status=status)
            self.stats.bytes_to_sandbox += length
            staged = staged_header(multipart, stage.dir, files)
            handed_over = True
            upstream = await self.send(self._as_host(headers, STAGED_HEADER, staged), body=False, path=STAGED_PATH)
            if isinstance(upstream, web.Response):
                return upstream
            self.stats.files_to_host += 1
            return await self.relay(upstream)
        finally:
            stage.close(handed_over=handed_over)

    async def _through_envd(self, headers: CIMultiDict[str]) -> web.StreamResponse:
        """The request as the client sent it, body and all, to envd; its answer to the client."""
        upstream = await self.send(headers)
        return upstream if isinstance(upstream, web.Response) else await self.relay(upstream)


async def _stage_body(request: web.Request, stage: Stage, multipart: bool) -> list[dict[str, str | None]]:
    """Each file of the body into a staged file: [{"name", "filename"}] (a part's verbatim filename;
    parts not named "file" are skipped, as envd skips them)."""
    if not multipart:
        await _write_staged(stage.create(), request.content.iter_any())
        return [{"name": stage.names[-1], "filename": None}]
    files: list[dict[str, str | None]] = []
    reader = await request.multipart()
    while True:
        part = await reader.next()
        if part is None:
            return files
        if not isinstance(part, aiohttp.BodyPartReader) or part.name != "file":
            await part.release()
            continue
        await _write_staged(stage.create(), part_chunks(part))
        files.append({"name": stage.names[-1], "filename": part_filename(part)})
