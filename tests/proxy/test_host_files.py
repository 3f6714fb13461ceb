"""Opening a file the way the data plane does for a download sent from the host
(agentenv/proxy/hostfiles.py): inside the sandbox's root, whatever its links say."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentenv.proxy.hostfiles import open_checked, open_in_root


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A sandbox root and, beside it, a host file that links inside the root must never reach."""
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "secret").write_bytes(b"inside")
    outside = tmp_path / "outside"
    outside.write_bytes(b"host!!")
    (root / "abs").symlink_to(outside)                          # an absolute host path
    (root / "up").symlink_to("../../../../../../../../etc/secret")
    (root / "host-abs").symlink_to("/etc/secret")
    (root / "dir").mkdir()
    return root, outside


def read_fd(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def test_links_resolve_with_the_root_as_slash(tree):
    root, outside = tree
    assert read_fd(open_in_root(root, "/etc/secret")) == b"inside"
    assert read_fd(open_in_root(root, "/up")) == b"inside"          # `..` stops at the root
    assert read_fd(open_in_root(root, "/host-abs")) == b"inside"    # "/" is the root
    assert read_fd(open_in_root(root, "/../../etc/secret")) == b"inside"
    # The absolute link names <root>/<host path>, which does not exist: never the host file.
    with pytest.raises(FileNotFoundError):
        open_in_root(root, "/abs")
    assert outside.read_bytes() == b"host!!"


def test_checked_open_wants_a_regular_file_of_the_size_envd_saw(tree):
    root, _ = tree
    fd = open_checked(root, "/etc/secret", 6)
    assert fd is not None
    assert read_fd(fd) == b"inside"
    assert open_checked(root, "/etc/secret", 7) is None   # changed since envd looked
    mtime = os.stat(root / "etc" / "secret").st_mtime
    fd = open_checked(root, "/etc/secret", 6, mtime + 1)  # gVisor's own copy of the time, a little off
    assert fd is not None
    os.close(fd)
    assert open_checked(root, "/etc/secret", 6, mtime - 60) is None  # another file of the same size
    assert open_checked(root, "/dir", 0) is None          # not a regular file
    assert open_checked(root, "/missing", 0) is None
    assert open_checked(root, "/etc/sec\0ret", 6) is None
