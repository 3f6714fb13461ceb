"""Periodic resource samples of every running sandbox, kept in bounded ring buffers.

Why the host side and not envd's own `/metrics`: the numbers must be true for what the sandbox
costs the node (gVisor's sentry, its page cache, the gofer) and must not depend on anything a user
can break inside the sandbox. The runtime puts each sandbox in cgroup `agentenv/<id>` (v1 or v2),
whose CPU and memory accounting gives exactly that; disk is the size of the sandbox's writable
layer (what it has written), against its disk limit.

One pass reads two or three small cgroup files per sandbox in a worker thread, every
`metrics_sample_interval_s`; the writable layers are walked every `DISK_EVERY` passes (disk use
changes slowly, and walking 100 layers is most of a pass's cost). Each sandbox keeps at most `metrics_history`
samples (E2B's SandboxMetric shape); its buffer goes away with the sandbox.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentenv.constants import CGROUP_PARENT, CGROUP_ROOT

log = logging.getLogger("agentenv.observability.sampler")

CGROUP_FS = Path(CGROUP_ROOT)
DISK_EVERY = 5


@dataclass(frozen=True)
class Sample:
    """One SandboxMetric (E2B's field meanings: bytes, percent of the sandbox's vCPUs)."""

    ts: float  # unix seconds
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int


@dataclass
class Totals:
    cpu_cores: float = 0.0
    mem_used: int = 0
    disk_used: int = 0
    snapshots: int = 0
    snapshot_bytes: int = 0


def _read_int(p: Path) -> int | None:
    try:
        return int(p.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_kv(p: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in p.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def cgroup_usage(sandbox_id: str) -> tuple[int, int, int] | None:
    """(cpu ns used so far, memory used bytes, page-cache bytes) of the sandbox's cgroup, v1 or v2.

    gVisor keeps application memory in a shared-memory file of the sentry, which the kernel
    accounts as shmem (part of "cache"): that is counted as used; only file pages that are not
    shmem (reclaimable page cache) are reported as cache.
    """
    v2 = CGROUP_FS / CGROUP_PARENT / sandbox_id
    if (v2 / "cpu.stat").exists():
        cpu = _read_kv(v2 / "cpu.stat").get("usage_usec")
        current = _read_int(v2 / "memory.current")
        if cpu is None or current is None:
            return None
        stat = _read_kv(v2 / "memory.stat")
        cache = max(0, stat.get("file", 0) - stat.get("shmem", 0))
        return cpu * 1000, max(0, current - cache), cache
    cpu = None
    for ctl in ("cpuacct", "cpu,cpuacct", "cpu"):
        cpu = _read_int(CGROUP_FS / ctl / CGROUP_PARENT / sandbox_id / "cpuacct.usage")
        if cpu is not None:
            break
    mem_dir = CGROUP_FS / "memory" / CGROUP_PARENT / sandbox_id
    usage = _read_int(mem_dir / "memory.usage_in_bytes")
    if cpu is None or usage is None:
        return None
    stat = _read_kv(mem_dir / "memory.stat")
    cache = max(0, stat.get("total_cache", stat.get("cache", 0)) - stat.get("total_shmem", stat.get("shmem", 0)))
    return cpu, max(0, usage - cache), cache


def dir_bytes(root: Path) -> int:
    """Bytes allocated by the files under `root` (st_blocks, like du), not following links or mounts."""
    total = 0
    stack = [str(root)]
    try:
        root_dev = os.lstat(root).st_dev
    except OSError:
        return 0
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if e.is_dir(follow_symlinks=False) and st.st_dev == root_dev:
                        stack.append(e.path)
        except OSError:
            continue
    return total


class ResourceSampler:
    """Samples running sandboxes every `interval` seconds; `history` samples per sandbox."""

    def __init__(self, orchestrator, *, interval: float = 2.0, history: int = 720,
                 on_pass: Callable[[float], None] | None = None) -> None:
        self.orch = orchestrator
        self.interval = max(0.2, interval)
        self.history = max(2, history)
        self.on_pass = on_pass
        self.samples: dict[str, deque[Sample]] = {}
        self._last_cpu: dict[str, tuple[float, int]] = {}  # id -> (monotonic, cpu ns)
        self.totals = Totals()
        self._task: asyncio.Task | None = None
        self._passes = 0
        self._disk: dict[str, int] = {}  # id -> bytes at the last walk

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="resource-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def series(self, sandbox_id: str, start: float | None = None, end: float | None = None) -> list[Sample]:
        buf = self.samples.get(sandbox_id)
        if not buf:
            return []
        return [s for s in buf if (start is None or s.ts >= start) and (end is None or s.ts <= end)]

    def latest(self, sandbox_id: str) -> Sample | None:
        buf = self.samples.get(sandbox_id)
        return buf[-1] if buf else None

    async def _loop(self) -> None:
        while True:
            t0 = time.perf_counter()
            try:
                await self.sample_once()
            except Exception:  # noqa: BLE001 - sampling must never take the server down
                log.exception("resource sampling pass failed")
            took = time.perf_counter() - t0
            if self.on_pass is not None:
                self.on_pass(took)
            await asyncio.sleep(max(0.05, self.interval - took))

    def _running(self) -> list:
        return [r for r in self.orch.records()
                if r.state.value == "running" and self.orch.has_slot(r.sandbox_id) and r.team_id]

    async def sample_once(self) -> None:
        recs = self._running()
        upper_of = self.orch.rootfs.upper_path
        walk = self._passes % DISK_EVERY == 0
        self._passes += 1
        jobs = [(r.sandbox_id, upper_of(r.sandbox_id), walk or r.sandbox_id not in self._disk) for r in recs]
        known = dict(self._disk)

        def measure() -> dict[str, tuple[tuple[int, int, int] | None, int]]:
            return {sid: (cgroup_usage(sid), dir_bytes(upper) if fresh else known[sid]) for sid, upper, fresh in jobs}

        measured = await asyncio.to_thread(measure)
        now_wall, now_mono = time.time(), time.monotonic()
        totals = Totals(snapshots=self.totals.snapshots, snapshot_bytes=self.totals.snapshot_bytes)
        for r in recs:
            usage, disk = measured.get(r.sandbox_id, (None, 0))
            if usage is None:
                continue
            self._disk[r.sandbox_id] = disk
            cpu_ns, mem_used, mem_cache = usage
            prev = self._last_cpu.get(r.sandbox_id)
            self._last_cpu[r.sandbox_id] = (now_mono, cpu_ns)
            if prev is None or now_mono <= prev[0] or cpu_ns < prev[1]:
                continue  # the first reading only sets the baseline for the CPU rate
            cores = (cpu_ns - prev[1]) / 1e9 / (now_mono - prev[0])
            pct = min(100.0, max(0.0, 100.0 * cores / max(1, r.cpu_count)))
            s = Sample(ts=now_wall, cpu_count=r.cpu_count, cpu_used_pct=round(pct, 2), mem_used=mem_used,
                       mem_total=r.memory_mb * 1024 * 1024, mem_cache=mem_cache, disk_used=disk,
                       disk_total=r.disk_mb * 1024 * 1024)
            buf = self.samples.get(r.sandbox_id)
            if buf is None:
                buf = self.samples[r.sandbox_id] = deque(maxlen=self.history)
            buf.append(s)
            totals.cpu_cores += cores
            totals.mem_used += mem_used
            totals.disk_used += disk
        # Forget sandboxes that are gone; paused ones keep their history (no new samples).
        for sid in list(self.samples):
            if self.orch.peek(sid) is None:
                self.samples.pop(sid, None)
        live = {r.sandbox_id for r in recs}
        for sid in list(self._last_cpu):
            if sid not in live:
                self._last_cpu.pop(sid, None)
        for sid in list(self._disk):
            if sid not in live:
                self._disk.pop(sid, None)
        try:
            snaps = await self.orch.store.list_snapshots()
            totals.snapshots = len(snaps)
            totals.snapshot_bytes = sum(s.size_bytes for s in snaps)
        except Exception:  # noqa: BLE001
            log.debug("snapshot catalog unavailable for metrics", exc_info=True)
        self.totals = totals
