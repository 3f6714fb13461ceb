"""Storage fixtures: one real base image + tools layer shared by the whole session.

The base image takes ~1 min to debootstrap, so it is built into ``$AGENTENV_TEST_DATA_DIR/images``
(default /var/tmp/agentenv-test) only when absent and reused across runs (the server tests use the
same dir). Per-test overlays live under pytest's tmp_path and are torn down even on failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from agentenv.config import Paths, Settings
from agentenv.storage._util import mounts_under
from agentenv.storage.images import ImageStore
from agentenv.storage.rootfs import RootfsManager


def _require_root_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("storage tests need root (mounts, chroot)")
    for tool in ("debootstrap", "unshare", "chroot"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")


@pytest.fixture(scope="session")
def test_data_dir() -> Path:
    return Path(os.environ.get("AGENTENV_TEST_DATA_DIR", "/var/tmp/agentenv-test"))


@pytest.fixture(scope="session")
def store(test_data_dir: Path) -> ImageStore:
    _require_root_tools()
    return ImageStore(Settings(data_dir=test_data_dir))


@pytest_asyncio.fixture(scope="session")
async def base_rootfs(store: ImageStore) -> Path:
    return await store.ensure_base()


@pytest_asyncio.fixture(scope="session")
async def tools_dir(store: ImageStore, base_rootfs: Path) -> Path:
    return await store.ensure_tools()


@pytest_asyncio.fixture
async def rootfs_mgr(tmp_path: Path) -> AsyncIterator[RootfsManager]:
    """A manager over a private data dir; everything it mounted is removed afterwards, pass or fail."""
    _require_root_tools()
    mgr = RootfsManager(Paths(tmp_path / "data"))
    try:
        yield mgr
    finally:
        await mgr.cleanup_orphans(set())
        assert mounts_under(tmp_path) == [], "a test leaked a mount"
