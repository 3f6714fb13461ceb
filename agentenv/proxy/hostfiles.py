"""Large file transfers between the client and the host's view of a sandbox's disk, not through the
sandbox's network (docs/proxy.md, "Downloads from the host, uploads staged on it").

Under gVisor a sandbox's root filesystem is an overlay mount on the host (`storage/rootfs.py`), and
gVisor writes a sandbox's file writes (and shared mappings) straight through to the host file. A large
`/files` transfer through gVisor's network stack moves ~150-300 MiB/s; between the client and the
host's page cache it moves at disk speed. For a sandbox whose runtime declares
`RuntimeTraits.shares_rootfs`, the traffic proxy still asks envd first, with the host token, and envd
decides everything it decides for any transfer (token or signature, user, permissions, ranges, gzip,
the size limit):

- a download (`HOST_READ_HEADER`): for a whole, uncompressed file of at least `MIN_BYTES` on the
  sandbox's root filesystem envd answers with the file's canonical path, size and response headers
  instead of the bytes, and the proxy sends the file itself (`open_checked`, `sendfile(2)`); a path
  that is not a regular file of that size there goes back to envd;
- an upload of at least `MIN_BYTES` (`HOST_WRITE_HEADER`): envd checks it and makes a new staging dir,
  the proxy writes the body (each multipart file part) into it (`Stage`), and envd takes the files
  (`STAGED_HEADER`): it opens each destination as for any upload and copies the bytes in.

The host opens every path with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS)`
below the sandbox's rootfs: symlinks and `..` resolve inside the sandbox's own tree, never into the
host's, whatever envd (a program in the sandbox) answered.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from agentenv.envd.files import HOST_READ_HEADER, HOST_WRITE_HEADER, STAGED_HEADER, STAGED_PREFIX, part_filename

__all__ = ["HOST_READ_HEADER", "HOST_WRITE_HEADER", "STAGED_HEADER", "MIN_BYTES", "HostFiles", "Stage",
           "open_checked", "open_in_root", "part_filename"]

# Below this a download or upload goes through envd as before: the bytes are few.
MIN_BYTES = 1 << 20

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


@dataclass(frozen=True)
class HostFiles:
    """What the traffic proxy needs to send downloads from the host: the rootfs of a sandbox whose
    runtime shares it (None otherwise), and the host token envd wants with `HOST_READ_HEADER`."""

    root_of: Callable[[str], Path | None]
    host_token: str


def open_checked(root: Path, path: str, size: int) -> int | None:
    """The fd of envd's answer, if it is a regular file of `size` bytes below `root`; else None."""
    try:
        fd = open_in_root(root, path)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        os.close(fd)
        return None
    return fd


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


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
