"""E2B envd parity of the filesystem side on the host's own Linux kernel (E2B's sandboxes run Linux;
tests/e2e/test_e2e_fs_parity.py checks the same under gVisor through both SDKs): the watch events of a
write, missing directories made for the user, symlink entries."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import time

import pytest
from e2b import FileType, FilesystemEventType
from e2b.exceptions import SandboxException

E = FilesystemEventType


def _events_until(handle, done, limit: float = 10.0) -> list:
    events: list = []
    deadline = time.monotonic() + limit
    while not done(events):
        assert time.monotonic() < deadline, f"events so far: {events}"
        time.sleep(0.05)
        events.extend(handle.get_new_events())
    time.sleep(0.3)
    events.extend(handle.get_new_events())
    return events


def test_write_events_create_chmod_write(sbx, workdir):
    handle = sbx.files.watch_dir(workdir, recursive=True)
    try:
        sbx.files.write(f"{workdir}/n.txt", "new")
        events = _events_until(handle, lambda ev: any(e.name == "n.txt" and e.type == E.WRITE for e in ev))
        assert [e.type for e in events if e.name == "n.txt"] == [E.CREATE, E.CHMOD, E.WRITE], events
        # an overwrite: the file is given to the user again (CHMOD), then truncated and written
        sbx.files.write(f"{workdir}/n.txt", "again")
        events = _events_until(handle, lambda ev: any(e.name == "n.txt" and e.type == E.WRITE for e in ev))
        kinds = [e.type for e in events if e.name == "n.txt"]
        assert kinds[0] == E.CHMOD and set(kinds[1:]) == {E.WRITE}, events
    finally:
        handle.stop()


@pytest.fixture
def root_dir():
    """A root-owned 0755 directory the temp user can enter but not write."""
    path = f"/tmp/envd-root-{secrets.token_hex(4)}"
    os.mkdir(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_missing_dirs_made_for_the_user(sbx, temp_user, root_dir):
    info = sbx.files.write(f"{root_dir}/a/b/f.txt", "x")
    assert info.path == f"{root_dir}/a/b/f.txt"
    for d in (f"{root_dir}/a", f"{root_dir}/a/b"):
        st = os.stat(d)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (temp_user.uid, 0o755), d
    assert os.stat(f"{root_dir}/a/b/f.txt").st_uid == temp_user.uid
    assert sbx.files.make_dir(f"{root_dir}/m/n") is True
    assert os.stat(f"{root_dir}/m").st_uid == temp_user.uid
    # the existing directory keeps its permissions: no file of the user's directly in it
    with pytest.raises(SandboxException):
        sbx.files.write(f"{root_dir}/direct.txt", "no")
    assert not os.path.exists(f"{root_dir}/direct.txt")
    # a directory the user cannot enter: refused, nothing made in it
    closed = f"{root_dir}/closed"
    os.mkdir(closed, 0o700)
    with pytest.raises(SandboxException):
        sbx.files.write(f"{closed}/x/y.txt", "no")
    assert os.listdir(closed) == []


def test_symlink_entries(sbx, workdir):
    with open(f"{workdir}/f.txt", "w") as f:
        f.write("abc")
    os.chmod(f"{workdir}/f.txt", 0o600)
    os.mkdir(f"{workdir}/d", 0o711)
    os.symlink("f.txt", f"{workdir}/lf")
    os.symlink(f"{workdir}/d", f"{workdir}/ld")
    os.symlink("nowhere", f"{workdir}/dangling")
    lf = sbx.files.get_info(f"{workdir}/lf")
    assert (lf.type, lf.symlink_target, lf.mode, lf.size, lf.permissions) == (
        FileType.FILE, f"{workdir}/f.txt", 0o600, len("f.txt"), "Lrwxrwxrwx")
    ld = sbx.files.get_info(f"{workdir}/ld")
    assert (ld.type, ld.symlink_target, ld.mode, ld.size) == (FileType.DIR, f"{workdir}/d", 0o711, len(f"{workdir}/d"))
    dangling = sbx.files.get_info(f"{workdir}/dangling")
    assert (dangling.type, dangling.symlink_target, dangling.mode) == (None, f"{workdir}/dangling", 0)
    listed = {e.name: e for e in sbx.files.list(workdir)}
    assert sorted(listed) == ["d", "f.txt", "ld", "lf"]  # the SDK drops the entry of unknown type
    assert (listed["ld"].type, listed["ld"].symlink_target) == (FileType.DIR, f"{workdir}/d")
