"""Plain-HTTP file transfer: `GET /files` (download) and `POST /files` (multipart or raw upload).

Bodies are streamed in bounded chunks both ways; files are opened with the selected user's credentials
so permissions are enforced and new files/directories belong to that user.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import errno
import functools
import hashlib
import hmac
import json
import mimetypes
import os
import re
import secrets
import shutil
import stat
import time
import zlib
from email.message import Message
from email.utils import formatdate

from aiohttp import hdrs, web

from agentenv.envd.dirs import ensure_dirs
from agentenv.envd.entry import XATTR_PREFIX, read_metadata
from agentenv.envd.state import UNAUTHORIZED_MESSAGE, EnvdState, basic_auth_user, get_state
from agentenv.envd.users import UnknownUser, User, lookup_user, resolve_path

CHUNK = 1024 * 1024
# Uploads: network pieces are gathered into batches of this size, each written with one writev on an
# I/O thread while the next batch arrives. Downloads without gzip go out with sendfile(2).
WRITE_BATCH = 4 * 1024 * 1024
_IOV_MAX = 512
_IO = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="envd-io")
# gzip is negotiated by default by the SDK's HTTP clients; level 1 keeps it from being the bottleneck,
# and a sample decides whether compressing is worth it at all (random/compressed data is sent as is).
GZIP_LEVEL = 1
GZIP_SAMPLE = 64 * 1024
GZIP_MIN_SAVING = 0.1
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_PRINTABLE = re.compile(r"^[\x20-\x7e]*$")
# File metadata (`X-Metadata-<key>: <value>` upload headers -> `user.e2b.<key>` xattrs). Linux caps an
# xattr name at 255 bytes; ext4 keeps all of an inode's xattrs in one 4 KiB block, so the whole set
# (prefixed names + values) is held to that budget up front instead of failing half way.
METADATA_HEADER_PREFIX = "x-metadata-"
MAX_METADATA_KEY = 255 - len(XATTR_PREFIX)
MAX_METADATA_TOTAL = 4096
_XATTR_UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP)
# The host's data plane (`agentenv.proxy.hostfiles`), with the host token, asks with these headers:
# - HOST_READ_HEADER: whether it may send a download from the sandbox's disk itself (the value is the
#   smallest size worth it, then `HOST_READ_RANGES` if it sends a `Range` request's part too);
# - HOST_WRITE_HEADER (to STAGED_PATH): whether an upload of that many bytes may be staged
#   (credentials, user, size);
#   envd answers with a new, empty directory in "/" for it (the header's value: its name);
# - STAGED_HEADER (to STAGED_PATH): to take an upload whose body the host wrote to files in that directory
#   (JSON: {"multipart": bool, "dir": name, "files": [{"name": "<n>", "filename": str | null}]}).
# The directory is envd's own and new: gVisor, which caches a directory's listing once a program read
# it and then answers lookups of other names with ENOENT, has no listing of it to hide the host's files.
HOST_READ_HEADER = "X-Agentenv-Host-Read"
HOST_READ_RANGES = "ranges"
HOST_WRITE_HEADER = "X-Agentenv-Host-Write"
STAGED_PATH = "/agentenv/files"  # where the host sends the last two (`post_staged`)
STAGED_HEADER = "X-Agentenv-Staged"
STAGED_PREFIX = ".agentenv-upload-"
_STAGED_DIR = re.compile(r"^\.agentenv-upload-[0-9a-f]{32}$")
_STAGED_FILE = re.compile(r"^[0-9]{1,6}$")


class HTTPFail(Exception):
    """An error answered as JSON `{code, message}` with the HTTP status as code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> web.Response:
        return web.json_response({"code": self.status, "message": self.message}, status=self.status)


def _os_fail(exc: OSError, path: str) -> HTTPFail:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return HTTPFail(404, f"path '{path}' does not exist")
    if exc.errno == errno.EISDIR:
        return HTTPFail(400, f"path '{path}' is a directory")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return HTTPFail(403, f"permission denied: '{path}'")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return HTTPFail(507, f"not enough disk space to write '{path}'")
    if exc.errno == errno.ENAMETOOLONG:
        return HTTPFail(400, f"path '{path}' is too long")
    return HTTPFail(500, f"{exc.strerror or exc}: '{path}'")


def sign(path: str, operation: str, username: str, token: str, expiration: str | None) -> str:
    raw = f"{path}:{operation}:{username}:{token}"
    if expiration:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode("utf-8")).digest()
    return "v1_" + base64.b64encode(digest).decode("ascii").rstrip("=")


def check_access(request: web.Request, state: EnvdState, operation: str) -> None:
    """Header token, or a valid (unexpired) v1 signature over path/operation/username."""
    token = state.access_token
    if not token:
        return
    header = request.headers.get("X-Access-Token")
    if header is not None:
        if state.token_ok(header):
            return
        raise HTTPFail(401, UNAUTHORIZED_MESSAGE)
    signature = request.query.get("signature")
    if not signature:
        raise HTTPFail(401, UNAUTHORIZED_MESSAGE)
    expiration = request.query.get("signature_expiration")
    expected = sign(
        request.query.get("path", ""), operation, request.query.get("username", ""), token, expiration
    )
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        raise HTTPFail(401, "invalid signature")
    if expiration:
        try:
            expired = int(expiration) < time.time()
        except ValueError:
            raise HTTPFail(401, "invalid signature expiration") from None
        if expired:
            raise HTTPFail(401, "signature is already expired")


def _resolve(raw: str, user: User) -> str:
    try:
        return resolve_path(raw, user)
    except ValueError as exc:
        raise HTTPFail(400, f"invalid path: {exc}") from None


def files_user(request: web.Request, state: EnvdState) -> User:
    name = request.query.get("username") or basic_auth_user(request) or state.default_user
    try:
        return lookup_user(name)
    except UnknownUser:
        raise HTTPFail(401, f"invalid username: '{name}'") from None


# ---- blocking helpers (run on the user's credentials) ----------------------------------------------


def _open_read(path: str) -> tuple[int, os.stat_result]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise IsADirectoryError(errno.EISDIR, "is a directory")
    return fd, st


class MetadataUnsupported(OSError):
    """The file's filesystem has no user xattrs, so metadata cannot be stored on it."""


def _replace_metadata(fd: int, metadata: dict[str, str]) -> None:
    """Make `metadata` the file's whole user.e2b.* set: stale keys go (an overwrite replaces the set).

    Without user xattr support an empty set is a no-op and a non-empty one raises MetadataUnsupported.
    """
    try:
        names = os.listxattr(fd)
        for name in names:
            if name.startswith(XATTR_PREFIX) and name[len(XATTR_PREFIX):] not in metadata:
                os.removexattr(fd, name)
        for key, value in metadata.items():
            os.setxattr(fd, XATTR_PREFIX + key, value.encode("ascii"))
    except OSError as exc:
        if exc.errno not in _XATTR_UNSUPPORTED:
            raise
        if metadata:
            raise MetadataUnsupported(exc.errno, exc.strerror) from None


def _open_upload(path: str, metadata: dict[str, str], uid: int, gid: int) -> int:
    """Open `path` for an upload and give it `metadata`, before any byte of it changes.

    The metadata is stored first and the file truncated only after that, so an upload whose metadata
    cannot be stored leaves an existing file as it was and creates no new one. The file is then given
    to uid:gid as E2B's envd does (a new file always; an existing one where the user may chown it):
    that attribute change is the CHMOD event E2B's watchers report between CREATE and WRITE.
    A file created here is empty already: it is not truncated, so a watcher sees no extra WRITE.
    """
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "is a directory")
    created = False
    fd = -1
    for _ in range(3):  # create, or open what exists (it may vanish or appear in between)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            created = True
            break
        except FileExistsError:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                break
            except FileNotFoundError:  # removed meanwhile, or a dangling symlink
                continue
    if fd < 0:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        _replace_metadata(fd, metadata)
        _give(fd, uid, gid, created)
        if not created:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        if created:
            _unlink_quiet(path)
        raise
    return fd


def _give(fd: int, uid: int, gid: int, created: bool) -> None:
    """fchown to the user: always possible for a file just created; an existing file of someone else
    (writable for the user through its mode) or on a filesystem without owners keeps its owner."""
    try:
        os.fchown(fd, uid, gid)
    except OSError:
        if created:
            raise


def _writev_all(fd: int, pieces: list) -> None:
    """Write every byte of `pieces` (bytes-like objects) to fd: writev, resumed after short writes."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i:i + _IOV_MAX])
        if n == 0:
            raise OSError(errno.EIO, "write made no progress")
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]


class BatchWriter:
    """Writes an upload's pieces to fd in batches (one writev on an I/O thread per ~4 MiB) and gathers
    the next batch from the network while the previous one is being written. The event loop never
    waits for the disk (a write can block for long once the kernel throttles dirty pages). Also the
    host's writer of staged uploads (`agentenv.proxy.hostfiles`).

    At most one batch is in flight; `settle()` waits for it (blocking, one batch at most) so the fd is
    never closed under a running write, even when the request was cancelled.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pending: list = []
        self._size = 0
        self._inflight: concurrent.futures.Future | None = None

    async def add(self, piece) -> None:
        self._pending.append(piece)
        self._size += len(piece)
        if self._size >= WRITE_BATCH or len(self._pending) >= _IOV_MAX:
            await self._submit()

    async def finish(self) -> None:
        await self._submit()
        await self._wait()

    async def _submit(self) -> None:
        await self._wait()
        batch, self._pending, self._size = self._pending, [], 0
        if batch:
            self._inflight = _IO.submit(_writev_all, self._fd, batch)

    async def _wait(self) -> None:
        if self._inflight is not None:
            await asyncio.wrap_future(self._inflight)
            self._inflight = None

    def settle(self) -> None:
        if self._inflight is not None:
            concurrent.futures.wait([self._inflight])
            self._inflight = None


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ---- GET /files --------------------------------------------------------------------------------------


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """Single byte range -> (start, end inclusive); None = serve everything; HTTPFail 416 if unsatisfiable."""
    m = _RANGE_RE.match(header.strip())
    if not m:
        return None  # multi-range or malformed: ignore, like many servers
    first, last = m.groups()
    if first == "" and last == "":
        return None
    if first == "":
        n = int(last)
        if n == 0:
            raise HTTPFail(416, "unsatisfiable range")
        return max(0, size - n), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or end < start:
        raise HTTPFail(416, "unsatisfiable range")
    return start, end


def _worth_compressing(fd: int) -> bool:
    sample = os.pread(fd, GZIP_SAMPLE, 0)
    if len(sample) < 64:
        return False
    return len(zlib.compress(sample, GZIP_LEVEL)) <= len(sample) * (1 - GZIP_MIN_SAVING)


def _accepts_gzip(header: str) -> bool:
    for item in header.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() in ("gzip", "*"):
            q = params.strip()
            return not (q.startswith("q=") and float(q[2:] or 0) == 0)
    return False


async def _on_io(fn, *args):
    """fn(*args) on an I/O thread. A cancelled caller still waits for it: it may use an fd that the
    caller closes next."""
    fut = _IO.submit(fn, *args)
    try:
        return await asyncio.wrap_future(fut)
    finally:
        if not fut.done():
            concurrent.futures.wait([fut])


def _read_compress(fd: int, compressor, n: int, offset: int) -> tuple[bytes, int]:
    chunk = os.pread(fd, n, offset)
    return compressor.compress(chunk), len(chunk)


async def _send_gzip(resp: web.StreamResponse, fd: int, compressor, start: int, end: int) -> None:
    offset = start
    while offset <= end:
        out, n = await _on_io(_read_compress, fd, compressor, min(WRITE_BATCH, end - offset + 1), offset)
        if not n:
            break
        offset += n
        if out:
            await resp.write(out)
    await resp.write(compressor.flush())


async def _send_plain(request: web.Request, resp: web.StreamResponse, fd: int, offset: int, count: int) -> None:
    """`count` bytes of fd from `offset`: sendfile(2) straight from the file to the socket (the headers
    were sent by prepare), or pread + write where the transport cannot sendfile."""
    if count <= 0:
        return
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("connection lost")
    with os.fdopen(fd, "rb", buffering=0, closefd=False) as fobj:
        try:
            sent = await asyncio.get_running_loop().sendfile(transport, fobj, offset, count, fallback=False)
            if sent < count:
                _cut_short(transport)
            return
        except (NotImplementedError, asyncio.SendfileNotAvailableError):
            pass
    end = offset + count
    while offset < end:
        chunk = await _on_io(os.pread, fd, min(WRITE_BATCH, end - offset), offset)
        if not chunk:
            _cut_short(transport)
            return
        offset += len(chunk)
        await resp.write(chunk)


def _cut_short(transport: asyncio.BaseTransport) -> None:
    """The file shrank while it was sent: fewer bytes than the Content-Length promised. Only closing
    the connection tells the client (as Go's server does); open, it would wait for the rest."""
    transport.close()


@functools.cache
def _root_device() -> int:
    return os.stat("/").st_dev


def _host_may_send(request: web.Request, state: EnvdState, st: os.stat_result, *, ranged: bool) -> bool:
    """The host asked to send this uncompressed download itself (a `Range` request's part only if it
    said it sends those), and the file lives on the sandbox's root filesystem (the host's view of it
    is the same file: gVisor writes through to it). Files on other mounts (/dev/shm, a tmpfs the user
    mounted) have another device and stay with envd."""
    wanted = request.headers.get(HOST_READ_HEADER, "").split()
    if not wanted or not wanted[0].isdigit() or not state.from_host(request):
        return False
    if ranged and HOST_READ_RANGES not in wanted[1:]:  # a host that sends whole files only
        return False
    return (request.method == hdrs.METH_GET and stat.S_ISREG(st.st_mode) and st.st_size >= int(wanted[0])
            and st.st_dev == _root_device())


async def get_files(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    try:
        check_access(request, state, "read")
        user = files_user(request, state)
        raw_path = request.query.get("path")
        if not raw_path:
            raise HTTPFail(400, "path is required")
        path = _resolve(raw_path, user)
        try:
            fd, st = await state.executor.run(user, _open_read, path)
        except OSError as exc:
            raise _os_fail(exc, path) from None
    except HTTPFail as fail:
        return fail.response()
    try:
        size = st.st_size
        try:
            byte_range = _parse_range(request.headers.get(hdrs.RANGE, ""), size) if request.headers.get(hdrs.RANGE) else None
        except HTTPFail as fail:
            resp = fail.response()
            resp.headers[hdrs.CONTENT_RANGE] = f"bytes */{size}"
            return resp
        ctype = mimetypes.guess_type(path)[0] or "application/octet-stream"
        resp = web.StreamResponse(
            status=206 if byte_range else 200,
            headers={
                hdrs.CONTENT_TYPE: ctype,
                hdrs.CONTENT_DISPOSITION: f'inline; filename="{os.path.basename(path)}"',
                hdrs.VARY: "Accept-Encoding",
                hdrs.ACCEPT_RANGES: "bytes",
                hdrs.LAST_MODIFIED: formatdate(st.st_mtime, usegmt=True),
            },
        )
        start, end = byte_range if byte_range else (0, size - 1)
        compressor = None
        if byte_range:
            resp.headers[hdrs.CONTENT_RANGE] = f"bytes {start}-{end}/{size}"
        elif _accepts_gzip(request.headers.get(hdrs.ACCEPT_ENCODING, "")) and await _on_io(_worth_compressing, fd):
            compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
            resp.headers[hdrs.CONTENT_ENCODING] = "gzip"
        if compressor is None and _host_may_send(request, state, st, ranged=byte_range is not None):
            # The response's status, headers and bytes, and the file's canonical path: the host opens
            # it in the sandbox's root (never outside it) and checks it is the same file first.
            return web.json_response(
                {"path": await _on_io(os.path.realpath, path), "size": size, "mtime": st.st_mtime,
                 "status": resp.status, "offset": start, "count": end - start + 1, "headers": dict(resp.headers)},
                headers={HOST_READ_HEADER: "1"})
        if compressor is None:
            resp.content_length = end - start + 1
        await resp.prepare(request)
        if request.method == hdrs.METH_HEAD:
            pass  # headers only (the route also answers HEAD)
        elif compressor is None:
            await _send_plain(request, resp, fd, start, end - start + 1)
        else:
            await _send_gzip(resp, fd, compressor, start, end)
        await resp.write_eof()
        return resp
    finally:
        os.close(fd)


# ---- POST /files -------------------------------------------------------------------------------------


def _metadata_headers(request: web.Request) -> dict[str, str]:
    """`X-Metadata-<key>` headers -> {key lowercased: value}; the first of repeated headers wins."""
    meta: dict[str, str] = {}
    total = 0
    for key, value in request.headers.items():
        if not key.lower().startswith(METADATA_HEADER_PREFIX):
            continue
        name = key[len(METADATA_HEADER_PREFIX):].lower()
        if not name or name in meta:
            continue
        if not _PRINTABLE.match(name) or not _PRINTABLE.match(value):
            raise HTTPFail(400, f"invalid metadata header {key!r}: only printable ASCII is allowed")
        if len(name) > MAX_METADATA_KEY:
            raise HTTPFail(400, f"invalid metadata key {name!r}: longer than {MAX_METADATA_KEY} bytes")
        meta[name] = value
        total += len(XATTR_PREFIX) + len(name) + len(value)
    if total > MAX_METADATA_TOTAL:
        raise HTTPFail(400, f"file metadata too large: {total} bytes of names and values, at most {MAX_METADATA_TOTAL}")
    return meta


class _Budget:
    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> None:
        self.used += n
        if self.limit is not None and self.used > self.limit:
            raise HTTPFail(413, f"upload exceeds the limit of {self.limit} bytes")


def _copy_from(src: int, dst: int, budget: _Budget) -> None:
    """All of `src` into `dst` (both at offset 0) by sendfile(2): no buffers in this process."""
    budget.take(os.fstat(src).st_size)
    while os.sendfile(dst, src, None, 1 << 30):
        pass


async def _receive(state: EnvdState, user: User, path: str, chunks, budget: _Budget, meta: dict,
                   source: int | None = None) -> dict:
    """Stream `chunks` (async iterator of bytes), or else the file `source`, into `path` with file metadata
    `meta` (which replaces the file's earlier metadata, none clearing it); remove the partial file on
    failure."""
    try:
        await ensure_dirs(state.executor, user, os.path.dirname(path))
        fd = await state.executor.run(user, _open_upload, path, meta, user.uid, user.gid)
    except MetadataUnsupported:
        raise HTTPFail(400, f"file metadata cannot be stored at '{path}': its filesystem has no user "
                            "extended attributes (user.e2b.*); nothing was written") from None
    except OSError as exc:
        if exc.errno in (errno.E2BIG, errno.ERANGE):
            raise HTTPFail(400, f"file metadata too large for the filesystem of '{path}'") from None
        raise _os_fail(exc, path) from None
    ok = False
    writer = BatchWriter(fd)
    try:
        if source is not None:
            await _on_io(_copy_from, source, fd, budget)
        else:
            async for chunk in chunks:
                if not chunk:
                    continue
                budget.take(len(chunk))
                await writer.add(chunk)
        await writer.finish()
        stored = await _on_io(read_metadata, fd)
        ok = True
    except OSError as exc:
        raise _os_fail(exc, path) from None
    finally:
        writer.settle()
        os.close(fd)
        if not ok:
            await state.executor.run(user, _unlink_quiet, path)
    out = {"name": os.path.basename(path), "path": path, "type": "file"}
    if stored:  # what the file holds now, read back, as E2B's envd answers
        out["metadata"] = stored
    return out


def part_filename(part) -> str | None:
    """The part's filename verbatim. aiohttp's own parser strips leading slashes (it assumes browser
    uploads), but E2B clients put the absolute destination path there."""
    header = part.headers.get(hdrs.CONTENT_DISPOSITION)
    if not header:
        return None
    msg = Message()
    msg[hdrs.CONTENT_DISPOSITION] = header
    return msg.get_filename()


async def _body_pieces(request: web.Request):
    """A raw request body as the pieces that arrived (no re-chunking copies)."""
    content = request.content
    while True:
        piece = await content.readany()
        if not piece:
            return
        yield piece


async def part_chunks(part):
    """A multipart part's bytes, CHUNK at a time (also the host's staging of a part, `hostfiles`)."""
    while True:
        chunk = await part.read_chunk(CHUNK)
        if not chunk:
            return
        yield chunk


async def _guard_multipart(aw):
    """Awaits a step that parses the multipart body: aiohttp's ValueError/AssertionError there mean
    a malformed body, the client's error (400), not ours."""
    try:
        return await aw
    except (ValueError, AssertionError) as exc:
        raise HTTPFail(400, f"malformed multipart body: {exc or type(exc).__name__}") from None


async def _next_part(reader):
    return await _guard_multipart(reader.next())


def _destination(query_path: str | None, filename: str | None, user: User, seen: set[str], multipart: bool) -> str:
    """Where one file of an upload goes: the `path` query, else its part's filename; once each."""
    raw = query_path or filename
    if not raw:
        raise HTTPFail(400, "missing destination path (no 'path' query and no part filename)"
                       if multipart else "path is required for a non-multipart upload")
    path = _resolve(raw, user)
    if path in seen:
        raise HTTPFail(400, f"path '{path}' is given more than once")
    seen.add(path)
    return path


def staged_header(multipart: bool, staging: str, files: list[dict[str, str | None]]) -> str:
    """The `STAGED_HEADER` value the host sends (`_staged_list` reads it back): the upload's kind,
    its staging dir, and each staged file's name with its part's filename."""
    return json.dumps({"multipart": multipart, "dir": staging, "files": files})


def _staged_list(raw: str) -> tuple[bool, str, list[tuple[str, str | None]]]:
    try:
        doc = json.loads(raw)
        files = [(str(f["name"]), None if f.get("filename") is None else str(f["filename"])) for f in doc["files"]]
        multipart, staging = bool(doc["multipart"]), str(doc["dir"])
    except (ValueError, KeyError, TypeError):
        raise HTTPFail(400, f"malformed {STAGED_HEADER} header") from None
    if not _STAGED_DIR.match(staging) or any(not _STAGED_FILE.match(name) for name, _ in files):
        raise HTTPFail(400, f"malformed {STAGED_HEADER} header")
    return multipart, staging, files


# Staging dirs of uploads being taken right now, and how long one left behind must have gone
# unwritten before `sweep_staged` removes it.
_TAKING: set[str] = set()
STAGED_MAX_AGE_S = 600.0


def _last_write(path: str) -> float:
    """The newest mtime of a staging dir and its files (the host may still be writing one)."""
    times = [os.stat(path).st_mtime]
    with os.scandir(path) as entries:
        times += [e.stat(follow_symlinks=False).st_mtime for e in entries]
    return max(times)


def sweep_staged() -> list[str]:
    """Remove staging dirs in "/" that nobody took and nobody wrote to for `STAGED_MAX_AGE_S` (their
    request broke off, e.g. by a pause). Run when a new one is made: only sandboxes that stage uploads
    pay for the scan."""
    removed = []
    now = time.time()
    with os.scandir("/") as entries:
        for entry in entries:
            if not _STAGED_DIR.match(entry.name) or entry.name in _TAKING:
                continue
            try:
                if now - _last_write(entry.path) > STAGED_MAX_AGE_S:
                    shutil.rmtree(entry.path)
                    removed.append(entry.name)
            except OSError:
                pass
    return removed


def _make_staging_dir() -> str:
    sweep_staged()
    name = STAGED_PREFIX + secrets.token_hex(16)
    os.mkdir("/" + name, 0o700)
    return name


def _open_staged(path: str) -> int:
    """The staged file; if gVisor answers ENOENT from a listing of the dir cached meanwhile (something
    listed it), a create and remove in the dir drops that listing and the lookup goes to the host."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, flags)
    except FileNotFoundError:
        probe = os.path.join(os.path.dirname(path), ".probe")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        os.unlink(probe)
        return os.open(path, flags)


async def _receive_staged(state: EnvdState, user: User, query_path: str | None, raw: str, budget: _Budget,
                          meta: dict) -> list[dict]:
    """An upload whose body the host wrote to files in a staging dir (`agentenv.proxy.hostfiles`): the
    same checks and results as `post_files`, the bytes copied from the staged files, which go afterwards."""
    multipart, staging, files = _staged_list(raw)
    results: list[dict] = []
    seen: set[str] = set()
    _TAKING.add(staging)
    try:
        for name, filename in files:
            path = _destination(query_path, filename, user, seen, multipart)
            try:
                fd = await _on_io(_open_staged, f"/{staging}/{name}")
            except OSError as exc:
                raise HTTPFail(500, f"the upload staged by the host is not in the sandbox ({exc.strerror})") from None
            try:
                results.append(await _receive(state, user, path, None, budget, meta, source=fd))
            finally:
                os.close(fd)
        if multipart and not results:
            raise HTTPFail(400, "no file part in the request")
        return results
    finally:
        await _on_io(shutil.rmtree, "/" + staging, True)
        _TAKING.discard(staging)


async def post_staged(request: web.Request) -> web.StreamResponse:
    """`POST /agentenv/files` (`STAGED_PATH`), the host's half of an upload it stages
    (`agentenv.proxy.hostfiles`), with the upload's own query and credentials plus the host token:
    - with `HOST_WRITE_HEADER: <length>`, the checks `POST /files` makes before reading a body, then a
      new staging dir (204, its name in the same header; "" if none could be made);
    - with `STAGED_HEADER`, the upload itself, taken from the staged files: `POST /files`'s answer.
    Every answer to the first carries `HOST_WRITE_HEADER`, so that the host tells it from the 404 of an
    envd without this route (a sandbox restored from an older image) and sends the body itself."""
    state = get_state(request)
    staged = request.headers.get(STAGED_HEADER)
    try:
        if not state.from_host(request):
            raise HTTPFail(401, UNAUTHORIZED_MESSAGE)
        check_access(request, state, "write")
        user = files_user(request, state)
        meta = _metadata_headers(request)
        budget = _Budget(state.max_upload)
        if staged is not None:
            return web.json_response(await _receive_staged(state, user, request.query.get("path"), staged, budget, meta))
        length = request.headers.get(HOST_WRITE_HEADER, "")
        if not length.isdigit():
            raise HTTPFail(400, f"{HOST_WRITE_HEADER} must be the upload's length")
        if budget.limit is not None and int(length) > budget.limit:
            raise HTTPFail(413, f"upload exceeds the limit of {budget.limit} bytes")
        try:
            staging = await _on_io(_make_staging_dir)
        except OSError:
            staging = ""  # none: the host sends the body to `POST /files` as usual
        return web.Response(status=204, headers={HOST_WRITE_HEADER: staging})
    except HTTPFail as fail:
        response = fail.response()
        if staged is None:
            response.headers[HOST_WRITE_HEADER] = "refused"
        else:  # refused before taking it (an expired signature): the staged bytes go now, not at a sweep
            await _on_io(_discard_staged, staged)
        return response


def _discard_staged(raw: str) -> None:
    try:
        _, staging, _ = _staged_list(raw)
    except HTTPFail:  # not a staged upload's header: nothing of ours to remove
        return
    shutil.rmtree("/" + staging, True)


async def post_files(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    try:
        check_access(request, state, "write")
        user = files_user(request, state)
        meta = _metadata_headers(request)
        budget = _Budget(state.max_upload)
        if request.content_length is not None and budget.limit is not None and request.content_length > budget.limit:
            raise HTTPFail(413, f"upload exceeds the limit of {budget.limit} bytes")
        query_path = request.query.get("path")
        results: list[dict] = []
        if request.content_type.startswith("multipart/"):
            reader = await request.multipart()
            seen: set[str] = set()
            while True:
                part = await _next_part(reader)
                if part is None:
                    break
                if part.name != "file":
                    await _guard_multipart(part.release())
                    continue
                path = _destination(query_path, part_filename(part), user, seen, True)
                results.append(await _guard_multipart(_receive(state, user, path, part_chunks(part), budget, meta)))
            if not results:
                raise HTTPFail(400, "no file part in the request")
        else:
            path = _destination(query_path, None, user, set(), False)
            results.append(await _receive(state, user, path, _body_pieces(request), budget, meta))
    except HTTPFail as fail:
        return fail.response()
    return web.json_response(results)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/files", get_files)
    app.router.add_post("/files", post_files)
    app.router.add_post(STAGED_PATH, post_staged)
