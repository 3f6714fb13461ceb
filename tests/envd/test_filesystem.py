"""filesystem.Filesystem through the SDK: stat/list/mkdir/move/remove, watchers (streamed and polled)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from e2b import FileType, FilesystemEventType
from e2b.exceptions import InvalidArgumentException, NotFoundException, SandboxException


def test_stat_entry_info(sbx, temp_user, workdir):
    with open(f"{workdir}/f.txt", "w") as f:
        f.write("abc")
    os.chmod(f"{workdir}/f.txt", 0o640)
    os.chown(f"{workdir}/f.txt", temp_user.uid, -1)
    os.symlink(f"{workdir}/f.txt", f"{workdir}/link")
    info = sbx.files.get_info(f"{workdir}/f.txt")
    assert (info.name, info.path, info.type, info.size) == ("f.txt", f"{workdir}/f.txt", FileType.FILE, 3)
    assert info.mode == 0o640 and info.permissions == "-rw-r-----"
    assert info.owner == temp_user.name
    assert abs(info.modified_time.timestamp() - os.stat(f"{workdir}/f.txt").st_mtime) < 1
    d = sbx.files.get_info(workdir)
    assert d.type == FileType.DIR and d.permissions.startswith("d")
    link = sbx.files.get_info(f"{workdir}/link")
    assert link.symlink_target == f"{workdir}/f.txt"
    assert link.permissions.startswith("L")
    tmp = sbx.files.get_info("/tmp", user="root")
    assert tmp.permissions == "dtrwxrwxrwx"
    assert sbx.files.exists(f"{workdir}/f.txt")
    assert not sbx.files.exists(f"{workdir}/nope")
    with pytest.raises(NotFoundException):
        sbx.files.get_info(f"{workdir}/nope")


def test_list_depth(sbx, workdir):
    os.makedirs(f"{workdir}/a/b/c")
    open(f"{workdir}/a/x.txt", "w").close()
    open(f"{workdir}/a/b/y.txt", "w").close()
    names = sorted(e.path for e in sbx.files.list(workdir))
    assert names == [f"{workdir}/a"]
    names = sorted(os.path.relpath(e.path, workdir) for e in sbx.files.list(workdir, depth=2))
    assert names == ["a", "a/b", "a/x.txt"]
    names = sorted(os.path.relpath(e.path, workdir) for e in sbx.files.list(workdir, depth=3))
    assert names == ["a", "a/b", "a/b/c", "a/b/y.txt", "a/x.txt"]
    with pytest.raises(InvalidArgumentException):
        sbx.files.list(f"{workdir}/a/x.txt")
    with pytest.raises(NotFoundException):
        sbx.files.list(f"{workdir}/missing")


def test_make_dir_move_remove(sbx, temp_user, workdir):
    assert sbx.files.make_dir(f"{workdir}/n1/n2") is True
    assert os.stat(f"{workdir}/n1").st_uid == temp_user.uid
    assert sbx.files.make_dir(f"{workdir}/n1/n2") is False
    open(f"{workdir}/plain", "w").close()
    with pytest.raises(InvalidArgumentException):
        sbx.files.make_dir(f"{workdir}/plain")
    entry = sbx.files.rename(f"{workdir}/plain", f"{workdir}/deep/er/moved")
    assert entry.path == f"{workdir}/deep/er/moved" and entry.name == "moved"
    assert os.path.exists(f"{workdir}/deep/er/moved") and not os.path.exists(f"{workdir}/plain")
    with pytest.raises(NotFoundException):
        sbx.files.rename(f"{workdir}/plain", f"{workdir}/x")
    sbx.files.remove(f"{workdir}/deep")
    assert not os.path.exists(f"{workdir}/deep")
    sbx.files.remove(f"{workdir}/deep")  # missing: no error
    with pytest.raises(SandboxException):
        sbx.files.make_dir("/root/not-allowed-for-user")
    assert not os.path.exists("/root/not-allowed-for-user")


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_polled_watcher(sbx, workdir):
    sbx.files.make_dir(f"{workdir}/sub")
    handle = sbx.files.watch_dir(workdir, recursive=True, include_entry=True)
    try:
        sbx.files.write(f"{workdir}/w.txt", "1")
        sbx.files.write(f"{workdir}/sub/inner.txt", "2")
        os.rename(f"{workdir}/w.txt", f"{workdir}/w2.txt")
        os.remove(f"{workdir}/w2.txt")
        events = []
        def got_all():
            events.extend(handle.get_new_events())
            kinds = {(e.name, e.type) for e in events}
            return {("w.txt", FilesystemEventType.CREATE), ("sub/inner.txt", FilesystemEventType.CREATE),
                    ("w.txt", FilesystemEventType.RENAME), ("w2.txt", FilesystemEventType.REMOVE)} <= kinds
        wait_for(got_all)
        created = [e for e in events if e.type == FilesystemEventType.CREATE and e.name == "w.txt"]
        assert created[0].entry is not None and created[0].entry.name == "w.txt"
        assert any(e.type == FilesystemEventType.WRITE for e in events)
    finally:
        handle.stop()


def test_watch_errors(sbx, workdir):
    with pytest.raises(NotFoundException):
        sbx.files.watch_dir(f"{workdir}/missing")
    open(f"{workdir}/file", "w").close()
    with pytest.raises(InvalidArgumentException):
        sbx.files.watch_dir(f"{workdir}/file")


async def test_streamed_watch(asbx, workdir):
    events = []
    handle = await asbx.files.watch_dir(workdir, on_event=events.append, recursive=True)
    try:
        await asbx.files.write(f"{workdir}/s.txt", "x")
        await asbx.files.make_dir(f"{workdir}/newdir")
        await asyncio.sleep(0.2)
        await asbx.files.write(f"{workdir}/newdir/nested.txt", "y")  # watch added for the new dir
        deadline = time.monotonic() + 5
        want = {("s.txt", FilesystemEventType.CREATE), ("newdir", FilesystemEventType.CREATE),
                ("newdir/nested.txt", FilesystemEventType.CREATE)}
        while not want <= {(e.name, e.type) for e in events}:
            assert time.monotonic() < deadline, f"events so far: {events}"
            await asyncio.sleep(0.05)
    finally:
        await handle.stop()
