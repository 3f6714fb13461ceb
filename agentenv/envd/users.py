"""OS users: resolving the selected user, resolving paths against their home, and acting as them.

File operations must be permission-checked as the selected user and leave files owned by them. envd is
one multi-threaded root process, so we switch *per-thread* credentials with raw syscalls (the kernel —
and gVisor — keep credentials per task; glibc's wrappers would broadcast the change to every thread).
Only the threads of the dedicated `UserExecutor` ever switch, and they switch back after each call.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import grp
import os
import platform
import pwd
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_KEEP = -1 & 0xFFFFFFFF   # "leave this id as it is" for setres[ug]id
# (setgroups, setresuid, setresgid) syscall numbers.
_SYSCALLS = {
    "x86_64": (116, 117, 119),
    "aarch64": (159, 147, 149),
}


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    groups: tuple[int, ...]

    @property
    def is_root(self) -> bool:
        return self.uid == 0


class UnknownUser(LookupError):
    pass


# What the user database's answers depend on: a user added, changed or put in a group changes one of
# these files (useradd, usermod and the like replace them).
_USER_DB = ("/etc/passwd", "/etc/group")
_users: dict[str, tuple[tuple, User]] = {}


def _user_db_version() -> tuple:
    version = []
    for path in _USER_DB:
        try:
            st = os.stat(path)
            version.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            version.append(None)
    return tuple(version)


def lookup_user(name: str) -> User:
    """The user `name` (KeyError: UnknownUser). Every request names one; the answer is kept until
    /etc/passwd or /etc/group change: getpwnam + getgrouplist read both files, several ms a
    request in a sandbox."""
    version = _user_db_version()
    cached = _users.get(name)
    if cached is not None and cached[0] == version:
        return cached[1]
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise UnknownUser(name) from None
    try:
        groups = tuple(os.getgrouplist(pw.pw_name, pw.pw_gid))
    except OSError:
        groups = (pw.pw_gid,)
    user = User(pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir or "/", groups)
    if len(_users) > 256:
        _users.clear()
    _users[name] = (version, user)
    return user


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def resolve_path(path: str, user: User) -> str:
    """Absolute, normalised path: `~` expands to the user's home, relative paths are relative to it.

    Symlinks are deliberately not resolved (entries report the path the caller asked for).
    Raises ValueError for a path no system call can take (a NUL byte).
    """
    if "\x00" in path:
        raise ValueError("path must not contain NUL bytes")
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    if not os.path.isabs(path):
        path = os.path.join(user.home, path)
    return os.path.normpath(path)


def thread_creds_supported() -> bool:
    return platform.machine() in _SYSCALLS


class ThreadCreds:
    """Switch the calling thread's credentials to a user's and back (raw syscalls: this thread only)."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        nums = _SYSCALLS.get(platform.machine())
        if nums is None:
            raise RuntimeError(f"unsupported architecture {platform.machine()!r}")
        self._setgroups, self._setresuid, self._setresgid = nums
        self._root_groups = os.getgroups() or [0]

    def _call(self, *args: int | ctypes.Array) -> None:
        if self._libc.syscall(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def become(self, user: User, *, real: bool = False) -> None:
        """Act as `user`: the effective ids, or (`real`) the real ones too, for a process this thread
        starts. The saved uid stays root's either way, so `restore` can switch back."""
        arr = (ctypes.c_uint * len(user.groups))(*user.groups)
        self._call(self._setgroups, len(user.groups), arr)
        self._call(self._setresgid, user.gid if real else _KEEP, user.gid, _KEEP)
        self._call(self._setresuid, user.uid if real else _KEEP, user.uid, _KEEP)

    def restore(self) -> None:
        self._call(self._setresuid, 0, 0, _KEEP)   # first: it brings back the capabilities the rest need
        self._call(self._setresgid, 0, 0, _KEEP)
        arr = (ctypes.c_uint * len(self._root_groups))(*self._root_groups)
        self._call(self._setgroups, len(self._root_groups), arr)


class UserExecutor:
    """Runs blocking filesystem calls on dedicated threads with the selected user's credentials."""

    def __init__(self, max_workers: int = 4) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="envd-user")
        self._creds = ThreadCreds() if os.geteuid() == 0 else None

    def _run(self, user: User | None, fn: Callable[..., T], *args: Any) -> T:
        if user is None or user.is_root or self._creds is None:
            return fn(*args)
        self._creds.become(user)
        try:
            return fn(*args)
        finally:
            try:
                self._creds.restore()
            except OSError:
                # A thread stuck with user credentials must never serve another call.
                os._exit(70)

    async def run(self, user: User | None, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(self._run, user, fn, *args))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
