"""An out-of-memory killer inside the sandbox, so a memory hog loses its process, not the sandbox.

gVisor has no OOM killer of its own: when the sandbox's host cgroup hits its memory limit, the host
kernel kills the Sentry and with it every process of the sandbox. So the host cgroup gets some
headroom above the sandbox's memory size, and envd (PID 1) watches the sandbox's memory use; when
it passes the size the user asked for, it SIGKILLs the process with the largest resident set —
what the Linux OOM killer does in a VM. A thread (not the event loop) does the polling, so a
loaded loop cannot delay it. The host limit stays as the backstop for allocations faster than the
poll interval can see.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger("agentenv.envd")

POLL_S = 0.05  # the shortest time between two looks: near the limit, and always after a kill
POLL_MAX_S = 0.5
# Far under the limit the guard looks less often: again before memory could reach the limit at this
# rate (8 GiB/s; a process in a sandbox allocated 1.6 GiB/s on our 2-core host), so it is never
# later than a look every POLL_S would be for any process slower than that. An idle sandbox's guard
# wakes ~9 times a second instead of 20 (1 GiB sandbox, 100 MiB in use).
ALLOC_RATE = 8 << 30
ENV_LIMIT = "AGENTENV_ENVD_MEMORY_LIMIT_MB"


def _used(text: bytes) -> int:
    vals: dict[bytes, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(b":")
        if key in (b"MemTotal", b"MemAvailable", b"MemFree"):
            vals[key] = int(rest.split()[0]) * 1024
    return vals.get(b"MemTotal", 0) - vals.get(b"MemAvailable", vals.get(b"MemFree", 0))


def memory_used() -> int:
    """Bytes in use by the sandbox, from its own /proc/meminfo (gVisor accounts the whole sandbox)."""
    with open("/proc/meminfo", "rb") as f:
        return _used(f.read())


class MemInfo:
    """`memory_used` through one descriptor of /proc/meminfo kept open: a read at offset 0 makes the
    file anew, so a look is one system call instead of open + read + close. Inside gVisor each is a
    trip through the Sentry; measured in an idle sandbox, 20 looks a second cost 11 ms of host CPU a
    second that way and 4 ms this way (a 2 ms share of that is the wake-up alone)."""

    def __init__(self, path: str = "/proc/meminfo") -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def read(self) -> bytes:
        return os.pread(self._fd, 8192, 0)

    def used(self) -> int:
        return _used(self.read())

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    __del__ = close


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def biggest_process(pids: Iterable[int], exclude: set[int]) -> tuple[int, int] | None:
    """(pid, resident bytes) of the largest process among `pids`."""
    best: tuple[int, int] | None = None
    for pid in pids:
        if pid in exclude:
            continue
        rss = _rss(pid)
        if rss and (best is None or rss > best[1]):
            best = (pid, rss)
    return best


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


class OomGuard:
    """Kills the largest process while the sandbox uses more than `limit_bytes`."""

    def __init__(self, limit_bytes: int, candidates: Callable[[], Iterable[int]] = all_pids) -> None:
        # Inside a sandbox every process is a candidate; tests on a host pass their own children.
        self.limit = limit_bytes
        self.margin = min(32 << 20, limit_bytes // 20)
        self.candidates = candidates
        self.kills = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._meminfo: MemInfo | None = None  # opened by the first look
        self.last_used = 0

    @classmethod
    def from_environ(cls) -> "OomGuard | None":
        raw = os.environ.get(ENV_LIMIT, "").strip()
        return cls(int(raw) << 20) if raw.isdigit() and int(raw) > 0 else None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="oom-guard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def check_once(self) -> int | None:
        """One look; returns the pid it killed, if any."""
        if self._meminfo is None:
            self._meminfo = MemInfo()
        used = self._meminfo.used()
        # /proc/meminfo cannot show more than MemTotal (= the limit) in use: act when what is left
        # drops under a small margin, as the kernel's OOM killer acts when nothing is left.
        self.last_used = used
        if used < self.limit - self.margin:
            return None
        victim = biggest_process(self.candidates(), {os.getpid(), 1})
        if victim is None:
            return None
        pid, rss = victim
        cmd = _cmdline(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        self.kills += 1
        log.warning("out of memory (%d MiB used, limit %d MiB): killed pid %d (%s, %d MiB resident)",
                    used >> 20, self.limit >> 20, pid, cmd, rss >> 20)
        return pid

    def next_look_in(self) -> float:
        """Seconds to the next look: before the last seen use could reach the limit at ALLOC_RATE."""
        left = self.limit - self.margin - self.last_used
        return min(POLL_MAX_S, max(POLL_S, left / ALLOC_RATE))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    if self.check_once() is not None:
                        time.sleep(0.2)  # let the kernel free the victim's memory before looking again
                        continue
                except Exception:  # noqa: BLE001 - the guard must keep running
                    log.exception("oom guard check failed")
                self._stop.wait(self.next_look_in())
        finally:
            if self._meminfo is not None:
                self._meminfo.close()
                self._meminfo = None
