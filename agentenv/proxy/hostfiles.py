"""Downloads sent from the sandbox's disk on the host, not through the sandbox's network.

Under gVisor a sandbox's root filesystem is an overlay mount on the host (`storage/rootfs.py`), and
gVisor writes a sandbox's file writes (and shared mappings) straight through to the host file. A large
`GET /files` through gVisor's network stack moves ~150-300 MiB/s; the same bytes sent from the host's
page cache move at disk speed. So for a download into a sandbox whose runtime declares
`RuntimeTraits.shares_rootfs`, the traffic proxy still asks envd first -- envd checks the access token
or signature, the user and its permissions, and decides ranges and gzip exactly as before -- but with
`HOST_READ_HEADER` and the host token. For a whole, uncompressed download of at least `MIN_BYTES` of a
file on the sandbox's root filesystem envd answers with the file's canonical path, size and response
headers instead of the bytes, and the proxy sends the file itself (`sendfile(2)`).

The host opens that path with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS)`
below the sandbox's rootfs: symlinks and `..` resolve inside the sandbox's own tree, never into the
host's, whatever envd (a program in the sandbox) answered. A path that is not a regular file there, or
whose size differs from envd's, falls back to envd sending the bytes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HOST_READ_HEADER = "X-Agentenv-Host-Read"  # the same name as agentenv.envd.files.HOST_READ_HEADER
# Below this a download goes through envd as before: one request either way, and the bytes are few.
MIN_BYTES = 1 << 20

_SYS_OPENAT2 = 437  # the same number on every Linux architecture (it postdates the split tables)
_RESOLVE_NO_XDEV, _RESOLVE_NO_MAGICLINKS, _RESOLVE_IN_ROOT = 0x01, 0x02, 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def open_in_root(root: Path, path: str) -> int:
    """An O_RDONLY fd of `path` resolved with `root` as "/" (no escaping it by symlink or `..`, no
    crossing into another mount). Raises OSError (ENOSYS on kernels before 5.6)."""
    if "\0" in path:
        raise OSError(errno.EINVAL, "NUL in path")
    dirfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = _OpenHow(os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC, 0,
                       _RESOLVE_IN_ROOT | _RESOLVE_NO_XDEV | _RESOLVE_NO_MAGICLINKS)
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
