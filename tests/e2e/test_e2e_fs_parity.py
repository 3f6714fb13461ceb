"""Filesystem behaviours the E2B SDKs rely on, as E2B's envd shows them (issue 14 items 1, 4 and 6),
through the Python SDK (sync: polled watcher; async: streamed watch) and the JS SDK
(tests/js/fs_parity.test.mjs, streamed watch), against real sandboxes.

1. `files.write` of a new file into a watched directory yields CREATE, CHMOD, WRITE (E2B's envd creates
   the file, chowns it to the user, then writes it), also in recursive watches; the parents it makes
   yield CREATE, CHMOD.
4. `get_info` / `list` of a symlink: type and mode of what it leads to, `symlink_target` the resolved
   absolute path (the link's own path when dangling, type unknown), size and permissions the link's own.
6. Writing into directories that do not exist, outside the user's home: they are made (0755) and
   belong to the user; a place the user cannot reach still refuses and creates nothing.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from e2b import AsyncSandbox, FileType, FilesystemEventType, Sandbox
from e2b.exceptions import SandboxException

from e2e_util import new_tag, run_node_tests

E = FilesystemEventType


def _types(events, name: str) -> list:
    return [e.type for e in events if e.name == name]


def _collect_polled(handle, until, limit: float = 20.0) -> list:
    """Events of a polled (sync SDK) watcher until `until(events)` holds, plus whatever follows
    within 0.5 s (so an extra event would show)."""
    events: list = []
    deadline = time.monotonic() + limit
    while not until(events):
        assert time.monotonic() < deadline, f"events so far: {events}"
        time.sleep(0.1)
        events.extend(handle.get_new_events())
    time.sleep(0.5)
    events.extend(handle.get_new_events())
    return events


def _stat(sbx: Sandbox, path: str) -> str:
    return sbx.commands.run(f"stat -c '%U:%G %a %F' {path}").stdout.strip()


# ---- 1. watch events of files.write ------------------------------------------------------------------


def test_write_new_file_events_polled_watcher(sbx: Sandbox):
    d = f"/home/user/watch-{new_tag()}"
    sbx.files.make_dir(f"{d}/sub")
    flat = sbx.files.watch_dir(d)
    deep = sbx.files.watch_dir(d, recursive=True)
    try:
        sbx.files.write(f"{d}/new.txt", "hello")
        sbx.files.write(f"{d}/sub/inner.txt", "world")
        got = _collect_polled(flat, lambda ev: E.WRITE in _types(ev, "new.txt"))
        assert _types(got, "new.txt") == [E.CREATE, E.CHMOD, E.WRITE], got
        assert not [e for e in got if e.name.startswith("sub/")], "a flat watch reports nothing below"
        got = _collect_polled(deep, lambda ev: E.WRITE in _types(ev, "sub/inner.txt"))
        assert _types(got, "new.txt") == [E.CREATE, E.CHMOD, E.WRITE], got
        assert _types(got, "sub/inner.txt") == [E.CREATE, E.CHMOD, E.WRITE], got
        # a write that creates its directory: the directory appears and is given to the user
        sbx.files.write(f"{d}/made/x.txt", "x")
        got = _collect_polled(deep, lambda ev: E.CHMOD in _types(ev, "made"))
        assert _types(got, "made") == [E.CREATE, E.CHMOD], got
    finally:
        flat.stop()
        deep.stop()


async def test_write_new_file_events_streamed_watch(async_sbx: AsyncSandbox):
    d = f"/home/user/watch-{new_tag()}"
    await async_sbx.files.make_dir(f"{d}/sub")
    events: list = []
    handle = await async_sbx.files.watch_dir(d, on_event=events.append, recursive=True)
    try:
        await async_sbx.files.write(f"{d}/new.txt", "hello")
        await async_sbx.files.write(f"{d}/sub/inner.txt", "world")
        deadline = time.monotonic() + 20
        while E.WRITE not in _types(events, "sub/inner.txt"):
            assert time.monotonic() < deadline, f"events so far: {events}"
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        assert _types(events, "new.txt") == [E.CREATE, E.CHMOD, E.WRITE], events
        assert _types(events, "sub/inner.txt") == [E.CREATE, E.CHMOD, E.WRITE], events
    finally:
        await handle.stop()


# ---- 4. symlinks ---------------------------------------------------------------------------------------


def _make_links(sbx: Sandbox) -> str:
    d = f"/home/user/links-{new_tag()}"
    sbx.commands.run(
        f"mkdir -p {d}/dir && printf abc > {d}/f.txt && chmod 640 {d}/f.txt && chmod 750 {d}/dir && "
        f"cd {d} && ln -s f.txt to-file && ln -s dir to-dir && ln -s to-file chain && ln -s missing dangling"
    )
    return d


def test_symlink_entry_info(sbx: Sandbox):
    d = _make_links(sbx)
    expected = {  # name: (type, resolved target, mode of the target)
        "to-file": (FileType.FILE, f"{d}/f.txt", 0o640),
        "to-dir": (FileType.DIR, f"{d}/dir", 0o750),
        "chain": (FileType.FILE, f"{d}/f.txt", 0o640),
        "dangling": (None, f"{d}/dangling", 0),
    }
    link_text = {"to-file": "f.txt", "to-dir": "dir", "chain": "to-file", "dangling": "missing"}
    listed = {e.name: e for e in sbx.files.list(d)}
    # the SDK leaves entries of unknown type (the dangling link) out of a listing, as with E2B
    assert sorted(listed) == ["chain", "dir", "f.txt", "to-dir", "to-file"]
    for name, (ftype, target, mode) in expected.items():
        infos = [sbx.files.get_info(f"{d}/{name}")] + ([listed[name]] if name in listed else [])
        for info in infos:
            assert (info.name, info.path) == (name, f"{d}/{name}")
            assert info.type == ftype, (name, info)
            assert info.symlink_target == target, (name, info)
            assert info.mode == mode, (name, info)
            assert info.size == len(link_text[name]), (name, info)
            assert info.permissions == "Lrwxrwxrwx", (name, info)
            assert info.owner == "user"
    plain = listed["f.txt"]
    assert (plain.type, plain.symlink_target, plain.mode, plain.size) == (FileType.FILE, None, 0o640, 3)
    # listing through a symlinked directory keeps the path asked for
    inside = sbx.files.list(f"{d}/to-dir")
    assert inside == []
    sbx.files.write(f"{d}/dir/in.txt", "1")
    assert [e.path for e in sbx.files.list(f"{d}/to-dir")] == [f"{d}/to-dir/in.txt"]


# ---- 6. missing directories outside the home -----------------------------------------------------------


def test_write_into_missing_dirs_outside_home(sbx: Sandbox):
    top = f"/0-{new_tag()}"
    info = sbx.files.write(f"{top}/a/file.txt", "made for user")
    assert info.path == f"{top}/a/file.txt"
    assert sbx.files.read(f"{top}/a/file.txt") == "made for user"
    assert _stat(sbx, top) == "user:user 755 directory"
    assert _stat(sbx, f"{top}/a") == "user:user 755 directory"
    assert _stat(sbx, f"{top}/a/file.txt").startswith("user:user ")
    # write_files (multipart, several files), make_dir and rename do the same
    sbx.files.write_files([{"path": f"{top}-m/x/1.txt", "data": "1"}, {"path": f"{top}-m/y/2.txt", "data": "2"}])
    assert _stat(sbx, f"{top}-m/x") == _stat(sbx, f"{top}-m/y") == "user:user 755 directory"
    assert sbx.files.make_dir(f"{top}-d/p/q") is True
    assert _stat(sbx, f"{top}-d") == _stat(sbx, f"{top}-d/p/q") == "user:user 755 directory"
    moved = sbx.files.rename(f"{top}/a/file.txt", f"{top}-r/s/moved.txt")
    assert moved.path == f"{top}-r/s/moved.txt" and sbx.files.read(moved.path) == "made for user"
    assert _stat(sbx, f"{top}-r/s") == "user:user 755 directory"
    # root's own directory stays closed to the user: refused, nothing created in it
    closed = f"/root/{new_tag()}"
    with pytest.raises(SandboxException):
        sbx.files.write(f"{closed}/x.txt", "no")
    with pytest.raises(SandboxException):
        sbx.files.make_dir(f"{closed}/y")
    assert sbx.commands.run(f"test -e {closed} || echo absent", user="root").stdout.strip() == "absent"
    # as root the new directories are root's
    sbx.files.write(f"{top}-root/b/c.txt", "r", user="root")
    assert _stat(sbx, f"{top}-root/b") == "root:root 755 directory"
    sbx.commands.run(f"rm -rf {top} {top}-m {top}-d {top}-r {top}-root", user="root")


# ---- the same through the JS SDK -----------------------------------------------------------------------


def test_js_sdk_fs_parity(server):
    run_node_tests(server, "fs_parity.test.mjs", passes=3, timeout=300)

