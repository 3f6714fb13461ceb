"""The pool of ready sandboxes: per template, a few sandboxes restored ahead of demand.

A pooled sandbox is restored from its template's warm image (or a built template's committed
image) into its own rootfs and network slot, and left running with envd healthy but not yet
`/init`ed. A create that matches a pool (`Source.key`: same template, image, layers, memory image,
runtime, resources; the node's default egress rules) takes one (`take`, no await) and only runs
`/init` (token, env vars, metadata) on it: the pooled sandbox's id, container, slot and rootfs
become the new sandbox's, which is why a pooled sandbox gets a sandbox id from the start. The
pool is refilled in the background, one restore at a time per template. While it waits, a pooled
sandbox is frozen whole in the host's cgroup freezer (`pool_freeze`, `SandboxHost.park`): an idle
gVisor sandbox costs 25-47 ms of CPU a second under runsc 20240729, a frozen one nothing; `take`
thaws it before anything else touches it.

Pooled sandboxes have no record: they are invisible to lists, metrics of sandboxes, quotas and the
proxy. The pool is bounded by `pool_size` per template and `pool_memory_mb` overall, drained on
memory pressure (`pool_min_available_mb`, `pool_max_memory_psi`) and when the server stops; what a
crash leaves behind (sandbox dirs without records) goes at the next start's reconcile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import Settings
from agentenv.constants import DEFAULT_USER
from agentenv.models import SandboxRecord, SandboxState, utcnow
from agentenv.orchestrator import envd_client
from agentenv.orchestrator.host import SandboxHost
from agentenv.orchestrator.ids import new_sandbox_id

log = logging.getLogger("agentenv.orchestrator")

PRESSURE_CHECK_S = 1.0      # how often memory pressure is read (two small /proc reads)
PRESSURE_CALM_S = 10.0      # how long pressure must be gone before the pool refills
FAILURE_BACKOFF_S = 30.0    # after a failed restore, a pool waits this long before the next one
# A refill waits for a quiet moment: REFILL_QUIET_S without a take from that pool, or REFILL_MAX_WAIT_S
# after the first take it answers if no sandbox is starting on the node meanwhile. A restore is
# ~0.25 s of CPU: it would otherwise compete with the very sandbox just taken (its /init and first
# command), and under a stream of creates with their own starts (the pool then moves no work, it only
# adds contention: the stream runs the ordinary way until it pauses).
REFILL_QUIET_S = 0.5
REFILL_MAX_WAIT_S = 2.0


@dataclass(frozen=True)
class Source:
    """What the sandboxes of one pool are restored from, and everything a create must match."""

    template_id: str
    runtime: str
    image: str
    layers: tuple[str, ...]
    memory: str                     # the memory image's digest
    restore_token: str | None       # the envd token the image holds (built templates), for /init
    cpu_count: int
    memory_mb: int
    disk_mb: int

    @property
    def key(self) -> tuple:
        return (self.template_id, self.runtime, self.image, self.layers, self.memory, self.cpu_count,
                self.memory_mb, self.disk_mb)


@dataclass
class Pooled:
    sandbox_id: str
    source: Source
    since: float
    parked: bool = False  # frozen in the host's cgroup freezer while it waits (`SandboxHost.park`)


class SandboxPool:
    def __init__(self, settings: Settings, host: SandboxHost, busy: Callable[[], bool] = lambda: False) -> None:
        """`busy()`: whether sandboxes are starting on the node now (refills wait for a quiet moment)."""
        self.settings = settings
        self.host = host
        self._busy = busy
        self._ready: dict[tuple, deque[Pooled]] = {}
        self._sources: dict[tuple, Source] = {}
        self._filling: dict[tuple, asyncio.Task] = {}
        self._restoring: dict[str, Source] = {}     # sandbox id -> source, restores in flight
        self._failed_at: dict[tuple, float] = {}
        self._last_take: dict[tuple, float] = {}
        self._short_since: dict[tuple, float] = {}  # first take not yet answered by a refill
        self._dropping: set[asyncio.Task] = set()   # teardowns of pools replaced by a newer image
        self._pressure_until = 0.0                  # monotonic time before which nothing refills
        self._pressure_logged = False
        self._monitor: asyncio.Task | None = None
        self._stopped = False
        self.taken: dict[str, int] = {}             # template -> creates served from the pool
        names = [n.strip() for n in settings.pool_templates.split(",") if n.strip()]
        self.on_demand = "*" in names
        self.named = {n for n in names if n != "*"} | ({"base"} if self.on_demand else set())

    # ------------------------------------------------------------------ queries

    @property
    def enabled(self) -> bool:
        return self.settings.pool_size > 0 and not self._stopped

    def wants(self, template_id: str, aliases: list[str]) -> bool:
        """Whether the template gets a pool at start (named in pool_templates, or the default one)."""
        return self.enabled and bool(self.named & {template_id, *aliases})

    def ready_counts(self) -> dict[str, int]:
        """Ready sandboxes per template (metrics)."""
        out: dict[str, int] = {}
        for key, q in self._ready.items():
            out[key[0]] = out.get(key[0], 0) + len(q)
        return out

    def memory_held_mb(self) -> int:
        held = sum(p.source.memory_mb for q in self._ready.values() for p in q)
        return held + sum(s.memory_mb for s in self._restoring.values())

    def artifacts_in_use(self) -> tuple[set[str], set[str]]:
        """Layers the pooled sandboxes mount and the memory images of the wanted pools (kept by GC)."""
        layers: set[str] = set()
        memory: set[str] = set()
        for src in list(self._sources.values()) + list(self._restoring.values()):
            layers.update(src.layers)
            memory.add(src.memory)
        for q in self._ready.values():
            for p in q:
                layers.update(p.source.layers)
        return layers, memory

    # ------------------------------------------------------------------ take

    def take(self, source: Source) -> Pooled | None:
        """A ready sandbox restored from `source` (it is the caller's from here on), or None. No await:
        two creates never get the same one. Either way the pool is (re)filled in the background."""
        if not self.enabled:
            return None
        q = self._ready.get(source.key)
        pooled = q.popleft() if q else None
        if pooled is not None:
            if pooled.parked:
                self.host.unpark(pooled.sandbox_id)
            self.taken[source.template_id] = self.taken.get(source.template_id, 0) + 1
            self._last_take[source.key] = time.monotonic()
            self._short_since.setdefault(source.key, time.monotonic())
        self.want(source)
        return pooled

    def want(self, source: Source, *, named: bool = False) -> None:
        """Keep a pool of `source` (replacing the template's pools of older images) and fill it."""
        if not self.enabled or not (named or self.on_demand or source.template_id in self.named):
            return
        if source.key not in self._sources:
            for key in [k for k, s in self._sources.items() if s.template_id == source.template_id
                        and s.runtime == source.runtime]:
                self._forget(key)  # the template has a new image: its old pool goes
            self._sources[source.key] = source
        self._fill_soon(source.key)
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch_pressure(), name="pool-pressure")

    async def forget_template(self, template_id: str) -> None:
        """The template is gone: its pools too (awaited: its layers may be collected right after)."""
        fills = [t for k, t in self._filling.items() if k[0] == template_id]
        for key in [k for k in self._sources if k[0] == template_id]:
            self._forget(key)
        await asyncio.gather(*fills, *self._dropping, return_exceptions=True)

    def _forget(self, key: tuple) -> None:
        self._sources.pop(key, None)
        task = self._filling.pop(key, None)
        if task is not None:
            task.cancel()
        for p in self._ready.pop(key, deque()):
            t = asyncio.create_task(self.host.teardown(p.sandbox_id, p.source.runtime), name=f"pool-drop-{p.sandbox_id}")
            self._dropping.add(t)
            t.add_done_callback(self._dropping.discard)

    # ------------------------------------------------------------------ fill

    def _fill_soon(self, key: tuple) -> None:
        if key in self._filling or key not in self._sources:
            return
        task = asyncio.create_task(self._fill(key), name=f"pool-{key[0]}")
        self._filling[key] = task
        task.add_done_callback(lambda t: self._filling.pop(key, None) if self._filling.get(key) is t else None)

    def _room(self, src: Source) -> bool:
        if not self.enabled or time.monotonic() < self._pressure_until:
            return False
        if self.under_pressure() is not None:  # checked before every restore, not only by the watcher
            self._pressure_until = time.monotonic() + PRESSURE_CALM_S
            return False
        if time.monotonic() - self._failed_at.get(src.key, -1e9) < FAILURE_BACKOFF_S:
            return False
        if len(self._ready.get(src.key, ())) >= self.settings.pool_size:
            return False
        return self.memory_held_mb() + src.memory_mb <= self.settings.pool_memory_mb

    async def _fill(self, key: tuple) -> None:
        while (src := self._sources.get(key)) is not None and self._room(src):
            await self._quiet_moment(key)
            if not self._room(src):
                return
            self._short_since.pop(key, None)
            if not await self._restore_one(src):
                return

    async def _quiet_moment(self, key: tuple) -> None:
        while True:
            now = time.monotonic()
            last, first = self._last_take.get(key, -1e9), self._short_since.get(key, now)
            if now - last >= REFILL_QUIET_S or (now - first >= REFILL_MAX_WAIT_S and not self._busy()):
                return
            await asyncio.sleep(max(0.05, min(REFILL_QUIET_S - (now - last), REFILL_MAX_WAIT_S - (now - first))) + 0.01)

    async def _restore_one(self, src: Source) -> bool:
        sid = new_sandbox_id()
        self._restoring[sid] = src
        rec = self._record(sid, src)
        t0 = time.monotonic()
        ok = False
        try:
            mem = await self.host.pin_memory(src.memory)
            try:
                rootfs, slot = await self.host.prepare(rec)
                tools = await self.host.images.ensure_tools()
                await self.host.launch(rec, rootfs, slot, tools, restore_from=mem, new_boot=True)
            finally:
                self.host.unpin(src.memory)
            await self._first_process(slot.host_ip, src)
            ok = True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - creates go the ordinary way meanwhile
            self._failed_at[src.key] = time.monotonic()
            log.warning("pool: restore of template %s failed (%s); retrying in %.0fs", src.template_id, e,
                        FAILURE_BACKOFF_S)
        finally:
            self._restoring.pop(sid, None)
            if not ok:
                await asyncio.shield(self.host.teardown(sid, src.runtime))
        if self._stopped or src.key not in self._sources or time.monotonic() < self._pressure_until:
            await asyncio.shield(self.host.teardown(sid, src.runtime))  # dropped or drained meanwhile
            return False
        parked = self.settings.pool_freeze and self.host.park(sid)
        self._ready.setdefault(src.key, deque()).append(Pooled(sid, src, time.monotonic(), parked))
        log.info("pool: %s of template %s ready in %.3fs%s", sid, src.template_id, time.monotonic() - t0,
                 " (frozen while it waits)" if parked else "")
        return True

    @staticmethod
    async def _first_process(host_ip: str, src: Source) -> None:
        """Run one login shell in the restored sandbox before anyone takes it: a restored envd's first
        fork pays for faulting its memory back in (~20 ms under gVisor), here instead of in the
        first command of the create that takes it."""
        try:
            await envd_client.warm_login_shell(host_ip, access_token=src.restore_token, user=DEFAULT_USER)
        except Exception as e:  # noqa: BLE001 - the sandbox works all the same, its first command is slower
            log.info("pool: no first process in a sandbox of template %s (%s)", src.template_id, e)

    def _record(self, sid: str, src: Source) -> SandboxRecord:
        """The host's view of a pooled sandbox (no state store, no lifecycle: it has no record yet)."""
        now = utcnow()
        return SandboxRecord(
            sandbox_id=sid, template_id=src.template_id, team_id="", state=SandboxState.CREATING, started_at=now,
            end_at=now, cpu_count=src.cpu_count, memory_mb=src.memory_mb, disk_mb=src.disk_mb,
            envd_access_token="", allow_internet_access=self.settings.allow_internet_access, network=None,
            runtime=src.runtime, image=src.image, layers=list(src.layers))

    # ------------------------------------------------------------------ drain

    async def drain(self, why: str) -> int:
        """Tear every ready sandbox down (a restore in flight is torn down when it ends: `_restore_one`)."""
        pooled = [p for q in self._ready.values() for p in q]
        self._ready.clear()
        if pooled:
            log.info("pool: draining %d ready sandboxes (%s)", len(pooled), why)
        await asyncio.gather(*(asyncio.shield(self.host.teardown(p.sandbox_id, p.source.runtime))
                               for p in pooled), return_exceptions=True)
        return len(pooled)

    def under_pressure(self) -> str | None:
        """Why the host is short of memory now, or None."""
        avail = _mem_available_mb()
        if avail is not None and avail < self.settings.pool_min_available_mb:
            return f"MemAvailable {avail} MiB < {self.settings.pool_min_available_mb} MiB"
        psi = _memory_psi_some_avg10()
        if psi is not None and psi > self.settings.pool_max_memory_psi:
            return f"memory PSI some avg10 {psi:.1f}% > {self.settings.pool_max_memory_psi}%"
        return None

    async def _watch_pressure(self) -> None:
        while not self._stopped:
            try:
                why = self.under_pressure()
                if why is not None:
                    first = not self._pressure_logged
                    self._pressure_logged = True
                    self._pressure_until = time.monotonic() + PRESSURE_CALM_S
                    if first or any(self._ready.values()):
                        log.warning("pool: memory pressure (%s): draining, no refills for %.0fs", why, PRESSURE_CALM_S)
                    await self.drain(why)
                elif time.monotonic() >= self._pressure_until:
                    self._pressure_logged = False
                    for key in list(self._sources):
                        if len(self._ready.get(key, ())) < self.settings.pool_size:
                            self._fill_soon(key)
            except Exception:  # noqa: BLE001
                log.exception("pool: pressure check failed")
            await asyncio.sleep(PRESSURE_CHECK_S)

    async def stop(self) -> None:
        """Server stop: no more refills, every pooled sandbox (ready or being restored) torn down."""
        self._stopped = True
        tasks = [t for t in [self._monitor, *self._filling.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.drain("server stop")
        await asyncio.gather(*self._dropping, return_exceptions=True)
        self._sources.clear()


def _mem_available_mb() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return None


def _memory_psi_some_avg10() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        line = Path("/proc/pressure/memory").read_text().splitlines()[0]
        return float(dict(f.split("=") for f in line.split()[1:])["avg10"])
    return None
