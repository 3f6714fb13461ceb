"""Netlink sockets inside a named network namespace, without forking the server.

pyroute2 opens a socket in another netns (and creates a netns) in a forked child process: a fork of
the whole server, 15-25 ms each on our hosts, three per sandbox start. A namespace is a property of
a thread, so a short-lived thread of our own enters (or creates) the netns, opens the socket and
exits; the socket stays in the namespace it was made in. The thread is never reused, so nothing
else ever runs in the wrong namespace. ~1-2 ms. The egress proxy's sockets in a slot come from
here too.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_SHARED = 1 << 20
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


def _check(rc: int, what: str, path: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}", path)


def _share_rundir(rundir: str) -> None:
    """Make the netns run dir a shared mount (as `ip netns add` does), so that namespaces bound
    there are seen in every mount namespace (runsc's private one included)."""
    os.makedirs(rundir, exist_ok=True)
    if _libc.mount(b"", rundir.encode(), b"none", MS_SHARED | MS_REC, None) == 0:
        return
    _check(_libc.mount(rundir.encode(), rundir.encode(), b"none", MS_BIND | MS_REC, None), "mount --bind", rundir)
    _check(_libc.mount(b"", rundir.encode(), b"none", MS_SHARED | MS_REC, None), "mount --make-shared", rundir)


def _create_here(path: str) -> None:
    """In the calling (throw-away) thread: a new netns, bound to `path`."""
    _share_rundir(os.path.dirname(path))
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
    try:
        _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)", path)
        _check(_libc.mount(b"/proc/thread-self/ns/net", path.encode(), b"none", MS_BIND, None),
               "mount --bind", path)
    except BaseException:
        os.unlink(path)
        raise


def rebind(old: str, new: str) -> None:
    """Give the netns bound at `old` the name `new` (a bind mount at `new`, then `old` unmounted and
    removed). `new` must not exist. A rename(2) of a mount point is refused (EBUSY)."""
    os.close(os.open(new, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
    try:
        _check(_libc.mount(old.encode(), new.encode(), b"none", MS_BIND, None), "mount --bind", new)
    except BaseException:
        os.unlink(new)
        raise
    _check(_libc.umount2(old.encode(), MNT_DETACH), "umount", old)
    os.unlink(old)


def enter_netns(path: str) -> None:
    """The calling thread enters the netns bound at `path` (only a thread of `in_own_thread`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), "setns", path)
    finally:
        os.close(fd)


def _socket_in(path: str, create: bool, family: int, type_: int, proto: int,
               exclusive: bool = False) -> socket.socket:
    if create:
        try:
            _create_here(path)
        except FileExistsError:
            if exclusive:
                raise
            enter_netns(path)
    else:
        enter_netns(path)
    return socket.socket(family, type_, proto)


async def in_own_thread(work: Callable[[], T], *, name: str, discard: Callable[[T], None] | None = None) -> T:
    """`work()` in a new thread that ends with it and is never reused, so a namespace it entered
    (`enter_netns`) goes with it. `discard`: what to do with a result its caller no longer awaits."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            res = work()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            err = e  # `e` is unbound after the except block, the callback runs later
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_exception(err))
            return

        def deliver() -> None:
            if not fut.done():
                fut.set_result(res)
            elif discard is not None:  # the caller gave up (cancelled): do not leak what it made
                discard(res)

        loop.call_soon_threadsafe(deliver)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await fut


async def socket_in(path: str, family: int, type_: int, proto: int = 0, *, create: bool = False,
                    exclusive: bool = False) -> socket.socket:
    """A new socket living in the netns bound at `path` (`create`: make the netns if missing;
    `exclusive`: FileExistsError if it is not)."""
    return await in_own_thread(lambda: _socket_in(path, create, family, type_, proto, exclusive),
                               name="netns-socket", discard=lambda sock: sock.close())


async def netlink_fd(path: str, *, create: bool = False, exclusive: bool = False,
                     proto: int = socket.NETLINK_ROUTE) -> int:
    """A netlink socket's fd inside the netns bound at `path` (`create`: make the netns if missing;
    `exclusive`: FileExistsError if it is not)."""
    return (await socket_in(path, socket.AF_NETLINK, socket.SOCK_DGRAM, proto, create=create,
                            exclusive=exclusive)).detach()


NETLINK_NETFILTER = 12
_NFNL_SUBSYS_CTNETLINK = 1
_IPCTNL_MSG_CT_DELETE = 2
_NLM_F_REQUEST, _NLM_F_ACK = 0x1, 0x4
_NLMSG_ERROR = 2


async def flush_conntrack(path: str, timeout: float = 5.0) -> None:
    """Forget every connection-tracking entry of the netns bound at `path` (`conntrack -F` there):
    one ctnetlink DELETE request without attributes, for IPv4."""
    sock = await socket_in(path, socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.setblocking(False)
        sock.bind((0, 0))
        header = struct.pack("=IHHII", 20, (_NFNL_SUBSYS_CTNETLINK << 8) | _IPCTNL_MSG_CT_DELETE,
                             _NLM_F_REQUEST | _NLM_F_ACK, 1, 0)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, header + struct.pack("=BBH", socket.AF_INET, 0, 0))
        data = await asyncio.wait_for(loop.sock_recv(sock, 4096), timeout)
        _length, kind = struct.unpack_from("=IH", data)
        if kind == _NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, 16)
            if err not in (0, -errno.ENOENT):
                raise OSError(-err, f"conntrack flush: {os.strerror(-err)}", path)
    finally:
        sock.close()
