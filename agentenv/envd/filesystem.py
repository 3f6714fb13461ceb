"""filesystem.Filesystem: stat/list/mkdir/move/remove as the selected user, and inotify directory watches."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from asyncinotify import Inotify, Mask

from agentenv.envd import connect
from agentenv.envd.connect import ConnectError, field as pfield
from agentenv.envd.dirs import ensure_dirs
from agentenv.envd.entry import entry_info, is_missing
from agentenv.envd.process import keepalive_interval, pump
from agentenv.envd.state import get_state, rpc_user
from agentenv.envd.users import User, resolve_path

log = logging.getLogger("agentenv.envd")


def os_error(exc: OSError, path: str) -> ConnectError:
    """Map an OSError to the Connect code the SDKs expect."""
    if is_missing(exc):
        return ConnectError("not_found", f"path '{path}' does not exist")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ConnectError("permission_denied", f"permission denied: '{path}'")
    if exc.errno == errno.EEXIST:
        return ConnectError("already_exists", f"path '{path}' already exists")
    if exc.errno == errno.ELOOP:
        return ConnectError("failed_precondition", f"too many levels of symbolic links: '{path}'")
    if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.EINVAL, errno.ENAMETOOLONG):
        return ConnectError("invalid_argument", f"{exc.strerror}: '{path}'")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ConnectError("resource_exhausted", f"no space left on device: '{path}'")
    return ConnectError("internal", f"{exc.strerror or exc}: '{path}'")


def _path_arg(msg: dict, name: str, user: User) -> str:
    raw = pfield(msg, name)
    if not raw:
        raise ConnectError("invalid_argument", f"{name} is required")
    return resolve_path(str(raw), user)


async def _as_user(request: web.Request, user: User, path: str, fn, *args):
    try:
        return await get_state(request).executor.run(user, fn, *args)
    except OSError as exc:
        raise os_error(exc, path) from None


# ---- blocking operations (run on the user's credentials) -------------------------------------------


def _stat(path: str) -> dict:
    return entry_info(path)


def _list_dir(path: str, depth: int) -> list[dict]:
    st = os.stat(path)  # follows a symlinked root; ELOOP for cycles
    if not stat.S_ISDIR(st.st_mode):
        raise ConnectError("invalid_argument", f"path '{path}' is not a directory")
    out: list[dict] = []

    def walk(real: str, shown: str, level: int) -> None:
        with os.scandir(real) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            shown_path = os.path.join(shown, e.name)
            try:
                out.append(entry_info(shown_path, e.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue
            if level < depth and e.is_dir(follow_symlinks=False):
                with contextlib.suppress(PermissionError, FileNotFoundError):
                    walk(e.path, shown_path, level + 1)

    walk(path, path, 1)
    return out


def _check_new_dir(path: str) -> None:
    """MakeDir's precondition: nothing exists at `path` yet."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise ConnectError("already_exists", f"directory '{path}' already exists")
    raise ConnectError("invalid_argument", f"path '{path}' already exists and is not a directory")


def _move(src: str, dst: str) -> dict:
    os.lstat(src)
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.move(src, dst)
    return entry_info(dst)


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _check_watchable(path: str) -> None:
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConnectError("invalid_argument", f"path '{path}' is not a directory")
    os.listdir(path)  # the user must be able to read it


# ---- unary RPCs ------------------------------------------------------------------------------------


async def rpc_stat(request: web.Request, msg: dict) -> dict:
    user = rpc_user(request)
    path = _path_arg(msg, "path", user)
    return {"entry": await _as_user(request, user, path, _stat, path)}


async def rpc_list_dir(request: web.Request, msg: dict) -> dict:
    user = rpc_user(request)
    path = _path_arg(msg, "path", user)
    depth = int(pfield(msg, "depth") or 0) or 1
    return {"entries": await _as_user(request, user, path, _list_dir, path, depth)}


async def _ensure_dirs(request: web.Request, user: User, directory: str, path: str) -> None:
    """Missing directories made for the user the way E2B's envd makes them (see envd/dirs.py)."""
    try:
        await ensure_dirs(get_state(request).executor, user, directory)
    except OSError as exc:
        raise os_error(exc, path) from None


async def rpc_make_dir(request: web.Request, msg: dict) -> dict:
    user = rpc_user(request)
    path = _path_arg(msg, "path", user)
    await _as_user(request, user, path, _check_new_dir, path)
    await _ensure_dirs(request, user, path, path)
    return {"entry": await _as_user(request, user, path, entry_info, path)}


async def rpc_move(request: web.Request, msg: dict) -> dict:
    user = rpc_user(request)
    src = _path_arg(msg, "source", user)
    dst = _path_arg(msg, "destination", user)
    await _as_user(request, user, src, os.lstat, src)
    await _ensure_dirs(request, user, os.path.dirname(dst), dst)
    return {"entry": await _as_user(request, user, src, _move, src, dst)}


async def rpc_remove(request: web.Request, msg: dict) -> dict:
    user = rpc_user(request)
    path = _path_arg(msg, "path", user)
    await _as_user(request, user, path, _remove, path)
    return {}


# ---- watching --------------------------------------------------------------------------------------

WATCH_MASK = (
    Mask.CREATE | Mask.MODIFY | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.ATTRIB
    | Mask.DELETE_SELF | Mask.MOVE_SELF
)

# inotify bit -> EventType, in the order the events are emitted for one inotify record.
_EVENT_BITS = (
    (Mask.CREATE | Mask.MOVED_TO, "EVENT_TYPE_CREATE"),
    (Mask.MOVED_FROM, "EVENT_TYPE_RENAME"),
    (Mask.ATTRIB, "EVENT_TYPE_CHMOD"),
    (Mask.MODIFY, "EVENT_TYPE_WRITE"),
    (Mask.DELETE, "EVENT_TYPE_REMOVE"),
)
_WITH_ENTRY = {"EVENT_TYPE_CREATE", "EVENT_TYPE_WRITE", "EVENT_TYPE_CHMOD"}


class DirWatcher:
    """inotify watch on a directory (optionally recursive) yielding FilesystemEvent dicts."""

    def __init__(self, root: str, recursive: bool, include_entry: bool) -> None:
        self.root = root
        self.recursive = recursive
        self.include_entry = include_entry
        self._inotify = Inotify()
        self._add(root)
        if recursive:
            for dirpath, dirnames, _files in os.walk(root):
                for d in dirnames:
                    self._add(os.path.join(dirpath, d))

    def _add(self, path: str) -> None:
        try:
            self._inotify.add_watch(path, WATCH_MASK)
        except OSError as exc:
            if path == self.root:
                raise
            log.debug("cannot watch %s: %s", path, exc)

    def close(self) -> None:
        self._inotify.close()

    async def events(self) -> AsyncIterator[dict]:
        async for ev in self._inotify:
            if ev.path is None or Mask.IGNORED in ev.mask:
                continue
            full = str(ev.path)
            if ev.name is None:
                continue  # an event about a watched directory itself; its parent reports it
            rel = os.path.relpath(full, self.root)
            if self.recursive and Mask.ISDIR in ev.mask and ev.mask & (Mask.CREATE | Mask.MOVED_TO):
                self._add(full)
                for dirpath, dirnames, _files in os.walk(full):
                    for d in dirnames:
                        self._add(os.path.join(dirpath, d))
            for bits, name in _EVENT_BITS:
                if not ev.mask & bits:
                    continue
                event: dict[str, Any] = {"name": rel, "type": name}
                if self.include_entry and name in _WITH_ENTRY:
                    with contextlib.suppress(OSError):
                        event["entry"] = entry_info(full)
                yield event


async def _open_watcher(request: web.Request, msg: dict) -> DirWatcher:
    user = rpc_user(request)
    path = _path_arg(msg, "path", user)
    await _as_user(request, user, path, _check_watchable, path)
    try:
        # Adding watches walks the tree (recursive): keep that off the event loop.
        return await asyncio.get_running_loop().run_in_executor(
            None, DirWatcher, path, bool(pfield(msg, "recursive")), bool(pfield(msg, "includeEntry"))
        )
    except OSError as exc:
        raise os_error(exc, path) from None


async def rpc_watch_dir(request: web.Request, msg: dict) -> AsyncIterator[dict]:
    watcher = await _open_watcher(request, msg)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def forward() -> None:
        async for event in watcher.events():
            queue.put_nowait({"filesystem": event})

    task = loop.create_task(forward())
    timeout = connect.parse_timeout_ms(request.headers.get("Connect-Timeout-Ms"))
    deadline = loop.time() + timeout if timeout else None
    try:
        yield {"start": {}}
        async for item in pump(queue, keepalive_interval(request), deadline, None):
            yield item
    finally:
        task.cancel()
        watcher.close()


class PolledWatcher:
    """Server-side buffered watcher for CreateWatcher/GetWatcherEvents (the sync SDK's watch_dir)."""

    def __init__(self, watcher: DirWatcher) -> None:
        self.watcher = watcher
        self.buffer: list[dict] = []
        self.error: ConnectError | None = None
        self.task = asyncio.get_running_loop().create_task(self._collect())

    async def _collect(self) -> None:
        try:
            async for event in self.watcher.events():
                self.buffer.append(event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            self.error = ConnectError("internal", f"watcher failed: {exc}")

    def close(self) -> None:
        self.task.cancel()
        self.watcher.close()


WATCHERS_KEY: web.AppKey[dict[str, PolledWatcher]] = web.AppKey("watchers")


async def rpc_create_watcher(request: web.Request, msg: dict) -> dict:
    watcher = await _open_watcher(request, msg)
    wid = "w" + secrets.token_hex(8)
    request.app[WATCHERS_KEY][wid] = PolledWatcher(watcher)
    return {"watcherId": wid}


def _get_watcher(request: web.Request, msg: dict) -> tuple[str, PolledWatcher]:
    wid = str(pfield(msg, "watcherId") or "")
    pw = request.app[WATCHERS_KEY].get(wid)
    if pw is None:
        raise ConnectError("not_found", f"watcher '{wid}' not found")
    return wid, pw


async def rpc_get_watcher_events(request: web.Request, msg: dict) -> dict:
    rpc_user(request)
    _wid, pw = _get_watcher(request, msg)
    if pw.error:
        raise pw.error
    events, pw.buffer = pw.buffer, []
    return {"events": events}


async def rpc_remove_watcher(request: web.Request, msg: dict) -> dict:
    rpc_user(request)
    wid, pw = _get_watcher(request, msg)
    del request.app[WATCHERS_KEY][wid]
    pw.close()
    return {}


def add_routes(app: web.Application) -> None:
    app[WATCHERS_KEY] = {}
    base = "/filesystem.Filesystem/"
    app.router.add_post(base + "Stat", connect.unary(rpc_stat))
    app.router.add_post(base + "MakeDir", connect.unary(rpc_make_dir))
    app.router.add_post(base + "Move", connect.unary(rpc_move))
    app.router.add_post(base + "ListDir", connect.unary(rpc_list_dir))
    app.router.add_post(base + "Remove", connect.unary(rpc_remove))
    app.router.add_post(base + "WatchDir", connect.server_stream(rpc_watch_dir))
    app.router.add_post(base + "CreateWatcher", connect.unary(rpc_create_watcher))
    app.router.add_post(base + "GetWatcherEvents", connect.unary(rpc_get_watcher_events))
    app.router.add_post(base + "RemoveWatcher", connect.unary(rpc_remove_watcher))

    async def close_watchers(app: web.Application) -> None:
        for pw in app[WATCHERS_KEY].values():
            pw.close()
        app[WATCHERS_KEY].clear()

    app.on_cleanup.append(close_watchers)
