"""Small host helpers shared by the storage modules: mount table, locks (commands: agentenv/proc.py)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import RuntimeFailure

# The subprocess runner is agentenv/proc.py (one module for network, storage and runtimes); these
# names stay importable from here for the storage modules.
from agentenv.proc import CommandError, run_streamed as run  # noqa: F401


# --- mount table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MountEntry:
    mount_point: str
    fstype: str
    source: str
    root: str
    super_options: str = ""


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def read_mountinfo(path: str = "/proc/self/mountinfo") -> list[MountEntry]:
    entries: list[MountEntry] = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            lf, rf = left.split(), right.split()
            if len(lf) < 5 or len(rf) < 2:
                continue
            entries.append(MountEntry(_unescape(lf[4]), rf[0], _unescape(rf[1]), _unescape(lf[3]),
                                      rf[2] if len(rf) > 2 else ""))
    return entries


def mounts_under(base: Path) -> list[str]:
    """Mount points at or below `base`, deepest first (the order to unmount them in)."""
    b = os.path.realpath(base)
    pts = {m.mount_point for m in read_mountinfo() if m.mount_point == b or m.mount_point.startswith(b + "/")}
    return sorted(pts, key=lambda p: p.count("/"), reverse=True)


log = logging.getLogger(__name__)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
MNT_DETACH = 2


def mount(source: str, target: str, fstype: str, data: str, flags: int = 0) -> None:
    """mount(2) directly: no process spawn per sandbox, and the errno is ours to report."""
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount -t {fstype} {target}: {os.strerror(e)}")


def umount(target: str, busy_wait: float = 3.0) -> None:
    """Unmount; falls back to a lazy detach when still busy after `busy_wait` s. Idempotent.

    Busy is usually transient (runsc's gofer still exiting). A lazily detached overlay keeps its
    upper/work dirs in use, and mounting them again (resume, capture) is undefined behaviour in
    overlayfs, so a real unmount is worth waiting a moment for.
    """
    t = target.encode()
    deadline = time.monotonic() + busy_wait
    while True:
        if _libc.umount2(t, 0) == 0:
            return
        e = ctypes.get_errno()
        if e in (errno.EINVAL, errno.ENOENT):
            return
        if e != errno.EBUSY or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if e == errno.EBUSY and _libc.umount2(t, MNT_DETACH) == 0:
        log.warning("%s stayed busy for %.1fs; detached it lazily", target, busy_wait)
        return
    e = ctypes.get_errno()
    raise OSError(e, f"umount {target}: {os.strerror(e)}")


def umount_all_under(base: Path) -> None:
    for mp in mounts_under(base):
        umount(mp)
    left = mounts_under(base)
    if left:
        raise RuntimeFailure(f"could not unmount {left}")


# --- cross-process lock ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def file_lock(path: Path, poll: float = 0.2) -> AsyncIterator[None]:
    """Exclusive flock on `path`, held across processes; polled so waiting stays cancellable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(poll)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def tree_size(root: Path) -> int:
    """Bytes used by the files of a tree (each hard-linked inode counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += st.st_size
    return total
