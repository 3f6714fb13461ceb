"""Per-sandbox overlays: mount lifecycle, isolation, orphan cleanup, upper copies for forks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentenv.errors import BadRequest, NotFound
from agentenv.storage._util import mounts_under
from agentenv.storage.rootfs import RootfsManager


async def test_prepare_release_leaves_nothing(rootfs_mgr: RootfsManager, base_rootfs: Path) -> None:
    root = await rootfs_mgr.prepare("sb1", [base_rootfs])
    assert rootfs_mgr.is_mounted("sb1")
    assert (root / "etc/os-release").read_text() == (base_rootfs / "etc/os-release").read_text()
    assert await rootfs_mgr.prepare("sb1", [base_rootfs]) == root  # idempotent
    assert len(mounts_under(rootfs_mgr.paths.sandbox_dir("sb1"))) == 1
    await rootfs_mgr.release("sb1")
    assert not rootfs_mgr.is_mounted("sb1")
    assert not rootfs_mgr.paths.sandbox_dir("sb1").exists()
    await rootfs_mgr.release("sb1")  # idempotent
    await rootfs_mgr.release("never-existed")


async def test_release_while_busy_detaches(rootfs_mgr: RootfsManager, base_rootfs: Path) -> None:
    root = await rootfs_mgr.prepare("busy", [base_rootfs])
    fd = os.open(root / "etc/hostname", os.O_RDONLY)  # keeps the mount busy
    try:
        await rootfs_mgr.release("busy")
        assert not rootfs_mgr.paths.sandbox_dir("busy").exists()
    finally:
        os.close(fd)


async def test_writes_are_private(rootfs_mgr: RootfsManager, base_rootfs: Path) -> None:
    a = await rootfs_mgr.prepare("a", [base_rootfs])
    b = await rootfs_mgr.prepare("b", [base_rootfs])
    (a / "home/user/note.txt").write_text("from a")
    (a / "etc/hostname").write_text("changed\n")
    (a / "etc/issue").unlink()
    assert not (b / "home/user/note.txt").exists()
    assert (b / "etc/hostname").read_text() == (base_rootfs / "etc/hostname").read_text() != "changed\n"
    assert (b / "etc/issue").exists() and (base_rootfs / "etc/issue").exists()
    assert not (base_rootfs / "home/user/note.txt").exists()
    assert (rootfs_mgr.upper_path("a") / "home/user/note.txt").read_text() == "from a"


async def test_multiple_lowers_top_first(rootfs_mgr: RootfsManager, base_rootfs: Path, tmp_path: Path) -> None:
    top = tmp_path / "layer"
    (top / "etc").mkdir(parents=True)
    (top / "etc/hostname").write_text("from-top\n")
    root = await rootfs_mgr.prepare("layered", [top, base_rootfs])
    assert (root / "etc/hostname").read_text() == "from-top\n"
    assert (root / "bin/bash").exists()


async def test_cleanup_orphans(rootfs_mgr: RootfsManager, base_rootfs: Path) -> None:
    await rootfs_mgr.prepare("orphan-mounted", [base_rootfs])
    await rootfs_mgr.prepare("kept", [base_rootfs])
    rootfs_mgr.paths.sandbox_dir("orphan-dir").mkdir(parents=True)
    removed = await rootfs_mgr.cleanup_orphans({"kept"})
    assert sorted(removed) == ["orphan-dir", "orphan-mounted"]
    assert not rootfs_mgr.paths.sandbox_dir("orphan-mounted").exists()
    assert not rootfs_mgr.is_mounted("orphan-mounted")
    assert rootfs_mgr.is_mounted("kept")
    assert await rootfs_mgr.cleanup_orphans({"kept"}) == []


async def test_copy_upper_for_fork_child(rootfs_mgr: RootfsManager, base_rootfs: Path) -> None:
    parent = await rootfs_mgr.prepare("parent", [base_rootfs])
    (parent / "home/user/work").mkdir()
    (parent / "home/user/work/f").write_text("data")
    os.link(parent / "home/user/work/f", parent / "home/user/work/hardlink")
    os.chown(parent / "home/user/work/f", 1000, 1000)
    (parent / "etc/issue").unlink()  # a whiteout in the upper
    await rootfs_mgr.copy_upper("parent", "child")
    child = await rootfs_mgr.prepare("child", [base_rootfs])
    st = (child / "home/user/work/f").stat()
    assert (child / "home/user/work/f").read_text() == "data" and (st.st_uid, st.st_gid) == (1000, 1000)
    assert st.st_ino == (child / "home/user/work/hardlink").stat().st_ino
    assert not (child / "etc/issue").exists()
    (child / "home/user/work/f").write_text("child only")
    assert (parent / "home/user/work/f").read_text() == "data"
    with pytest.raises(Exception):
        await rootfs_mgr.copy_upper("parent", "child")  # child already has an upper


async def test_bad_input(rootfs_mgr: RootfsManager, tmp_path: Path) -> None:
    with pytest.raises(BadRequest):
        await rootfs_mgr.prepare("../x", [tmp_path])
    with pytest.raises(BadRequest):
        await rootfs_mgr.prepare("x", [])
    with pytest.raises(NotFound):
        await rootfs_mgr.prepare("x", [tmp_path / "missing"])


async def test_tools_mount_point_exists(rootfs_mgr: RootfsManager, base_rootfs: Path) -> None:
    from agentenv.constants import TOOLS_MOUNT

    root = await rootfs_mgr.prepare("mp", [base_rootfs])
    assert (root / TOOLS_MOUNT.lstrip("/")).is_dir()
