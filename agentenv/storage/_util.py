"""Small host helpers shared by the storage modules: commands with timeouts, mount table, locks."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import RuntimeFailure


class CommandError(RuntimeFailure):
    """An external command failed or timed out."""


async def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    timeout: float,
    log: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Run argv with a hard timeout; returns combined output (or "" when `log` is given).

    The child gets its own session so a timeout kills the whole group it spawned (by its id),
    never anything else. Output goes to `log` (appended) when given; `on_line` sees every line.
    """
    argv = [os.fspath(a) for a in argv]
    logf = open(log, "ab") if log is not None else None
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        chunks: list[bytes] = []

        async def pump() -> None:
            assert proc.stdout is not None
            while line := await proc.stdout.readline():
                if logf is not None:
                    logf.write(line)
                    logf.flush()
                else:
                    chunks.append(line)
                if on_line is not None:
                    on_line(line.decode("utf-8", "replace").rstrip("\n"))
            await proc.wait()

        try:
            await asyncio.wait_for(pump(), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            if isinstance(exc, asyncio.CancelledError):
                raise
            where = f" (log: {log})" if log else ""
            raise CommandError(f"{argv[0]} timed out after {timeout:.0f}s{where}") from None
        out = b"".join(chunks).decode("utf-8", "replace")
        if proc.returncode != 0:
            where = f"; see {log}" if log else f": {out.strip()[-2000:]}"
            raise CommandError(f"{' '.join(argv[:3])} … exited with {proc.returncode}{where}")
        return out
    finally:
        if logf is not None:
            logf.close()


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
